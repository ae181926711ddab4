"""What the gateway and the router need of the node: its instances, models, tokenizers and event log.

The `Supervisor` implements it; the gateway's tests implement it over in-process fake instances.
It lives with the node rather than in `talaria/contracts/` because it hands out the node's own
objects (tokenizers, the event log); the per-instance boundary, `InstanceHandle`, is a contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from talaria.config.schema import TalariaConfig
from talaria.contracts.arch import ModelArch
from talaria.contracts.instance_handle import InstanceHandle
from talaria.contracts.telemetry import InstanceStats
from talaria.models.tokenizer import Tokenizer
from talaria.node.event_log import EventLog


class NodeHandle(Protocol):
    config: TalariaConfig
    groups: Sequence[InstanceHandle]  # every local instance, in config order
    events: EventLog  # the node's event log: instances, the router and the gateway append to it

    def model_names(self) -> list[str]:
        """Every model this node can tokenize (served here or by a peer)."""
        ...

    def tokenizer(self, model: str) -> Tokenizer:
        ...

    def arch(self, model: str) -> ModelArch:
        ...

    def stats(self) -> list[InstanceStats]:
        """The latest snapshot of every instance that has sent one."""
        ...
