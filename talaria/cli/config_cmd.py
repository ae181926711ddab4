"""`talaria config`: validate a talaria.toml before serving with it."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import click

from talaria.config.errors import ConfigError
from talaria.config.loader import config_warnings, default_config_path, load_config
from talaria.config.schema import TalariaConfig
from talaria.config.tables import format_size
from talaria.node.preflight import check_files

EXIT_INVALID = 2  # the config has problems (click also uses 2 for usage errors)


@click.group()
def config() -> None:
    """Inspect and validate talaria.toml files.

    The embedded default config is talaria/talaria.toml inside the package; it lists every key
    with a comment and doubles as the reference.
    """


@config.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--files", "with_files", is_flag=True,
              help="Also run the checks `talaria up` runs: read each model's metadata (not its "
                   "weights), check tp against its heads, the GPUs of cuda instances, that each "
                   "arena holds its largest model, and the ranks' host memory against RAM; print "
                   "each instance's cache sizes per model (KV page and state slot bytes per rank).")
def check(file: Path | None, with_files: bool) -> None:
    """Validate FILE (default: the embedded config) and print a summary.

    Without --files only the file itself is read: keys, types, sizes, allowed values, names,
    references between [[instances]] and [[models]], and tp against the heads of synthetic
    models. Every problem is listed, not just the first; the exit code is 2 if there are any.
    """
    path = file if file is not None else default_config_path()
    try:
        cfg = load_config(path)
    except ConfigError as e:
        _fail(e)
    click.echo(_summary(cfg))
    for line in config_warnings(cfg):
        click.echo(line, err=True)
    if with_files:
        try:
            info = check_files(cfg)
        except ConfigError as e:
            _fail(e)
        for line in info:
            click.echo(line)
    click.echo("OK")


def _fail(error: ConfigError) -> NoReturn:
    for line in error.problems:
        click.echo(line, err=True)
    click.echo(f"{_count(len(error.problems), 'problem')} found", err=True)
    raise SystemExit(EXIT_INVALID)


def _summary(cfg: TalariaConfig) -> str:
    lines = [f"{cfg.path}: {_count(len(cfg.models), 'model')}, {_count(len(cfg.instances), 'instance')}",
             f"server  {cfg.server.host}:{cfg.server.port}"
             + ("  (api key set)" if cfg.server.api_key else ""),
             f"router  {cfg.router.policy.value}, lease {cfg.router.lease_s:g} s", "models"]
    rows = []
    for m in cfg.models:
        source = m.source
        if m.is_synthetic and m.shape is not None:
            s = m.shape
            source += (f" {s.family} hidden {s.hidden_size} x {s.num_layers} layers, "
                       f"{s.num_heads}/{s.num_kv_heads} heads, seed {m.seed}")
        rows.append([m.name, m.dtype, source])
    lines += _columns(rows)
    lines.append("instances")
    lines += _columns([[i.name, i.pool.value, f"tp {i.tp}",
                        i.device.value + (f" {','.join(map(str, i.devices))}" if i.devices else ""),
                        f"arena {format_size(i.arena_bytes)}", ", ".join(i.models)]
                       for i in cfg.instances])
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))] if rows else []
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
