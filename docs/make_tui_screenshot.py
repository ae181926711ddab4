"""Make docs/tui.svg: the dashboard watching a live node while an agent workload replays against it.

    talaria up &                                # the default config: hot-0 smollm2, cold-0 two tiny models
    python docs/make_tui_screenshot.py          # writes docs/tui.svg

The workload is the closed-loop agent replay of talaria/replay (`agent_sessions`): a few sessions
per model whose prompts grow call by call, with short tool gaps, so the cold instance runs rounds
with switches and session-prefill, and returning calls consume their leases. The screenshot is
taken `--after` seconds in, while sessions are still in flight: every number in it is the node's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

from talaria.replay.agent_script import agent_sessions
from talaria.replay.closed_loop import replay
from talaria.tui.app import DashboardApp
from talaria.tui.feed import LiveFeed


async def shoot(url: str, models: list[str], after_s: float, size: tuple[int, int], out: Path) -> None:
    sessions = agent_sessions(models, 2, 8, seed=7, system_chars=240, tool_chars=80, max_tokens=(6, 20),
                              gap_s=(0.2, 0.8))
    app = DashboardApp(LiveFeed(url))
    async with app.run_test(size=size) as pilot:
        workload = asyncio.create_task(replay(url, sessions))
        await pilot.pause(after_s)
        app.redraw()
        await pilot.pause()
        app.save_screenshot(out.name, str(out.parent))
        workload.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the node (default: %(default)s)")
    parser.add_argument("--models", default="tiny-llama,tiny-qwen3,smollm2",
                        help="comma-separated models to run sessions on (default: %(default)s)")
    parser.add_argument("--after", type=float, default=8.0, help="seconds into the workload (default: %(default)s)")
    parser.add_argument("--size", default="120x44", help="terminal COLUMNSxROWS (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tui.svg",
                        help="SVG to write (default: docs/tui.svg)")
    args = parser.parse_args()
    columns, rows = (int(x) for x in args.size.split("x"))
    asyncio.run(shoot(args.url, args.models.split(","), args.after, (columns, rows), args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
