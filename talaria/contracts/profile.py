"""Cost profile: predicted seconds for prefill, decode, KV save/restore and model switches.

One TOML file per hardware x set of models, so that the round scheduler, the router's cost model,
the simulator and `talaria profile` all predict with the same numbers and can say where each came
from. Times are seconds, sizes bytes, rates bytes per second. The file form is read and written by
`talaria.contracts.profile_file` (the only place that validates a profile: everything downstream
trusts these dataclasses); layout and keys: docs/profile.md. Calibration fits the curves
(`talaria.executor.curve_fit`); no torch here, so a profile loads anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from talaria.contracts.kv_layout import KVLayout, sized_layout
from talaria.contracts.step_plan import StepPlan
from talaria.contracts.vocabulary import SwitchPath

PROFILE_SCHEMA = 1
PHASE_NAMES = ("save_teardown", "open_weights", "kv_shell", "runtime", "publish")  # paper App. D
DEVICES = ("cpu", "cuda")


class ProfileError(ValueError):
    """A profile file (or a lookup in one) the user must fix; names the file and the dotted key."""


@dataclass(frozen=True, slots=True)
class PrefillCurve:
    """time = base_s + per_token_s * n + per_token_context_s * n * (cached + n / 2).

    n new tokens after `cached` tokens of reused prefix; the last term is attention, where the
    i-th new token attends over cached + i tokens (about cached + n/2 on average).
    """

    base_s: float  # fixed cost of one prefill (launch, sampling)
    per_token_s: float  # per new token: projections and MLP
    per_token_context_s: float = 0.0  # attention: per new token, per token of context it attends over

    def seconds(self, tokens: int, cached: int = 0) -> float:
        if tokens < 0 or cached < 0:
            raise ValueError(f"prefill of tokens={tokens}, cached={cached}: both must be >= 0")
        if tokens == 0:
            return 0.0
        return (self.base_s + self.per_token_s * tokens
                + self.per_token_context_s * tokens * (cached + tokens / 2))


@dataclass(frozen=True, slots=True)
class DecodeCurve:
    """One decode step of `batch` sequences holding `context` tokens in all.

    time = base_s + per_seq_s * batch + per_context_token_s * context
    """

    base_s: float  # fixed cost of one step (weights read once per step)
    per_seq_s: float  # per sequence in the batch
    per_context_token_s: float = 0.0  # per token of KV read by attention, summed over the batch

    def seconds(self, batch: int, context: int = 0) -> float:
        if batch < 0 or context < 0:
            raise ValueError(f"decode of batch={batch}, context={context}: both must be >= 0")
        if batch == 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """Opening this model by one load path, in the five ordered phases of a switch (paper App. D)."""

    path: SwitchPath
    phase_s: tuple[float, float, float, float, float]  # seconds per phase, in PHASE_NAMES order

    @property
    def total_s(self) -> float:
        return sum(self.phase_s)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model's prices on this hardware, and the sizes of its cache: `layout` rebuilds the cache
    descriptor from them, so the simulator and the router size and price exactly as the engine."""

    name: str  # the model's name in talaria.toml
    weights_bytes: int  # per rank
    token_bytes: int  # per rank: every per-token cache tensor of every layer (KVLayout.token_bytes)
    # per rank: one sequence's state slot (KVLayout.state_bytes); 0 = no per-sequence state. Keyword
    # only, so that positional constructions of a stateless model stay as they were
    state_bytes: int = field(default=0, kw_only=True)
    prefill: PrefillCurve
    decode: DecodeCurve
    switch: dict[SwitchPath, SwitchCost]  # by path: opening this model; missing paths allowed
    sources: dict[str, str] = field(default_factory=dict)  # key -> where the number comes from

    def layout(self, page_size: int) -> KVLayout:
        """This model's cache in pages of `page_size` tokens, known by its sizes alone."""
        return sized_layout(page_size, self.token_bytes, self.state_bytes)


@dataclass(frozen=True, slots=True)
class Bandwidth:
    h2d_bytes_per_s: float  # host -> device: weight H2D, and KV restore unless restore is measured
    d2h_bytes_per_s: float  # device -> host: KV save to host
    d2d_bytes_per_s: float  # device -> device: staged-weight gather
    restore_bytes_per_s: float | None = None  # HKVR restore (host slabs -> KV pages), when measured

    @property
    def restore(self) -> float:
        return self.restore_bytes_per_s or self.h2d_bytes_per_s


