"""`talaria tui`: the live dashboard of a running node, or the playback of a recorded event log."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The node to watch (what `talaria up` prints); ignored with --replay.")
@click.option("--api-key", help="Sent as 'Authorization: Bearer KEY': the node's [server] admin_key (not needed "
              "on the node's own machine while it has none; docs/security.md).")
@click.option("--replay", "replay_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Play back an events JSONL file ([telemetry] events_path, or `talaria sim --events`) "
                   "instead of watching a node.")
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="With --replay: how many times faster than recorded to play it.")
def tui(url: str, api_key: str | None, replay_path: Path | None, speed: float) -> None:
    """Watch a node live: rounds, switch paths, HBM, leases, sessions and models.

    Live, it polls GET /talaria/telemetry and follows GET /talaria/events, and reconnects by
    itself when the node goes away. With --replay it plays an event log at its recorded pace
    (p pauses). Keys: tab moves between panels, ? or h shows help, q quits.

    \b
    Examples:
      talaria tui
      talaria tui --url http://10.0.0.5:8000 --api-key KEY
      talaria tui --replay talaria-events.jsonl --speed 4
    """
    from talaria.tui.app import DashboardApp
    from talaria.tui.feed import LiveFeed, ReplayError, ReplayFeed

    if replay_path is not None:
        try:
            feed = ReplayFeed.from_file(replay_path, speed)
        except ReplayError as e:
            raise click.ClickException(str(e)) from None
    else:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http(s) URL, e.g. http://127.0.0.1:8000", param_hint="--url")
        feed = LiveFeed(url, api_key)
    DashboardApp(feed).run()
