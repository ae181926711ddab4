"""Gateway <-> instance contract: what a call carries to an instance and what comes back.

Owned by the Foundation issue; the router and the simulator reuse these records unchanged and
extend them only by adding fields with defaults. Serialised form and transport: docs/contracts.md.

Transport: each instance's rank-0 worker holds one end of a `multiprocessing` duplex pipe to the
supervisor; messages are these dataclasses, pickled. The supervisor's event loop reads the
pipe itself. Everything is token ids: tokenizing, chat templates,
detokenizing and stop strings live in the gateway, so the engine never sees text.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from operator import attrgetter

from talaria.contracts.profile import Profile
from talaria.contracts.telemetry import InstanceStats  # noqa: F401  (a message of this transport)


def _pickled_by_fields(cls: type) -> type:
    """Pickle as `cls(*fields)`: half the time of pickle's default for slotted dataclasses. The
    messages of every call cross the pipe this way, each pickled once and unpickled once."""
    names = [f.name for f in fields(cls)]
    get = attrgetter(*names)
    cls.__reduce__ = (lambda self: (cls, (get(self),))) if len(names) == 1 else (lambda self: (cls, get(self)))
    return cls


GREEDY_BELOW = 1e-5  # a lower temperature samples greedily: dividing logits by it could overflow to inf


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # same seed + same prompt -> same tokens
    ignore_eos: bool = False  # replay needs fixed completion lengths
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    grammar: str | None = None  # llguidance grammar the output must follow (constrained decoding); None: free

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class InstanceCall:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str | None = None
    enqueue_time: float = 0.0  # intended enqueue, node monotonic clock (s); TTFT is measured from it
    cache_salt: str | None = None  # its tenant and `cache_salt`: KV prefixes are shared only among equal salts


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class CancelCall:
    """The client went away or a stop string matched: stop decoding and release the KV."""

    request_id: str


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache, not recomputed
    restored_tokens: int = 0  # of those, tokens restored from host memory (HKVR) rather than device


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class CallTimings:
    """Seconds, measured by the instance; diagnostic sub-views, they may overlap."""

    queued_s: float = 0.0  # arrival at the instance -> first scheduled
    prefill_s: float = 0.0  # time in steps that prefilled this call's prompt
    decode_s: float = 0.0  # first token -> last token
    first_token_at: float = 0.0  # node monotonic clock (time.monotonic) at the first token
    service_s: float = 0.0  # arrival at the instance -> its final record: everything the instance spent on the call


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class CallOutput:
    """Tokens as they are produced; the last record of a call has `finish` set."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens since the previous record
    finish: FinishReason | None = None
    usage: Usage | None = None  # on the final record
    committed_kv_tokens: int = 0  # KV the instance holds for this sequence after the call
    timings: CallTimings | None = None  # on the final record
    error: str | None = None  # with finish == ERROR


@dataclass(frozen=True, slots=True)
class InstanceReady:
    instance: str
    models: tuple[str, ...]
    kv_pages_total: int
    load_s: float
    error: str | None = None  # the engine could not start (bad weights, arena too small, ...)
    profile: Profile | None = None  # the costs it runs on (loaded, or measured at start-up): the router's cost model


@dataclass(frozen=True, slots=True)
class SwitchModel:
    """Admin: open `model` on this instance now (a forced switch); answered by SwitchDone."""

    model: str
    request_id: str


@dataclass(frozen=True, slots=True)
class SwitchDone:
    request_id: str
    record: dict | None  # the SwitchRecord as JSON; None when the model was already active
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass
