"""`talaria drain`: start a node's drain and wait for its calls in flight (a Kubernetes preStop hook)."""

from __future__ import annotations

import time

import click

POLL_S = 0.5


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The node's client port (the admin endpoint is not served on its peer port).")
@click.option("--admin-key", envvar="TALARIA_ADMIN_KEY", show_envvar=True,
              help="The node's [server] admin_key; without one the node answers loopback clients only.")
@click.option("--settle-s", type=float, default=0.0, show_default=True,
              help="Wait at least this long, even with nothing in flight: the time readiness probes and "
                   "the Service's endpoints, and peers' heartbeats, take to stop sending calls here.")
def drain(url: str, admin_key: str | None, settle_s: float) -> None:
    """Tell the node at URL to drain, then wait until no call is in flight there (at most its
    [server] drain_s, and at least --settle-s).

    A draining node serves every call that reaches it, but /health answers 503 "draining" (so
    readiness takes the pod out of its Service) and peers see its instances unhealthy (so they
    place nothing new there). Kubernetes runs this as the pod's preStop hook, before SIGTERM; calls
    still in flight when it returns get [server] drain_s more after SIGTERM (docs/deploy.md).
    """
    import httpx

    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    start = time.monotonic()
    last = None
    with httpx.Client(timeout=10) as client:
        while True:
            try:
                r = client.post(url.rstrip("/") + "/talaria/admin/drain", headers=headers)
                r.raise_for_status()
                state = r.json()
            except (httpx.HTTPError, ValueError) as e:
                raise click.ClickException(f"{url} did not take the drain: {e}") from None
            waited = time.monotonic() - start
            in_flight, limit = state["in_flight"], float(state["drain_s"])
            if in_flight != last:
                click.echo(f"talaria drain: {in_flight} call(s) in flight at {waited:.1f} s", err=True)
                last = in_flight
            if (in_flight == 0 and waited >= settle_s) or waited >= max(limit, settle_s):
                break
            time.sleep(POLL_S)
    left = f"{in_flight} still in flight, left to SIGTERM's drain_s" if in_flight else "nothing in flight"
    click.echo(f"talaria drain: done after {waited:.1f} s, {left}", err=True)
