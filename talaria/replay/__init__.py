"""Closed-loop replay of agent sessions against a live Talaria (or any OpenAI-compatible) server.

`closed_loop` is the engine (the paper's fixed replay, App. A); `agent_script` builds a synthetic
agent workload for it. The `talaria replay` CLI and the trace file format build on these.
"""

from talaria.replay.agent_script import agent_sessions
from talaria.replay.closed_loop import (
    CallResult,
    ReplayCall,
    ReplayResult,
    ReplaySession,
    SessionResult,
    percentile,
    replay,
    replay_sync,
)

__all__ = [
    "CallResult",
    "ReplayCall",
    "ReplayResult",
    "ReplaySession",
    "SessionResult",
    "agent_sessions",
    "percentile",
    "replay",
    "replay_sync",
]
