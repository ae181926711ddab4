"""`talaria profile`: measure a config's instances on this machine and write their cost profiles."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from talaria.cli.progress import ProgressPrinter
from talaria.config.errors import ConfigError
from talaria.config.loader import default_config_path, load_config


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The talaria.toml whose instances to profile (default: the embedded default config).")
@click.option("--instance", "instances", multiple=True,
              help="Profile only this instance (repeatable); default every instance of the config.")
@click.option("--out", "out", type=click.Path(path_type=Path),
              help="Where to write the profile TOML (one instance), or a folder (several). "
                   "Default: profiles/<config stem>-<instance>.toml.")
@click.option("--quick", is_flag=True, help="Fewer probe shapes and runs (about a second per small model).")
def profile(config_path: Path | None, instances: tuple[str, ...], out: Path | None, quick: bool) -> None:
    """Measure prefill, decode, copy bandwidth and switch costs on the instances' real devices.

    Each instance's engine group starts with the same code `talaria up` runs, times probe steps
    through the group (prefill against prompt length, cold and after a cached prefix; decode against
    batch and context; host copy bandwidth; HKVR restore from host slabs; every model opened by a full H2D switch and, with several
    models and staging on, from staged weights: all of them (full-D2D) and half (partial)), fits the profile's
    curves and stops. The profile (docs/profile.md) is what cold instances budget rounds with, what
    the router ranks placements by, and what `talaria sim` charges.
    """
    from talaria.contracts.profile_file import save_profile
    from talaria.executor.probes import QUICK, Probes
    from talaria.node.engine_group import EngineGroup
    from talaria.node.supervisor import Supervisor, worker_threads

    path = config_path or default_config_path()
    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    chosen = [i for i in cfg.instances if not instances or i.name in instances]
    unknown = set(instances) - {i.name for i in cfg.instances}
    if unknown:
        raise click.ClickException(f"{path}: no instance named {', '.join(sorted(unknown))}; it has "
                                   f"{', '.join(i.name for i in cfg.instances)}")
    supervisor = Supervisor(cfg)
    supervisor.prepare(ProgressPrinter())
    probes = QUICK if quick else Probes(prefill_tokens=(16, 64, 256, 512), cached_tokens=(256, 1024),
                                        decode_batches=(1, 4, 8, 16), decode_contexts=(32, 256, 1024), repeats=3)

    async def measure(inst):
        group = EngineGroup(inst, [supervisor.files[m] for m in inst.models], worker_threads(cfg, inst),
                            probes=probes)
        try:
            await group.start()
            return group.ready.profile
        finally:
            await group.stop()

    for inst in chosen:
        t0 = time.monotonic()
        click.echo(f"talaria: profiling {inst.name} ({', '.join(inst.models)}, tp={inst.tp}, {inst.device.value})",
                   err=True)
        result = asyncio.run(measure(inst))
        if result is None:
            raise click.ClickException(f"instance {inst.name} started without a profile")
        target = _target(out, path, inst.name, len(chosen))
        save_profile(result, target)
        click.echo(f"talaria: {inst.name}: wrote {target} in {time.monotonic() - t0:.1f} s", err=True)
        bw = result.bandwidth
        click.echo(f"  copies: H2D {bw.h2d_bytes_per_s / 1e9:.1f} GB/s, D2H {bw.d2h_bytes_per_s / 1e9:.1f} GB/s, "
                   f"D2D {bw.d2d_bytes_per_s / 1e9:.1f} GB/s, HKVR restore "
                   + (f"{bw.restore_bytes_per_s / 1e9:.1f} GB/s" if bw.restore_bytes_per_s else "- (no host KV)"))
        for name, mp in result.models.items():
            click.echo(f"  {name}: prefill {mp.prefill.seconds(512) * 1e3:.1f} ms / 512 tokens, decode "
                       f"{mp.decode.seconds(1, 256) * 1e3:.2f} ms (batch 1), "
                       f"{mp.decode.seconds(8, 8 * 256) * 1e3:.2f} ms (batch 8), switch "
                       + (", ".join(f"{path} {cost.total_s * 1e3:.1f} ms" for path, cost in mp.switch.items())
                          or "- (one model: never switches)"))


def _target(out: Path | None, config: Path, instance: str, n: int) -> Path:
    if out is not None and (n == 1 and out.suffix == ".toml"):
        return out
    folder = out if out is not None else Path("profiles")
    return folder / f"{config.stem}-{instance}.toml"
