"""`talaria up`: the supervisor process — engine groups plus the OpenAI-compatible gateway."""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import click

from talaria.cli.progress import ProgressPrinter


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Config file (default: the embedded talaria.toml, which runs on a 2-core CPU machine).")
@click.option("--host", help="Override [server] host.")
@click.option("--port", type=int, help="Override [server] port.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="Log verbosity of the supervisor and the HTTP server.")
@click.option("--access-log/--no-access-log", default=False, show_default=True,
              help="Log every HTTP request (uvicorn's access log); off by default: it costs each call time.")
def up(config_path: Path | None, host: str | None, port: int | None, log_level: str, access_log: bool) -> None:
    """Start the engine groups of every instance and serve the OpenAI API.

    Models are converted once (GGUF -> safetensors, synthetic -> generated) into the cache
    (TALARIA_CACHE_DIR, default ~/.cache/talaria); later starts reuse it. Stop with Ctrl-C or
    SIGTERM: the node stops accepting connections, lets calls in flight finish for up to
    [server] drain_s seconds, then stops; every worker process exits with the supervisor.
    """
    import uvicorn

    from talaria.config.errors import ConfigError
    from talaria.config.loader import config_warnings, default_config_path, load_config
    from talaria.gateway.gateway import create_app
    from talaria.gateway.limits import KEEP_ALIVE_S, send_deadline_protocol
    from talaria.node.errors import InstanceFailed
    from talaria.node.preflight import check_files
    from talaria.node.supervisor import Supervisor

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = config_path or default_config_path()
    try:
        cfg = load_config(path)
        for line in [*config_warnings(cfg), *check_files(cfg)]:
            click.echo(line, err=True)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    server = replace(cfg.server, host=host or cfg.server.host, port=port or cfg.server.port)
    cfg = replace(cfg, server=server)

    supervisor = Supervisor(cfg)
    supervisor.prepare(ProgressPrinter())
    app = create_app(supervisor)

    @asynccontextmanager
    async def lifespan(_app):
        click.echo(f"talaria: starting {len(cfg.instances)} instance(s) from {path}", err=True)
        try:
            await supervisor.start()
        except InstanceFailed as e:
            click.echo(f"talaria: {e}", err=True)
            raise
        peers = app.state.gateway.dispatcher.peers
        for peer in peers:
            peer.start()
        click.echo(f"talaria: serving {', '.join(supervisor.model_names())} on "
                   f"http://{server.host}:{server.port}/v1"
                   + (f" (peers: {', '.join(p.url for p in peers)})" if peers else ""), err=True)
        yield
        for peer in peers:
            await peer.stop()
        click.echo("talaria: stopping engine groups", err=True)
        await supervisor.stop()

    app.router.lifespan_context = lifespan
    # proxy_headers off: one ASGI layer fewer per request; nothing here reads the client's address.
    # The HTTP protocol drops clients that stop reading; max_connections is the app's ConnectionLimit
    # (uvicorn's limit_concurrency would answer in text/plain, /health included; talaria/gateway/limits.py)
    http = send_deadline_protocol(server.send_timeout_s) if server.send_timeout_s else "auto"
    uvicorn.run(app, host=server.host, port=server.port, log_level=log_level, access_log=access_log,
                proxy_headers=False, timeout_graceful_shutdown=cfg.server.drain_s, http=http,
                timeout_keep_alive=KEEP_ALIVE_S)
    if not supervisor.groups or not all(g.ready and g.ready.error is None for g in supervisor.groups):
        sys.exit(1)
