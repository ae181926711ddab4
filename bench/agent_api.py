"""Constrained decoding of a forced tool call against free decoding, with a coding agent's tool set;
then an agent's long prompts at the gateway (bench/agent_prompts.py); then one agent turn through
chat, Messages and Responses (bench/agent_api_parity.py).

    python bench/agent_api.py [--json PATH] [--runs N] [--threads T] [--profile] [--prompts-only] [--apis-only]

A coding agent sends the same large tool set with every turn: here 17 tools modelled on what such
agents send (shell, file reading and editing, search, notebooks, web, todo list, sub-agents), whose
JSON schemas together are about 60 KB, most of it long multi-paragraph descriptions. With
`tool_choice` "required" the gateway turns the tools into one llguidance grammar
(`tool_call_grammar(ToolParser.HERMES, functions, parallel=False)`) and rank 0 masks every token
the grammar does not allow. This measures what that costs the engine, and what the grammar costs to
build and compile.

SmolLM2-135M-Instruct in float32 on the CPU runs in-process (`start_driver(Executor(...))`, TP=1,
the code a worker runs) on one hot instance. The prompt is a short chat-templated coding request;
the 60 KB of schemas are NOT rendered into it, because SmolLM2's context is 8,192 tokens and they
would take most of it: the tools reach the decoder through the grammar only, which is the part under
test. The workload is fixed up front:

* constrained: greedy, `grammar=` the 17-tool grammar, `max_tokens` 256; a call ends by itself when
  the grammar is complete (only the end of turn is then allowed). Every call's token count and
  finish reason are recorded, and its text is parsed back as a Hermes tool call;
* unconstrained: the same prompts, greedy, no grammar, `ignore_eos`, `max_tokens` = the number of
  tokens the constrained call on that prompt produced in the same run, so both decode exactly as
  many tokens (and take as many steps) per prompt;
* batch 1 (one request) and batch 8 (eight distinct requests submitted together), constrained then
  unconstrained, alternating, `--runs` times (default 3).

tokens/s = generated tokens / the wall time of the step loop (time.perf_counter from after the calls
are added to the last step), prefill included the same way for both; TTFT (loop start -> a call's
first token, median over calls) is reported beside it. The ratio constrained/unconstrained is taken
per run and the median over runs is reported; the target is >= 0.8 at batch 1 and at batch 8.

One Driver serves everything. It is warmed up first with an unconstrained batch of all eight
prompts, so every measured call finds the same prompt pages in the prefix cache, constrained or
not. Then the first constrained call compiles the grammar against the vocabulary
(`driver.sampler.grammars.stats`: compiles 1, compile_s) and a second call with the same tools (the
next request) must compile nothing (compiles unchanged, reuses + 1); every measured call after that
reuses the compiled grammar, as an agent's later turns do. The gateway's side, building and
validating the grammar from the tools (`tool_call_grammar`, LRU-cached), is timed on an empty cache
and again on a warm one. `--profile` also runs one constrained batch of 8 under cProfile and reports
its top entries, to show where the time of a constrained step goes. Progress goes to stderr, the
table to stdout, everything to the JSON file.

It exits 1 when a target is missed: the two tokens/s ratios, the grammar's compiles and reuses as the
table lists them (1 compile on the first call, 0 and 1 reuse on the second, 0 during the runs), and
the targets of the other two parts (bench/agent_prompts.py, bench/agent_api_parity.py); `--no-gate`
exits 0 for missed targets, to explore. It exits 1 whatever `--no-gate` says when a result is wrong:
tokenizing from the previous prompt gives other ids than tokenizing it whole, or the APIs' greedy
outputs of the same prompt differ (from chat's, or from call to call).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import agent_api_parity  # bench/agent_api_parity.py, beside this script
import agent_prompts  # bench/agent_prompts.py, beside this script
import torch
from agent_tools import TOOLS  # bench/agent_tools.py, beside this script
from engine import (  # bench/engine.py: its SmolLM2 instance, driven as there
    INSTANCE,
    MODEL,
    fresh_core,
    stepped,
)
from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)

from talaria.config.schema import ToolParser
from talaria.contracts.call import FinishReason, InstanceCall, SamplingParams
from talaria.executor.driver import Driver
from talaria.gateway import grammar as gateway_grammar
from talaria.gateway.output_parser import parse
from talaria.gateway.tools import Function
from talaria.models.source import prepare_model
from talaria.models.tokenizer import Tokenizer

BATCHES = (1, 8)
CONSTRAINED_MAX_TOKENS = 256
TARGETS = {"ratio_tok_s_1": 0.8, "ratio_tok_s_8": 0.8}  # constrained / unconstrained tokens/s, at least
SECOND_CALL_COMPILES = 0  # grammars compiled by a second call with the same tools

SYSTEM = "You are a coding agent working in the user's repository. Use the tools to carry out the request."
REQUESTS = (
    "List the Python files in the repository, then read the largest one.",
    "Find every place where the code opens a database connection.",
    "Run the unit tests and tell me which ones fail.",
    "Show me the last five commits on this branch.",
    "Read the README and summarise how to install the project.",
    "Rename the function fetch_rows to load_rows in src/db.py.",
    "Make a todo list for adding a --verbose flag to the command line tool.",
    "Search the web for the latest release of the requests library.",
)

def functions() -> tuple[Function, ...]:
    """The tools as the gateway parses them (talaria/gateway/tools.py)."""
    return tuple(Function(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                 for t in TOOLS)


# ---- serving -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Served:
    """A batch of calls submitted together to the Driver, timed on time.perf_counter."""

    tokens: tuple[tuple[int, ...], ...]  # generated ids per call (a constrained call's last is the end of turn)
    finishes: tuple[FinishReason, ...]
    loop_s: float  # after the calls are added -> the last step
    ttft_s: float  # loop start -> a call's first token, median over calls

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.tokens)) / self.loop_s


def serve(driver: Driver, prompts: list[list[int]], samplings: list[SamplingParams]) -> Served:
    """Submit every call, then step the Driver until all have finished."""
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    first: dict[str, float] = {}
    finish: dict[str, FinishReason] = {}
    outputs = []
    for rid, prompt, sampling in zip(ids, prompts, samplings):
        outputs += driver.add(InstanceCall(rid, MODEL.name, tuple(prompt), sampling))
    t0 = time.perf_counter()
    for now, out in stepped(driver, outputs):
        if out.token_ids:
            first.setdefault(out.request_id, now)
            tokens[out.request_id] += out.token_ids
        if out.finish is not None:
            finish[out.request_id] = out.finish
    return Served(tokens=tuple(tuple(tokens[r]) for r in ids), finishes=tuple(finish[r] for r in ids),
                  loop_s=time.perf_counter() - t0, ttft_s=statistics.median(first[r] - t0 for r in ids))


def constrained(grammar: str) -> SamplingParams:
    return SamplingParams(max_tokens=CONSTRAINED_MAX_TOKENS, temperature=0.0, grammar=grammar)


def unconstrained(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tool_call_of(tok: Tokenizer, ids: tuple[int, ...]) -> tuple[str, tuple[str, str] | None]:
    """A constrained call's text (without its end of turn) and the one tool call parsed from it, if
    that is what it is: (name, arguments) with arguments a JSON object. A call cut at max_tokens
    has unfinished arguments, so none."""
    text = tok.decode([i for i in ids if i not in tok.eos_token_ids])
    calls = parse(text, ToolParser.HERMES, reasoning=False).tool_calls
    try:
        ok = len(calls) == 1 and isinstance(json.loads(calls[0][1]), dict)
    except json.JSONDecodeError:
        ok = False
    return text, calls[0] if ok else None


# ---- the measurements --------------------------------------------------------------------------

def gateway_build() -> dict:
    """The gateway's grammar for the tools, built on an empty cache and then again (a cache hit)."""
    fns = functions()
    gateway_grammar._compile.cache_clear()
    t0 = time.perf_counter()
    grammar = gateway_grammar.tool_call_grammar(ToolParser.HERMES, fns, parallel=False)
    t1 = time.perf_counter()
    again = gateway_grammar.tool_call_grammar(ToolParser.HERMES, fns, parallel=False)
    t2 = time.perf_counter()
    assert again == grammar
    return {"grammar": grammar, "gateway_grammar_first_s": t1 - t0, "gateway_grammar_second_s": t2 - t1}


