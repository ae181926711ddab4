"""Predicted costs for an instance: its profile's prices, corrected by what its steps measure.

The profile (talaria/contracts/profile.py) prices prefill, decode, KV restores, whole steps and
switches on this hardware; the simulator charges exactly those prices. Machines drift from their
profile (other load, thermal limits, a profile measured elsewhere), so every instance, hot or cold,
keeps per model and kind of work an EWMA of measured / profile-priced time and scales its
predictions by it. Kinds: "prefill" (also scales KV restores; a step that prefills anything teaches
it), "decode", and "switch:<path>". The simulator runs with alpha 0: its scales stay 1.
"""

from __future__ import annotations

from talaria.contracts.profile import Profile
from talaria.contracts.step_plan import StepPlan
from talaria.contracts.vocabulary import SwitchPath

EWMA_ALPHA = 0.2  # weight of the newest measurement
MAX_SCALE = 10.0  # one wild measurement (a GC pause, a page fault storm) cannot wreck the budget


class CostModel:
    def __init__(self, profile: Profile, page_size: int, alpha: float = EWMA_ALPHA) -> None:
        self.profile = profile
        self.page_size = page_size  # tokens per KV page: what a restore in a step plan moves
        self.alpha = alpha
        self._scale: dict[tuple[str, str], float] = {}  # (model, kind) -> EWMA of measured / priced

    def scale(self, model: str, kind: str) -> float:
        return self._scale.get((model, kind), 1.0)

    def prefill_s(self, model: str, tokens: int, cached: int = 0, batched: bool = False) -> float:
        return self.profile.prefill_s(model, tokens, cached, batched) * self.scale(model, "prefill")

    def prefill_fixed_s(self, model: str) -> float:
        """The fixed cost of one prefill step (what a chunk joining a step does not pay again)."""
        return self.profile.model(model).prefill.base_s * self.scale(model, "prefill")

    def decode_s(self, model: str, batch: int, context: int = 0) -> float:
        return self.profile.decode_s(model, batch, context) * self.scale(model, "decode")

    def restore_s(self, model: str, tokens: int, states: int = 0) -> float:
        """`tokens` tokens of host KV and `states` state snapshots back to the device."""
        return self.profile.restore_s(model, tokens, states) * self.scale(model, "prefill")

    def step_s(self, plan: StepPlan) -> float:
        """One engine step as the profile prices it (`Profile.step_parts`), each part corrected
        (restores with prefill, as `restore_s`)."""
        prefill, restore, decode = self.profile.step_parts(plan, self.page_size)
        return (prefill + restore) * self.scale(plan.model, "prefill") + decode * self.scale(plan.model, "decode")

    def switch_s(self, model: str, coverage: float = 0.0) -> float:
        path = SwitchPath.for_coverage(coverage)
        return self.profile.switch_s(model, coverage) * self.scale(model, f"switch:{path.value}")

    def observe(self, model: str, kind: str, predicted: float, measured: float) -> None:
        """Fold in one measurement of what was predicted at the current scale of `kind`."""
        if predicted <= 0 or measured <= 0 or self.alpha == 0:
            return  # alpha = 0: trust the profile as it is
        base = predicted / self.scale(model, kind)  # what the profile alone priced
        ratio = min(MAX_SCALE, max(1 / MAX_SCALE, measured / base))
        old = self._scale.get((model, kind))
        self._scale[(model, kind)] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio

    def observe_step(self, plan: StepPlan, measured: float) -> None:
        """Fold in a whole step (a hot instance's mixed batch): it teaches "prefill" if it prefilled
        anything, else "decode", by its measured / profile-priced ratio."""
        if self.alpha == 0:
            return
        kind = "decode" if all(c.decode for c in plan.chunks) else "prefill"
        priced = self.profile.step_s(plan, self.page_size)
        self.observe(plan.model, kind, priced * self.scale(plan.model, kind), measured)

    def telemetry(self) -> dict[str, float]:
        """The current corrections, "model/kind" -> scale (1.0 = the profile is right)."""
        return {f"{m}/{k}": round(v, 4) for (m, k), v in sorted(self._scale.items())}
