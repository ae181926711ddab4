"""What the router knows about one instance: its latest snapshot, cost profile, health and overlay.

`Router.observe` derives from each snapshot what every decision reads, so a decision does dict
lookups, not scans: the sessions the snapshot lists, the models the instance holds, and per model
the cost terms that do not depend on the call (`terms`, filled lazily by `talaria.routing.costs`,
cleared by the next snapshot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from talaria.contracts.profile import Profile
from talaria.contracts.telemetry import InstanceStats
from talaria.contracts.vocabulary import KVLocation

if TYPE_CHECKING:
    from talaria.routing.costs import Terms
    from talaria.routing.session_load import InstanceLoad


@dataclass(slots=True)
class InstanceView:
    """One instance as the router sees it; `node` is None here, a peer's base URL otherwise."""

    name: str
    models: tuple[str, ...]
    node: str | None = None
    healthy: bool = False
    snapshot: InstanceStats | None = None
    received_at: float = -math.inf  # router clock when the snapshot was taken (or arrived)
    profile: Profile | None = None
    sent: int = 0  # calls routed here since the snapshot (the in-flight overlay)
    in_flight: int = 0  # calls routed here and not finished
    # (session, model) -> (kv_tokens, location) of the snapshot's entry for it
    listed: dict[tuple[str, str], tuple[int, KVLocation]] = field(default_factory=dict)
    holds: frozenset[str] = frozenset()  # models active, staged or with work here
    ttft_s: float | None = None  # its TTFT target (a local instance's config); None for a peer's: unknown
    # the sessions admitted here: their calls held or running, the next calls of those in tool gaps, their
    # prefixes (talaria/routing/session_load.py); set by the gateway's dispatcher, None elsewhere (simulator)
    load: InstanceLoad | None = None
    terms: dict[str, Terms] = field(default_factory=dict)  # model -> its call-independent cost terms
