"""`talaria up`: the supervisor process — engine groups plus the OpenAI-compatible gateway."""

from __future__ import annotations

import logging
import socket
import sys
from contextlib import asynccontextmanager
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
@click.option("--api-key", envvar="TALARIA_API_KEY", show_envvar=True,
              help="Override [server] api_key (set the variable rather than the option: it is not shown in ps).")
@click.option("--admin-key", envvar="TALARIA_ADMIN_KEY", show_envvar=True, help="Override [server] admin_key.")
@click.option("--peer-key", envvar="TALARIA_PEER_KEY", show_envvar=True, help="Override [server] peer_key.")
def up(config_path: Path | None, host: str | None, port: int | None, log_level: str, access_log: bool,
       api_key: str | None, admin_key: str | None, peer_key: str | None) -> None:
    """Start the engine groups of every instance and serve the OpenAI API.

    Models are converted once (GGUF -> safetensors, synthetic -> generated) into the cache
    (TALARIA_CACHE_DIR, default ~/.cache/talaria); later starts reuse it. Stop with Ctrl-C or
    SIGTERM: the node stops accepting connections, lets calls in flight finish for up to
    [server] drain_s seconds, then stops; every worker process exits with the supervisor. The keys
    may come from the environment (a Kubernetes Secret): TALARIA_API_KEY, TALARIA_ADMIN_KEY and
    TALARIA_PEER_KEY override the file's.
    """
    import uvicorn

    from talaria.config.errors import ConfigError
    from talaria.config.loader import config_warnings, default_config_path, load_config, override_server
    from talaria.gateway.gateway import create_app
    from talaria.gateway.limits import KEEP_ALIVE_S, send_deadline_protocol
    from talaria.node.errors import InstanceFailed
    from talaria.node.preflight import check_files
    from talaria.node.supervisor import Supervisor

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":  # httpx logs every request at INFO: peers' heartbeats, several a second
        logging.getLogger("httpx").setLevel(logging.WARNING)
    path = config_path or default_config_path()
    try:
        cfg = override_server(load_config(path), host=host, port=port, api_key=api_key, admin_key=admin_key,
                              peer_key=peer_key)
        for line in [*config_warnings(cfg), *check_files(cfg)]:
            click.echo(line, err=True)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    server = cfg.server

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
        peers = app.state.gateway.peers
        peers.start()
        listed = [p.url for p in peers.links] + ([f"every address of {cfg.router.peer_dns}"] if cfg.router.peer_dns else [])
        click.echo(f"talaria: serving {', '.join(supervisor.model_names())} on "
                   f"http://{server.host}:{server.port}/v1"
                   + (f", peers on port {server.peer_port}" if server.peer_port else "")
                   + (f" (peers: {', '.join(listed)})" if listed else ""), err=True)
        yield
        await peers.stop()
        click.echo("talaria: stopping engine groups", err=True)
        await supervisor.stop()

    app.router.lifespan_context = lifespan
    # proxy_headers off: one ASGI layer fewer per request; nothing here reads the client's address.
    # The HTTP protocol drops clients that stop reading; max_connections is the app's ConnectionLimit
    # (uvicorn's limit_concurrency would answer in text/plain, /health included; talaria/gateway/limits.py)
    http = send_deadline_protocol(server.send_timeout_s) if server.send_timeout_s else "auto"
    sockets = [_bound(server.host, p) for p in (server.port, server.peer_port) if p is not None]
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, proxy_headers=False,
                            timeout_graceful_shutdown=cfg.server.drain_s, http=http, timeout_keep_alive=KEEP_ALIVE_S)
    try:
        uvicorn.Server(config).run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down gracefully (as uvicorn.run does)
        pass
    if not supervisor.groups or not all(g.ready and g.ready.error is None for g in supervisor.groups):
        sys.exit(1)


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and not yet listening: uvicorn listens once the engine groups
    are up, so until then a client (a probe, a peer) is refused at once rather than left waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" takes IPv4 clients too, as uvicorn's does
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}; is another server there? "
                                   "Pick another --port (or [server] peer_port)") from None
    return sock
