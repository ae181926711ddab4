"""The gateway's handle on one instance: what the router reads and what a call is sent through.

The node's `EngineGroup` implements it over rank 0's pipe; the gateway's tests implement it with
in-process fakes. Both implement all of it: routing and the gateway read these attributes
directly, never through `getattr` defaults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from talaria.config.schema import InstanceConfig
from talaria.contracts.call import CallOutput, InstanceCall, InstanceReady
from talaria.contracts.telemetry import InstanceStats


class InstanceHandle(Protocol):
    name: str
    config: InstanceConfig
    healthy: bool  # ready and serving; False while starting, restarting or stopped
    stats: InstanceStats | None  # the latest telemetry snapshot (None before the first)
    ready: InstanceReady | None  # what it reported when it last became ready (its cost profile among it)
    restarts: int  # times its workers died (or stalled) and it was restarted
    state: str  # starting | ready | restarting | stopped
    last_failure: str | None  # why it last failed (None if it never has)

    @property
    def in_flight(self) -> int:
        """Calls sent to it and not finished."""
        ...

    def generate(self, call: InstanceCall) -> AsyncIterator[CallOutput]:
        """Stream a call's outputs; closing the iterator early cancels the call on the instance."""
        ...

    async def switch(self, model: str, timeout: float) -> dict | None:
        """Open `model` now (admin); the SwitchRecord as JSON, None if it was already active."""
        ...