def compile_check(driver: Driver, tok: Tokenizer, prompts: list[list[int]], grammar: str, log) -> dict:
    """The first constrained call compiles the grammar; a second one, another request with the same
    tools, must compile nothing."""
    stats = driver.sampler.grammars.stats
    before = dataclasses.replace(stats)
    log("first constrained call (compiles the grammar)")
    first = serve(driver, prompts[:1], [constrained(grammar)])
    after_first = dataclasses.replace(stats)
    log("second constrained call, same tools")
    serve(driver, prompts[1:2], [constrained(grammar)])
    text, call = tool_call_of(tok, first.tokens[0])
    return {
        "grammar_first_call_compiles": after_first.compiles - before.compiles,
        "grammar_compile_s": after_first.compile_s - before.compile_s,
        "grammar_second_call_compiles": stats.compiles - after_first.compiles,
        "grammar_second_call_reuses": stats.reuses - after_first.reuses,
        "first_call_tokens": len(first.tokens[0]),
        "first_call_finish": first.finishes[0].value,
        "first_call_text": text,
        "first_call_tool": call[0] if call else None,
    }


def one_run(driver: Driver, tok: Tokenizer, prompts: list[list[int]], grammar: str, log) -> dict:
    """Per batch size: the constrained calls, then the same prompts unconstrained for as many tokens."""
    row: dict = {}
    compiles = driver.sampler.grammars.stats.compiles
    for b in BATCHES:
        batch = prompts[:b]
        log(f"constrained, batch {b}")
        con = serve(driver, batch, [constrained(grammar)] * b)
        counts = [len(t) for t in con.tokens]
        log(f"unconstrained, batch {b}, {counts} tokens")
        free = serve(driver, batch, [unconstrained(n) for n in counts])
        if [len(t) for t in free.tokens] != counts:
            raise RuntimeError(f"unconstrained calls made {[len(t) for t in free.tokens]} tokens, expected {counts}")
        texts, calls = zip(*(tool_call_of(tok, t) for t in con.tokens))
        row.update({
            f"constrained_tok_s_{b}": con.tok_s, f"unconstrained_tok_s_{b}": free.tok_s,
            f"ratio_tok_s_{b}": con.tok_s / free.tok_s,
            f"constrained_ttft_s_{b}": con.ttft_s, f"unconstrained_ttft_s_{b}": free.ttft_s,
            f"constrained_loop_s_{b}": con.loop_s, f"unconstrained_loop_s_{b}": free.loop_s,
            f"constrained_tokens_{b}": counts,
            f"constrained_finishes_{b}": [f.value for f in con.finishes],
            f"constrained_all_stop_{b}": all(f is FinishReason.STOP for f in con.finishes),
            f"constrained_tools_{b}": [c[0] if c else None for c in calls],  # None: not one complete call
            f"constrained_texts_{b}": list(texts),
        })
    row["grammar_compiles_during_run"] = driver.sampler.grammars.stats.compiles - compiles
    return row


