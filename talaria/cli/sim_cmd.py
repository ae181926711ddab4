"""`talaria sim`: replay a trace in virtual time on the live policy objects, with costs from a profile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from talaria.sim import TOPOLOGY_GAMMA, TOPOLOGY_TPOT_S, TOPOLOGY_TTFT_S


@click.command()
@click.option("--profile", "profile_paths", required=True, multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Cost profile TOML (profiles/*.toml, or what `talaria profile` wrote); repeat it to take "
                   "models from several (e.g. one per instance of the config).")
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Trace JSONL (docs/trace-format.md), e.g. from `talaria trace gen`.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The node to simulate; default: the profile's own topology (one cold instance, all models).")
@click.option("--compare", default="talaria", show_default=True,
              help="Comma-separated variants: talaria, no-sp, no-hkvr, h2d-only, round-only, and router "
                   "policies full, session-sticky, least-pressure.")
@click.option("--ttft-s", type=float, default=TOPOLOGY_TTFT_S, show_default=True,
              help="Without --config: the cold instance's TTFT target (10 s: the only figure the paper states).")
@click.option("--tpot-s", type=float, default=TOPOLOGY_TPOT_S, show_default=True,
              help="Without --config: TPOT target.")
@click.option("--gamma", type=float, default=TOPOLOGY_GAMMA, show_default=True,
              help="Without --config: round margin.")
@click.option("--instances", type=click.IntRange(1), default=1, show_default=True,
              help="Without --config: identical cold instances (paper-tp4: 2 workers).")
@click.option("--lease-s", type=float, help="Override [router] lease_s (tau) for every variant.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write every variant's summary here.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write PNGs here: the SCT CDF and the switch latency by path, every variant on one axis.")
@click.option("--events", "events_path", type=click.Path(path_type=Path),
              help="Write the first variant's event log here (JSONL, the records a live node writes).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the simulated token streams.")
@click.option("--prefill-base-s", type=click.FloatRange(0.0), default=None,
              help="Give every model's prefill step this fixed cost instead of the profile's: the sensitivity "
                   "check of profiles/README.md (paper-tp8's exact fit of the paper's recompute points: 2.1).")
def sim(profile_paths: tuple[Path, ...], trace_path: Path, config_path: Path | None, compare: str, ttft_s: float, tpot_s: float,
        gamma: float, instances: int, lease_s: float | None, json_path: Path | None, plots_dir: Path | None,
        events_path: Path | None, seed: int, prefill_base_s: float | None) -> None:
    """Simulate a trace on a node: SCT, TTFT, switch paths, rounds and SP admissions per variant.

    The router, the round scheduler with session-prefill, the host KV registry and the stager are
    the objects a live node runs; only the engine is replaced, by the profile's costs.
    """
    from talaria.config.errors import ConfigError
    from talaria.config.loader import load_config
    from talaria.contracts.profile import ProfileError
    from talaria.contracts.profile_file import load_profile
    from talaria.contracts.trace import TraceError, read_trace
    from talaria.memory.bump_layout import LayoutError
    from talaria.sim.report import summary, table, variant
    from talaria.sim.simulation import SimOptions, Simulation, profile_topology

    try:
        profile = load_profile(profile_paths[0])
        for extra in profile_paths[1:]:
            for mp in load_profile(extra).models.values():
                profile = profile.with_model(mp)
        if prefill_base_s is not None:
            profile = profile.with_prefill_base(prefill_base_s)
        trace = read_trace(trace_path)
        config = load_config(config_path) if config_path else profile_topology(profile, ttft_s, tpot_s, gamma,
                                                                                instances)
        if lease_s is not None:
            config = dataclasses.replace(config, router=dataclasses.replace(config.router, lease_s=lease_s))
        names = [n.strip() for n in compare.split(",") if n.strip()]
        variants = {n: variant(config, n) for n in names}
    except (ProfileError, TraceError, ConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    missing = sorted({c.model for c in trace} - set(profile.models))
    if missing:
        raise click.ClickException(f"{trace_path} asks for {', '.join(missing)}; the profile has no costs for them")
    results, runs = {}, {}
    for i, (name, cfg) in enumerate(variants.items()):
        click.echo(f"talaria sim: {name} ({len(trace)} calls)...", err=True)
        keep = events_path is not None and i == 0
        try:
            r = Simulation(cfg, profile, trace, SimOptions(seed=seed, keep_events=keep)).run()
        except (ProfileError, LayoutError) as e:
            raise click.ClickException(str(e)) from None
        results[name] = summary(r)
        if plots_dir is not None:
            runs[name] = r
        click.echo(f"talaria sim: {name}: {r.virtual_s:.0f} s simulated in {r.wall_s:.1f} s; SCT p50 "
                   f"{results[name]['sct_p50_s']:.1f} s, p95 {results[name]['sct_p95_s']:.1f} s", err=True)
        if keep:
            events_path.parent.mkdir(parents=True, exist_ok=True)
            with events_path.open("w", encoding="utf-8") as f:
                for seq, e in enumerate(r.events, 1):
                    f.write(e.__class__(e.t, e.instance, e.kind, e.data, seq).to_json() + "\n")
    click.echo(table(results))
    if plots_dir is not None:
        from talaria.sim.plots import write_plots

        for path in write_plots(runs, plots_dir):
            click.echo(f"talaria sim: wrote {path}", err=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"profile": [str(p) for p in profile_paths], "trace": str(trace_path),
                                         "policies": results}, indent=2, default=str))
