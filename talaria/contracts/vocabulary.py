"""The words every layer shares: how a switch opens a model, and where a session's KV lives.

The stager decides the switch path, the switch record reports it, the profile prices it, the round
scheduler and the router predict it, the simulator charges it and the dashboard counts it: one Enum,
and one rule from staging coverage to path, so no layer re-types the strings. Both are `str` Enums:
their values are what JSON, TOML and the event log carry. (The config's own enums, `Pool` and
`Overload` among them, live in `talaria.config.schema`, at the same layer.)
"""

from __future__ import annotations

from enum import Enum


class SwitchPath(str, Enum):
    """How a switch opens the target weights, best first (paper Table 2)."""

    FULL_D2D = "full_d2d"  # every chunk gathered device-to-device
    PARTIAL = "partial"  # some chunks D2D, the rest topped up from host
    H2D_ONLY = "h2d_only"  # nothing staged: the whole image comes from host

    @property
    def severity(self) -> int:
        """0 for FULL_D2D, 1 for PARTIAL, 2 for H2D_ONLY: the worse the path, the higher."""
        return _SEVERITY[self]

    @classmethod
    def for_coverage(cls, coverage: float) -> SwitchPath:
        """The path a switch takes when `coverage` of the target's weight bytes are staged clean."""
        return cls.FULL_D2D if coverage >= 1.0 else cls.PARTIAL if coverage > 0 else cls.H2D_ONLY


_SEVERITY = {SwitchPath.FULL_D2D: 0, SwitchPath.PARTIAL: 1, SwitchPath.H2D_ONLY: 2}


class KVLocation(str, Enum):
    """Where a session's prefix can come from, as the router and scheduler see it."""

    DEVICE = "device"  # in the active model's device prefix cache
    HOST = "host"  # restorable from published host slabs (HKVR)
    MISSING = "missing"  # must be recomputed (partly held prefixes count here: their tokens say how much)