def profile_constrained(driver: Driver, prompts: list[list[int]], grammar: str, top: int = 20) -> str:
    """cProfile over one constrained batch of 8: the share of sampling (grammar masks included) and
    of the masks alone, then the top entries by own time."""
    prof = cProfile.Profile()
    prof.enable()
    serve(driver, prompts[:max(BATCHES)], [constrained(grammar)] * max(BATCHES))
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    total = stats.total_tt

    def cumulative(path: str, *names: str) -> float:  # cumulative seconds of these functions of that file
        return sum(v[3] for (file, _, name), v in stats.stats.items() if file.endswith(path) and name in names)
    for label, s in (("Sampler.sample (masks included)", cumulative("executor/sampler.py", "sample")),
                     ("GrammarMasks.allowed + consume", cumulative("executor/grammar_masks.py", "allowed", "consume"))):
        print(f"{label}: {s:.3f} s of {total:.3f} s ({s / total:.1%})", file=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ---- inputs, report ----------------------------------------------------------------------------

def build_prompts(tok: Tokenizer) -> list[list[int]]:
    """One chat-templated request per call, the tools not rendered (they reach decoding as the grammar)."""
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": r}])
            for r in REQUESTS]


def met(value: float, target: float) -> str:
    return "yes" if value >= target else "NO"


