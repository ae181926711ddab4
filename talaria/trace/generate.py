"""Paper-calibrated agent sessions: the §2.1 SWE-Bench workload as a trace (docs/trace-format.md).

The paper publishes distributions, not its trace, so sessions are drawn from lognormals fitted to
the reported medians and p95s (depth 11/49 calls, tool gap 0.39/1.32 s) and from a prompt model
calibrated so that all calls together reproduce the prompt quantiles (25K/105K tokens):

    prompt 0     = first prompt                      (system prompt, tools, task)
    prompt k     = prompt k-1 + output k-1 + tool result k    (reused = prompt k-1 + output k-1)
    or, rarely   = kept part of prompt k-1 + tool result k   (history rewritten or compacted)

Rewrites happen with probability TRUNCATE_P per continuation, and always before a prompt would pass
CONTEXT_LIMIT; they keep at most half of the previous prompt, so about 96.8% of continuations reuse
more than half of it, as the paper measured. Output lengths are not in the paper: they are an
assumption (lognormal, median 300 tokens). Everything random comes from the injected
`random.Random`, so one seed gives one trace.

Presets follow the paper's replays (§5.1, App. A): `paper-tp8` is ten issues each run on three
models, 960 calls; `paper-tp4` is its first four calls per model-session (120 calls) on the TP=4
models, at one of three load levels expressed as session start offsets (`LOADS`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from statistics import NormalDist

from talaria.contracts.trace import TraceCall

Z95 = NormalDist().inv_cdf(0.95)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A lognormal by its median and log-space sigma; `fit` matches a median and a p95."""

    median: float
    sigma: float

    @classmethod
    def fit(cls, p50: float, p95: float) -> LogNormal:
        return cls(p50, math.log(p95 / p50) / Z95)

    def draw(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median), self.sigma)

    def stratified(self, n: int, rng: random.Random) -> list[float]:
        """n draws, one from each n-quantile slice, shuffled (Latin hypercube sampling): a small
        sample, like the paper's ten issues, spans the distribution instead of one lucky corner."""
        slices = list(range(n))
        rng.shuffle(slices)
        return [self.median * math.exp(self.sigma * NormalDist().inv_cdf((i + rng.random()) / n))
                for i in slices]


# §2.1 / App. A: depth and gap are direct fits. First-prompt and tool-result medians, and TRUNCATE_P,
# were tuned so 20,000 generic sessions give prompt p50 25.2-25.6K / p95 104-106K and 96.7-96.8%
# of continuations reusing > half (seeds 0-2).
DEPTH = LogNormal.fit(11, 49)
MAX_DEPTH = 187
GAP_S = LogNormal.fit(0.39, 1.32)
FIRST_PROMPT = LogNormal(4_600, 0.35)  # system prompt, tool schemas and the issue text
TOOL_RESULT = LogNormal(1_450, 1.0)  # file reads, diffs, test output: a wide spread
COMPLETION = LogNormal(300, 0.8)  # ASSUMPTION: the paper gives no output lengths
MAX_TOOL_RESULT, MAX_COMPLETION = 50_000, 8_192
TRUNCATE_P = 0.032
KEEP_FRACTION = (0.1, 0.5)  # share of the previous prompt a rewrite keeps (never more than half)
CONTEXT_LIMIT = 200_000  # the capturing agent's context window: a longer prompt is compacted first

PAPER_TP8_MODELS = ("Qwen3-235B", "GLM5-nvfp4", "Qwen3.5-122B-A10B")
PAPER_TP4_MODELS = ("Qwen3-32B", "Qwen2.5-32B-Instruct", "Qwen3.5-35B-A3B")  # same order: mapped 1:1
# ASSUMPTION: §5.3 names three "relative offered-load regimes" without rates. A load level is the
# mean spacing of session starts (s); the same seeded arrival pattern is compressed 4x per level.
LOADS = {"low": 8.0, "medium": 2.0, "high": 0.5}