@dataclass(frozen=True, slots=True)
class Profile:
    """The cost model of one hardware for a set of models."""

    hardware: str  # e.g. "cpu: AMD EPYC 7B13, 2 threads" or "cuda: NVIDIA H200 x8"
    device: str  # one of DEVICES
    tp: int  # tensor-parallel ranks the numbers were taken with
    device_bytes: int  # memory per device (HBM, or the arena on CPU)
    created: str  # ISO 8601 date-time
    method: str  # how it was made: "start-up calibration", "talaria profile", "paper-derived"
    bandwidth: Bandwidth
    models: dict[str, ModelProfile]  # by model name
    sources: dict[str, str] = field(default_factory=dict)  # key -> where the number comes from
    schema: int = PROFILE_SCHEMA  # file layout version
    host_bytes: int | None = None  # host memory of the machine the TP group runs on; None: not given

    def model(self, name: str) -> ModelProfile:
        if name not in self.models:
            have = ", ".join(sorted(self.models)) or "none"
            raise ProfileError(f"profile ({self.hardware}) has no model {name!r} (it has: {have}); "
                               "profile that model with `talaria profile`")
        return self.models[name]

    # ---- prices: the simulator charges, and the scheduler and router predict, with these alone ----------

    def prefill_s(self, model: str, tokens: int, cached: int = 0, batched: bool = False) -> float:
        """One prefill chunk of `tokens` new tokens after `cached` reused ones. `batched`: the chunk
        joins a step whose forward already pays the fixed cost (`base_s`), so it adds only its own."""
        curve = self.model(model).prefill
        seconds = curve.seconds(tokens, cached)
        return seconds - curve.base_s if batched and tokens else seconds

    def decode_s(self, model: str, batch: int, context: int = 0) -> float:
        return self.model(model).decode.seconds(batch, context)

    def restore_s(self, model: str, tokens: int, states: int = 0) -> float:
        """Copying `tokens` tokens of KV and `states` state snapshots from host memory to the device."""
        return self._nbytes(model, tokens, states) / self.bandwidth.restore

    def save_s(self, model: str, tokens: int, states: int = 0) -> float:
        """Copying `tokens` tokens of KV and `states` state snapshots from the device to host memory."""
        return self._nbytes(model, tokens, states) / self.bandwidth.d2h_bytes_per_s

    def _nbytes(self, model: str, tokens: int, states: int) -> int:
        # invariant: an int, divided once, so a stateless model's price is exactly tokens * token_bytes / rate
        m = self.model(model)
        return tokens * m.token_bytes + states * m.state_bytes

    def step_parts(self, plan: StepPlan, page_size: int) -> tuple[float, float, float]:
        """(prefill, restore, decode) seconds of one engine step: its prompt chunks as one batched
        prefill (the fixed cost once, then each chunk's own), its host KV restores (`page_size` tokens
        each, and a state slot each state restore) before the forward, and its decode chunks as one
        decode step."""
        prefill, restore, decode, context, first = 0.0, 0.0, 0, 0, True
        for c in plan.chunks:
            if c.decode:
                decode += 1
                context += c.context_len
            else:
                prefill += self.prefill_s(plan.model, len(c.token_ids), c.start_pos, batched=not first)
                first = False
        if plan.ops is not None and (plan.ops.restores or plan.ops.state_restores):
            restore = self.restore_s(plan.model, len(plan.ops.restores) * page_size, len(plan.ops.state_restores))
        return prefill, restore, self.decode_s(plan.model, decode, context)

    def step_s(self, plan: StepPlan, page_size: int) -> float:
        """Seconds of one engine step (see `step_parts`)."""
        return sum(self.step_parts(plan, page_size))

    def switch_phases(self, model: str, coverage: float = 0.0) -> tuple[float, ...]:
        """Seconds of each phase (PHASE_NAMES) of opening `model` with `coverage` of its weight bytes
        staged clean, by the path that coverage gives (`SwitchPath.for_coverage`).

        A recorded path's phases are used as recorded. An unrecorded full-D2D or H2D-only path is
        estimated: its weight copy (weights_bytes over the d2d or h2d rate) as `open_weights`, the
        other four phases from the first recorded path (none when nothing is recorded). A partial
        open copies the staged bytes D2D and the rest H2D, so its `open_weights` interpolates
        linearly between the two paths' by the fraction left to H2D, and its other phases are the
        recorded partial ones (else the mean of the two paths'). Only when partial is recorded and
        full-D2D or H2D-only is not is the recorded partial taken whole: it was measured at a real
        coverage, which beats interpolating towards an estimate.
        """
        m = self.model(model)
        path = SwitchPath.for_coverage(coverage)
        recorded = m.switch.get(path)
        if path is not SwitchPath.PARTIAL:
            if recorded is not None:
                return recorded.phase_s
            first = next((m.switch[p].phase_s for p in SwitchPath if p in m.switch), (0.0,) * len(PHASE_NAMES))
            rate = self.bandwidth.h2d_bytes_per_s if path is SwitchPath.H2D_ONLY else self.bandwidth.d2d_bytes_per_s
            return (first[0], m.weights_bytes / rate, *first[2:])
        if recorded is not None and not (SwitchPath.FULL_D2D in m.switch and SwitchPath.H2D_ONLY in m.switch):
            return recorded.phase_s
        d2d, h2d = self.switch_phases(model, 1.0), self.switch_phases(model, 0.0)
        phases = recorded.phase_s if recorded is not None else tuple((a + b) / 2 for a, b in zip(d2d, h2d))
        return (phases[0], d2d[1] + (h2d[1] - d2d[1]) * (1.0 - coverage), *phases[2:])

    def switch_s(self, model: str, coverage: float = 0.0) -> float:
        """Seconds to open `model` with `coverage` of its weight bytes staged clean (0: an H2D open)."""
        return sum(self.switch_phases(model, coverage))

    def with_model(self, model: ModelProfile) -> Profile:
        """A copy with `model` added, or replacing the model of the same name."""
        return dataclasses.replace(self, models={**self.models, model.name: model})

    def with_prefill_base(self, base_s: float) -> Profile:
        """A copy in which one prefill step of any model has the fixed cost `base_s`: a sensitivity
        check (profiles/README.md), never a calibration."""
        models = {n: dataclasses.replace(m, prefill=dataclasses.replace(m.prefill, base_s=base_s))
                  for n, m in self.models.items()}
        return dataclasses.replace(self, models=models)