def tables(m: dict) -> str:
    def ms(s):
        return f"{s * 1e3:.1f}"
    speed = [("metric", "constrained", "unconstrained", "ratio", "target", "met")]
    for b in BATCHES:
        r = m[f"ratio_tok_s_{b}"]
        speed.append((f"tokens/s, batch {b}", f"{m[f'constrained_tok_s_{b}']:.1f}",
                      f"{m[f'unconstrained_tok_s_{b}']:.1f}", f"{r:.2f}", f">= {TARGETS[f'ratio_tok_s_{b}']}",
                      met(r, TARGETS[f"ratio_tok_s_{b}"])))
    for b in BATCHES:
        speed.append((f"TTFT ms, batch {b}", ms(m[f"constrained_ttft_s_{b}"]), ms(m[f"unconstrained_ttft_s_{b}"]),
                      "-", "-", "-"))
    grammar = [("grammar", "value", "target", "met"),
               ("tool schemas, bytes of JSON (17 tools)", str(m["tools_schema_bytes"]), "-", "-"),
               ("gateway build ms, empty cache", ms(m["gateway_grammar_first_s"]), "-", "-"),
               ("gateway build ms, cached", ms(m["gateway_grammar_second_s"]), "-", "-"),
               ("instance compile ms, first call", ms(m["grammar_compile_s"]), "-", "-"),
               ("compiles, first call", str(m["grammar_first_call_compiles"]), "1",
                "yes" if m["grammar_first_call_compiles"] == 1 else "NO"),
               ("compiles, second call (same tools)", str(m["grammar_second_call_compiles"]),
                str(SECOND_CALL_COMPILES), "yes" if m["grammar_second_call_compiles"] == SECOND_CALL_COMPILES else "NO"),
               ("reuses, second call", str(m["grammar_second_call_reuses"]), "1",
                "yes" if m["grammar_second_call_reuses"] == 1 else "NO"),
               ("compiles during the measured runs", str(m["grammar_compiles_during_runs"]), "0",
                "yes" if m["grammar_compiles_during_runs"] == 0 else "NO")]
    return render(speed) + "\n\n" + render(grammar)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/agent_api.json"), help="where to write results")
    ap.add_argument("--runs", type=int, default=3, help="runs to take the median of (at least 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--profile", action="store_true", help="also profile one constrained batch of 8 with cProfile")
    ap.add_argument("--prompts-only", action="store_true",
                    help="only the long-prompt measurements (tokenization reuse, /health under load)")
    ap.add_argument("--apis-only", action="store_true",
                    help="only the same agent turn through chat, Messages and Responses (TTFT, tokens/s)")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3: the report is a median")

    log = ProgressLog()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    result = {} if args.prompts_only or args.apis_only else engine(args, log)
    tok = Tokenizer.load(prepare_model(MODEL, None).directory)
    prompts, apis = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        if not args.apis_only:
            prompts = agent_prompts.measure(tok, max(args.runs, 5), Path(workdir), log)
            print(agent_prompts.table(prompts))
        if not args.prompts_only:
            apis = agent_api_parity.measure(max(args.runs, 12), Path(workdir), log)  # 5 rounds: ±8% noise
            print(agent_api_parity.table(apis))
    met = {**result.get("met", {}), **prompts.get("prompt_met", {}),
           **{f"api_{api}": ok for api, ok in apis.get("api_met", {}).items()}}
    missed = [k for k, ok in met.items() if not ok]
    wrong = []
    if prompts and not prompts["reuse_ids_equal_full"]:
        wrong.append("tokenizing the next prompt from the previous one gave other ids than tokenizing it whole")
    if apis and not apis["api_outputs_agree"]:
        wrong.append("the same prompt decoded greedily gave different outputs: "
                     + "; ".join(f"{api}: {texts!r}" for api, texts in apis["api_texts"].items()))
    write_json(args.json, {**result, **prompts, **apis, "missed": missed, "wrong": wrong, "threads": args.threads,
                           **environment(log, load_start)}, log)
    return gate(missed, wrong, args.no_gate)


