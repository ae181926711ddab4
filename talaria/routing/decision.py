"""What the router is asked and what it answers: one call to place, and where it went and why.

Records on the decision path are plain slotted dataclasses, not frozen ones: a frozen dataclass's
__init__ costs ~2 us here, and a lease hit has a 20 us budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from talaria.routing.costs import Cost
    from talaria.routing.leases import Lease


class Reason(str, Enum):
    LEASE_HIT = "lease-hit"  # a live lease was consumed
    RANKED = "ranked"  # the cheapest candidate holding the model (or nobody holds it)
    REPLICA = "replica"  # a new replica: the gain beat T_swap + mu*dW + nu
    STICKY = "sticky"  # session-sticky: the session's last instance
    LEAST_PRESSURE = "least-pressure"  # the instance with the fewest calls in flight
    OVERLOAD = "overload"  # no candidate passed the checks: the overload policy decides


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    session: str | None  # from X-Session-Id / session_id, or inferred by the continuity index
    prompt_tokens: int
    max_tokens: int
    request_id: str = ""
    tenant: str = "default"  # whose call (talaria/gateway/auth.py): overload = "sessions" sheds fairly among tenants
    # overload = "sessions": the call opens a session (none of its calls placed within session_ttl_s); it is
    # admitted only where its first call would start within the instance's TTFT target with the load of
    # the sessions already admitted there counted ahead of it (talaria/routing/session_load.py)
    new_session: bool = False


@dataclass(slots=True)
class RouteDecision:
    """What `Router.route` decided."""

    instance: str | None  # None: rejected by the overload policy
    reason: Reason
    cost: Cost | None = None  # the chosen candidate's; on overload, the candidate that came closest to admitting it
    candidates: int = 0  # instances that passed both checks
    avoidable_open: bool = False  # the chosen instance opens a model another instance holds
    lease: Lease | None = None  # the lease consumed
    overload: str | None = None  # the overload policy applied (or why a queued call gave up)
    same_instance: bool | None = None  # a returning session went back to its last instance (None: new)
    wait_s: float | None = None  # overload: predicted seconds until the closest candidate admits the call
