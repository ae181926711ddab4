"""The dashboard against the shared live `talaria up` (default config: hot-0 with smollm2, cold-0 at
TP=2 with tiny-llama and tiny-qwen3, leases of 1 s): a completion's lease appears with its countdown
and goes when it expires; a forced switch shows up with its path and time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from talaria.tui.app import DashboardApp
from talaria.tui.feed import LiveFeed
from talaria.tui.state import Connection
from tests.tui.test_panels import SIZE, panel_text

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

OTHER = {"tiny-llama": "tiny-qwen3", "tiny-qwen3": "tiny-llama"}


async def wait_until(pilot, probe: Callable[[], object], timeout: float, what: str) -> None:
    """Let the app run until `probe()` is truthy; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s still not {what}")
        await pilot.pause(0.1)


def line_with(app: DashboardApp, panel: str, text: str) -> str | None:
    return next((line for line in panel_text(app, panel).splitlines() if text in line), None)


async def test_leases_and_switches_of_a_live_node(server):
    session = f"tui-{uuid.uuid4().hex[:8]}"
    app = DashboardApp(LiveFeed(server.base_url))
    async with app.run_test(size=SIZE) as pilot, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        await wait_until(pilot, lambda: app.state.status.connection is Connection.CONNECTED, 10, "connected")
        expired = app.state.leases.ops["expire"]

        r = await http.post("/v1/completions", headers={"X-Session-Id": session},
                            json={"model": "tiny-llama", "prompt": "List the files, then read them.", "max_tokens": 4})
        r.raise_for_status()
        await wait_until(pilot, lambda: line_with(app, "leases", session), 5, f"showing the lease of {session}")
        row = line_with(app, "leases", session).strip("│ ").split()
        assert row[1:3] == ["tiny-llama", "cold-0"] and 0.0 <= float(row[3]) <= 1.0 and row[4] == "s"
        await wait_until(pilot, lambda: line_with(app, "leases", session) is None, 10, "rid of the expired lease")
        assert app.state.leases.ops["expire"] > expired

        target = OTHER[app.state.instances["cold-0"].active_model]
        r = await http.post("/talaria/admin/switch", json={"instance": "cold-0", "model": target})
        r.raise_for_status()
        record = r.json()["switch"]
        if record is None:  # the snapshot we read was older than the last switch: the target is active
            r = await http.post("/talaria/admin/switch", json={"instance": "cold-0", "model": OTHER[target]})
            record = r.json()["switch"]
        shown = (f"cold-0 {record['from_model']} → {record['to_model']} {record['path']} "
                 f"{record['total_ms']:.2f} ms")
        await wait_until(pilot, lambda: shown in panel_text(app, "switches"), 5, f"showing {shown!r}")
        assert app.state.switches.counts[record["path"]] >= 1
