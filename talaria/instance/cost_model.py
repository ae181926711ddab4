"""Predicted costs for the round scheduler: a profile's curves, corrected by what steps measure.

The profile (talaria/contracts/profile.py) says what prefill, decode, KV restore and switches cost
on this hardware. Machines drift from their profile (other load, thermal limits, a profile measured
elsewhere), so each kind of work keeps an EWMA of measured / predicted and scales its predictions
by it. The simulator charges the profile's own numbers and never observes, so its scales stay 1.
"""

from __future__ import annotations

from talaria.contracts.profile import Profile
from talaria.contracts.vocabulary import SwitchPath

EWMA_ALPHA = 0.2  # weight of the newest measurement
MAX_SCALE = 10.0  # one wild measurement (a GC pause, a page fault storm) cannot wreck the budget


class CostModel:
    def __init__(self, profile: Profile, alpha: float = EWMA_ALPHA) -> None:
        self.profile = profile
        self.alpha = alpha
        self._scale: dict[tuple[str, str], float] = {}  # (model, kind) -> EWMA of measured / predicted

    def scale(self, model: str, kind: str) -> float:
        return self._scale.get((model, kind), 1.0)

    def prefill_s(self, model: str, tokens: int, cached: int = 0) -> float:
        return self.profile.prefill_s(model, tokens, cached) * self.scale(model, "prefill")

    def decode_s(self, model: str, batch: int, context: int = 0) -> float:
        return self.profile.decode_s(model, batch, context) * self.scale(model, "decode")

    def restore_s(self, model: str, tokens: int) -> float:
        return self.profile.restore_s(model, tokens) * self.scale(model, "prefill")

    def switch_s(self, model: str, path: SwitchPath) -> float:
        return self.profile.switch_s(model, path) * self.scale(model, f"switch:{path.value}")

    def observe(self, model: str, kind: str, predicted: float, measured: float) -> None:
        """Fold one measurement in; `kind` is "prefill", "decode" or "switch:<path>"."""
        if predicted <= 0 or measured <= 0 or self.alpha == 0:
            return  # alpha = 0: trust the profile as it is
        base = predicted / self.scale(model, kind)  # what the profile alone predicted
        ratio = min(MAX_SCALE, max(1 / MAX_SCALE, measured / base))
        old = self._scale.get((model, kind))
        self._scale[(model, kind)] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio

    def telemetry(self) -> dict[str, float]:
        """The current corrections, "model/kind" -> scale (1.0 = the profile is right)."""
        return {f"{m}/{k}": round(v, 4) for (m, k), v in sorted(self._scale.items())}
