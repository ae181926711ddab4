"""`talaria trace`: generate, convert and summarise session traces (docs/trace-format.md)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import click

from talaria.contracts.trace import (
    TraceCall,
    TraceError,
    read_trace,
    sessions,
    write_trace,
)
from talaria.trace.generate import (
    FIRST_PROMPT,
    LOADS,
    PRESETS,
    TOOL_RESULT,
    LogNormal,
    TraceSpec,
    TraceSpecError,
    generate,
    preset,
)
from talaria.trace.mooncake import convert as convert_mooncake
from talaria.trace.mooncake import read_mooncake
from talaria.trace.stats import format_table, trace_stats

OUT_HELP = "Write the trace to FILE instead of stdout."


@click.group()
def trace() -> None:
    """Agent-session traces: one JSON call per line, read by `talaria sim` and `talaria replay`.

    `gen` draws paper-calibrated sessions, `convert` rebuilds sessions from a public trace, and
    `stats` prints any trace's §2.1 statistics beside the paper's.
    """


@trace.command()
@click.option("--preset", "preset_name", type=click.Choice(PRESETS),
              help="paper-tp8: the TP=8 replay (10 issues x 3 models = 30 sessions, 960 calls). "
                   "paper-tp4: the router testbed (the first 4 calls of each paper-tp8 session on "
                   "the TP=4 models, 120 calls). Without a preset, give --sessions and --models.")
@click.option("--load", type=click.Choice(tuple(LOADS)),
              help="paper-tp4 only (default medium): the offered load, as the mean spacing of "
                   "session starts: " + ", ".join(f"{k} {v:g} s" for k, v in LOADS.items()) + ".")
@click.option("--sessions", "n_sessions", type=int,
              help="Generic mode: this many independent sessions, assigned to --models in turn.")
@click.option("--models", help="Generic mode: comma-separated model names, e.g. a,b (default: model).")
@click.option("--arrival-s", type=float,
              help="Generic mode: mean spacing of session starts in seconds, exponential "
                   "(default 0: every session starts at once).")
@click.option("--depth", "depth", metavar="P50,P95",
              help="Generic mode: calls per session, a lognormal by its median and p95 (paper: 11,49).")
@click.option("--gap-s", "gap_s", metavar="P50,P95",
              help="Generic mode: tool gaps in seconds, a lognormal by its median and p95 (paper: 0.39,1.32).")
@click.option("--gap-spread", type=click.FloatRange(0.0),
              help="Generic mode: sessions differ in tool speed: each session's gap median is the --gap-s "
                   "median times a lognormal factor of this log-sigma (default 0: every session alike).")
@click.option("--first-prompt-tokens", type=click.IntRange(1),
              help="Generic mode: median tokens of a session's first prompt (default 4600).")
@click.option("--tool-result-tokens", type=click.IntRange(1),
              help="Generic mode: median tokens a tool result adds to the context (default 1450).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random generator; the same seed gives the same trace.")
@click.option("--max-prompt-tokens", type=int,
              help="Scale every prompt, reused and completion count down by one factor so the "
                   "longest prompt fits N tokens (for a small model's context); says so on stderr.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help=OUT_HELP)
def gen(preset_name: str | None, load: str | None, n_sessions: int | None, models: str | None,
        arrival_s: float | None, depth: str | None, gap_s: str | None, gap_spread: float | None,
        first_prompt_tokens: int | None, tool_result_tokens: int | None, seed: int,
        max_prompt_tokens: int | None, out: Path | None) -> None:
    """Generate agent sessions calibrated to the paper's SWE-Bench workload (§2.1, §5.1).

    Depths, tool gaps and prompt lengths follow lognormals fitted to the paper's medians and p95s;
    each prompt extends the previous one, as an agent's context does. Output lengths are an
    assumption (median 300 tokens): the paper does not report them.
    """
    try:
        spec = _spec(preset_name, load, n_sessions, models, arrival_s)
        shape = {"depth": _lognormal("--depth", depth), "gap_s": _lognormal("--gap-s", gap_s),
                 "gap_spread": gap_spread,
                 "first_prompt": None if first_prompt_tokens is None else replace(FIRST_PROMPT, median=first_prompt_tokens),
                 "tool_result": None if tool_result_tokens is None else replace(TOOL_RESULT, median=tool_result_tokens)}
        shape = {k: v for k, v in shape.items() if v is not None}
        if shape and preset_name is not None:
            raise TraceSpecError("--depth, --gap-s, --gap-spread, --first-prompt-tokens and --tool-result-tokens "
                                 "apply to generic mode only (--sessions N); drop --preset")
        spec = replace(spec, **shape)
        if max_prompt_tokens is not None:
            spec = replace(spec, max_prompt_tokens=max_prompt_tokens)
        result = generate(spec, random.Random(seed))
    except TraceSpecError as e:
        raise click.ClickException(str(e)) from None
    if result.token_scale < 1.0:
        click.echo(f"scaled every prompt, reused and completion count by {result.token_scale:.4f} so the "
                   f"longest prompt ({result.longest_prompt:,} tokens) fits --max-prompt-tokens "
                   f"{max_prompt_tokens:,}", err=True)
    _emit(result.calls, out)


def _lognormal(option: str, value: str | None) -> LogNormal | None:
    """`P50,P95` as a lognormal."""
    if value is None:
        return None
    try:
        p50, p95 = (float(x) for x in value.split(","))
    except ValueError:
        raise TraceSpecError(f"{option} {value!r}: write the median and the p95, e.g. {option} 11,49") from None
    if not 0 < p50 < p95:
        raise TraceSpecError(f"{option} {value}: need 0 < median < p95")
    return LogNormal.fit(p50, p95)


def _spec(preset_name: str | None, load: str | None, n_sessions: int | None, models: str | None,
          arrival_s: float | None) -> TraceSpec:
    if preset_name is not None:
        generic = [o for o, v in (("--sessions", n_sessions), ("--models", models), ("--arrival-s", arrival_s))
                   if v is not None]
        if generic:
            raise TraceSpecError(f"{', '.join(generic)} cannot be combined with --preset; drop one")
        if load is not None and preset_name != "paper-tp4":
            raise TraceSpecError("--load applies to --preset paper-tp4 only")
        return preset(preset_name, load or "medium")
    if n_sessions is None:
        raise TraceSpecError("give --preset (" + ", ".join(PRESETS) + ") or --sessions N [--models a,b]")
    if load is not None:
        raise TraceSpecError("--load applies to --preset paper-tp4 only; use --arrival-s in generic mode")
    names = tuple(m.strip() for m in (models or "model").split(","))
    return TraceSpec(n_sessions, names, arrival_s=arrival_s or 0.0)


@trace.command("convert")
@click.option("--from", "source", type=click.Choice(["mooncake"]), required=True,
              help="The format of PATH. mooncake: the Mooncake (FAST'25) request trace, with "
                   "timestamp, input_length, output_length and 512-token-block hash_ids.")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", default="mooncake", show_default=True,
              help="The model name every converted call asks for.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help=OUT_HELP)
def convert_cmd(source: str, path: Path, model: str, out: Path | None) -> None:
    """Convert the public trace at PATH, rebuilding sessions from its prefix-hash chains.

    A request whose hashes start with all complete blocks of an earlier request continues that
    request's session; gaps are arrival-to-arrival (the trace has no response times).
    """
    try:
        calls = convert_mooncake(read_mooncake(path), model)
    except (TraceError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not calls:
        raise click.ClickException(f"{path}: no requests in the file; is it a {source} trace?")
    _emit(calls, out)


@trace.command("stats")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the statistics as a JSON object to this file.")
def stats_cmd(path: Path, json_path: Path | None) -> None:
    """Print the §2.1 statistics of the trace at PATH beside the paper's.

    Depth per session, tool gaps (continuations only), prompt and completion lengths, and the share
    of continuations reusing more than half of the previous prompt; nearest-rank percentiles.
    """
    try:
        calls = read_trace(path)
    except (TraceError, OSError, UnicodeDecodeError) as e:
        raise click.ClickException(str(e)) from None
    if not calls:
        raise click.ClickException(f"{path}: the trace has no calls")
    stats = trace_stats(calls)
    click.echo(format_table(stats))
    if json_path is not None:
        json_path.write_text(json.dumps(stats.to_dict(), indent=2) + "\n", encoding="utf-8")


def _emit(calls: Sequence[TraceCall], out: Path | None) -> None:
    if out is None:
        write_trace(calls, sys.stdout)
        sys.stdout.flush()
        return
    try:
        with open(out, "w", encoding="utf-8") as f:
            write_trace(calls, f)
    except OSError as e:
        raise click.ClickException(f"cannot write {out}: {e.strerror}") from None
    click.echo(f"wrote {len(calls):,} calls in {len(sessions(calls)):,} sessions to {out}", err=True)