class TraceSpecError(ValueError):
    """A generator request that cannot be met; the message says which option to change."""


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """What to generate. Presets are TraceSpecs; the CLI's generic mode builds one from options."""

    tasks: int  # distinct agent tasks (SWE-Bench issues)
    models: tuple[str, ...]
    replicate: bool = False  # True: every task runs on every model (paper); False: task i on models[i % n]
    total_calls: int | None = None  # scale depths (multiplicatively) so the trace has exactly this many calls
    min_depth: int = 1
    first_calls: int | None = None  # keep only each session's first calls (the paper-tp4 subset)
    arrival_s: float = 0.0  # mean spacing of session starts, exponential; 0: every session starts at 0
    max_prompt_tokens: int | None = None  # scale all token counts down so every prompt fits
    # the shape's distributions, the paper's unless a caller asks for another workload (CLI generic mode)
    depth: LogNormal = DEPTH  # calls per session (before total_calls scaling)
    gap_s: LogNormal = GAP_S  # tool gaps
    gap_spread: float = 0.0  # log-sigma of a per-session factor on the gap median (0: every session alike)
    first_prompt: LogNormal = FIRST_PROMPT  # tokens of a session's first prompt
    tool_result: LogNormal = TOOL_RESULT  # tokens a tool result appends to the context


PRESETS = ("paper-tp8", "paper-tp4")


def preset(name: str, load: str = "medium") -> TraceSpec:
    """The named preset; `load` (low, medium, high) only shapes `paper-tp4`."""
    if name == "paper-tp8":
        return TraceSpec(10, PAPER_TP8_MODELS, replicate=True, total_calls=960, min_depth=4)
    if name == "paper-tp4":
        if load not in LOADS:
            raise TraceSpecError(f"unknown load {load!r}; choose one of {', '.join(LOADS)}")
        # The TP=4 trace is a subset of the TP=8 one (§5.1): same seed, same sessions, first 4 calls.
        return replace(preset("paper-tp8"), models=PAPER_TP4_MODELS, first_calls=4, arrival_s=LOADS[load])
    raise TraceSpecError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}, "
                         "or give --sessions N --models a,b")


@dataclass(frozen=True, slots=True)
class Step:
    """The raw draws behind one call, before token scaling."""

    completion: int
    gap_s: float  # tool gap before this call (unused for call 0)
    tool_result: int  # tokens the tool appends before this call (0 for call 0)
    keep: float | None  # None: extend the previous context; else the share of it a rewrite keeps


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """One session's draws: replicated sessions share a plan, and scaling re-realizes it."""

    first_prompt: int
    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class GeneratedTrace:
    """The calls, and how much --max-prompt-tokens shrank them (the CLI reports it)."""

    calls: tuple[TraceCall, ...]
    token_scale: float  # 1.0 unless max_prompt_tokens scaled the token counts down
    longest_prompt: int  # before scaling


def generate(spec: TraceSpec, rng: random.Random) -> GeneratedTrace:
    """Draw the sessions `spec` describes; sessions come out in start order, calls in call order."""
    _check(spec)
    depths = [_clip(round(d), spec.min_depth) for d in spec.depth.stratified(spec.tasks, rng)]
    firsts = [max(1, round(p)) for p in spec.first_prompt.stratified(spec.tasks, rng)]
    stretch = 1.0
    if spec.total_calls is not None:
        per_task_total = spec.total_calls // len(spec.models) if spec.replicate else spec.total_calls
        stretch = per_task_total / sum(depths)
        depths = scale_to_total(depths, per_task_total, spec.min_depth, MAX_DEPTH)
    # Stretching a session in calls must not stretch it in tokens: a longer session of the same task
    # takes smaller steps, so the per-call prompt distribution stays the paper's.
    tool = LogNormal(spec.tool_result.median / stretch, spec.tool_result.sigma)
    gaps = [spec.gap_s] * spec.tasks
    if spec.gap_spread:  # drawn only when asked, so the paper's shapes keep their random stream
        gaps = [replace(spec.gap_s, median=m) for m in LogNormal(spec.gap_s.median, spec.gap_spread)
                .stratified(spec.tasks, rng)]
    plans = [_plan(d, f, rng, tool, g) for d, f, g in zip(depths, firsts, gaps)]
    if spec.replicate:
        jobs = [(f"issue{t:02d}-{m}", m, p) for t, p in enumerate(plans) for m in spec.models]
    else:
        jobs = [(f"s{t:04d}", spec.models[t % len(spec.models)], p) for t, p in enumerate(plans)]
    rng.shuffle(jobs)  # start order
    starts, t = [], 0.0
    for _ in jobs:  # drawn whatever arrival_s is, so loads of one seed differ only in spacing
        starts.append(t * spec.arrival_s)
        t += rng.expovariate(1.0)
    scale, longest = 1.0, 0
    while True:
        calls = [c for (sid, model, plan), start in zip(jobs, starts)
                 for c in _realize(sid, model, start, plan, scale, spec.first_calls)]
        top = max(c.prompt_tokens for c in calls)
        longest = longest or top
        if spec.max_prompt_tokens is None or top <= spec.max_prompt_tokens:
            return GeneratedTrace(tuple(calls), scale, longest)
        # Rounding small counts up to 1 token can overshoot a little: then shrink 1% more.
        scale *= min(0.99, spec.max_prompt_tokens / top)