def engine(args: argparse.Namespace, log: ProgressLog) -> dict:
    """Constrained against free decoding on the engine, and the grammar's costs; prints its tables."""
    schema_bytes = len(json.dumps(TOOLS))
    log(f"{len(TOOLS)} tools, {schema_bytes:,} bytes of JSON schemas")
    built = gateway_build()
    log(f"gateway grammar: {len(built['grammar']):,} characters, built in {built['gateway_grammar_first_s'] * 1e3:.1f} ms, "
        f"{built['gateway_grammar_second_s'] * 1e3:.2f} ms cached")
    grammar = built.pop("grammar")

    log(f"preparing {MODEL.source} (float32), {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    files = prepare_model(MODEL, None)
    tok = Tokenizer.load(files.directory)
    prompts = build_prompts(tok)
    driver = fresh_core(files)
    log(f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens; warming up (unconstrained, batch 8)")
    serve(driver, prompts, [unconstrained(4)] * len(prompts))
    check = compile_check(driver, tok, prompts, grammar, log)
    log(f"compiled in {check['grammar_compile_s'] * 1e3:.1f} ms; first call: {check['first_call_tokens']} tokens, "
        f"finish {check['first_call_finish']}, text {check['first_call_text']!r}")

    runs = []
    for r in range(args.runs):
        log(f"run {r + 1}/{args.runs}")
        runs.append(one_run(driver, tok, prompts, grammar, log))

    scalar = [k for k, v in runs[0].items() if isinstance(v, float)]
    medians = {k: statistics.median(run[k] for run in runs) for k in scalar}
    result = {
        **medians,
        **check,
        **built,
        "tools_schema_bytes": schema_bytes,
        "grammar_chars": len(grammar),
        "grammar_compiles_during_runs": sum(run["grammar_compiles_during_run"] for run in runs),
        **{f"constrained_all_stop_{b}": all(run[f"constrained_all_stop_{b}"] for run in runs) for b in BATCHES},
        **{f"constrained_stop_fraction_{b}": sum(f == "stop" for run in runs for f in run[f"constrained_finishes_{b}"])
           / (b * len(runs)) for b in BATCHES},
        **{f"constrained_tool_calls_parsed_{b}": sum(t is not None for run in runs for t in run[f"constrained_tools_{b}"])
           / (b * len(runs)) for b in BATCHES},
        "targets": {**TARGETS, "grammar_first_call_compiles": 1, "grammar_second_call_compiles": SECOND_CALL_COMPILES,
                    "grammar_second_call_reuses": 1, "grammar_compiles_during_runs": 0},
        "met": {**{k: medians[k] >= v for k, v in TARGETS.items()},
                "grammar_first_call_compiles": check["grammar_first_call_compiles"] == 1,
                "grammar_second_call_compiles": check["grammar_second_call_compiles"] == SECOND_CALL_COMPILES,
                "grammar_second_call_reuses": check["grammar_second_call_reuses"] == 1,
                "grammar_compiles_during_runs": sum(run["grammar_compiles_during_run"] for run in runs) == 0},
        "runs": runs,
        "config": {"model": MODEL.source, "dtype": MODEL.dtype, "instance": dataclasses.asdict(INSTANCE),
                   "threads": args.threads, "runs": args.runs, "batches": BATCHES,
                   "constrained_max_tokens": CONSTRAINED_MAX_TOKENS, "tool_parser": ToolParser.HERMES.value,
                   "tools": [t["function"]["name"] for t in TOOLS], "system": SYSTEM, "requests": REQUESTS,
                   "prompt_tokens": [len(p) for p in prompts]},
    }
    if args.profile:
        log("profiling one constrained batch of 8")
        result["profile_constrained_8"] = profile_constrained(driver, prompts, grammar)
        print(result["profile_constrained_8"], file=sys.stderr)

    print(tables(result))
    print(f"(medians of {args.runs} runs; ratio = median of the per-run constrained/unconstrained tokens/s)")
    for b in BATCHES:
        print(f"batch {b}: constrained calls ending 'stop' (not 'length' at {CONSTRAINED_MAX_TOKENS} tokens): "
              f"{result[f'constrained_stop_fraction_{b}']:.0%}, parsed as one complete tool call: "
              f"{result[f'constrained_tool_calls_parsed_{b}']:.0%}; tokens per call, run 1: "
              f"{runs[0][f'constrained_tokens_{b}']}")
    print(f"first constrained call ({check['first_call_tokens']} tokens): {check['first_call_text']}")
    driver.stop()
    return result


if __name__ == "__main__":
    sys.exit(main())