def _check(spec: TraceSpec) -> None:
    if spec.tasks < 1:
        raise TraceSpecError(f"--sessions must be at least 1, got {spec.tasks}")
    if not spec.models or any(not m for m in spec.models):
        raise TraceSpecError("--models needs at least one non-empty model name, e.g. --models a,b")
    if spec.max_prompt_tokens is not None and spec.max_prompt_tokens < 16:
        raise TraceSpecError(f"--max-prompt-tokens {spec.max_prompt_tokens} is too small; use 16 or more")
    if spec.arrival_s < 0:
        raise TraceSpecError(f"--arrival-s must be >= 0, got {spec.arrival_s}")
    if spec.total_calls is not None:
        per = spec.total_calls // len(spec.models) if spec.replicate else spec.total_calls
        if spec.replicate and per * len(spec.models) != spec.total_calls:
            raise TraceSpecError(f"{spec.total_calls} calls do not split evenly over {len(spec.models)} models")
        if not spec.tasks * spec.min_depth <= per <= spec.tasks * MAX_DEPTH:
            raise TraceSpecError(f"{per} calls cannot be split into {spec.tasks} sessions of "
                                 f"{spec.min_depth}-{MAX_DEPTH} calls")


def _clip(depth: int, lo: int) -> int:
    return min(MAX_DEPTH, max(lo, depth))


def scale_to_total(depths: list[int], total: int, lo: int, hi: int) -> list[int]:
    """Depths scaled by one factor and rounded (largest remainder) to sum to `total`, within [lo, hi]."""
    target = [d * total / sum(depths) for d in depths]
    out = [min(hi, max(lo, math.floor(t))) for t in target]
    while sum(out) < total:
        i = max((i for i in range(len(out)) if out[i] < hi), key=lambda i: target[i] - out[i])
        out[i] += 1
    while sum(out) > total:
        i = min((i for i in range(len(out)) if out[i] > lo), key=lambda i: target[i] - out[i])
        out[i] -= 1
    return out


def _plan(depth: int, first: int, rng: random.Random, tool: LogNormal, gap_s: LogNormal) -> SessionPlan:
    """One session's draws. Rewrites are decided on unscaled tokens, so scaling keeps the shape."""
    prompt, steps = first, []
    for k in range(depth):
        completion = min(MAX_COMPLETION, max(1, round(COMPLETION.draw(rng))))
        gap, result, keep = 0.0, 0, None
        if k:
            gap = gap_s.draw(rng)
            result = min(MAX_TOOL_RESULT, round(tool.draw(rng)))
            extended = prompt + steps[-1].completion + result
            if rng.random() < TRUNCATE_P or extended > CONTEXT_LIMIT:
                keep = rng.uniform(*KEEP_FRACTION)
                prompt = int(prompt * keep) + result
            else:
                prompt = extended
        steps.append(Step(completion, gap, result, keep))
    return SessionPlan(first, tuple(steps))


def _realize(session: str, model: str, start_s: float, plan: SessionPlan, scale: float,
             first_calls: int | None) -> list[TraceCall]:
    """The plan's calls with every token count scaled by `scale`; reuse stays exact after scaling."""
    calls: list[TraceCall] = []
    prompt = max(1, int(plan.first_prompt * scale))
    for k, step in enumerate(plan.steps[:first_calls]):
        completion = max(1, int(step.completion * scale))
        reused = 0
        if k:
            prev = calls[-1]
            if step.keep is None:  # invariant: reused = the previous prompt + output, whole
                reused = prev.prompt_tokens + prev.completion_tokens
            else:  # a rewrite keeps at most half of the previous prompt
                reused = int(prev.prompt_tokens * step.keep)
            prompt = reused + int(step.tool_result * scale)
        calls.append(TraceCall(session, k, model, prompt, reused, completion,
                               round(start_s if k == 0 else step.gap_s, 4)))
    return calls
