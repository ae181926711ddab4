"""The same agent workload through each API an agent speaks: chat, Messages and Responses.

Part of `python bench/agent_api.py` (alone: `--apis-only`). One real `talaria up` on the embedded
default config (SmolLM2 on a hot instance). The workload is fixed before measuring: one agent turn
— a system prompt, three function tools, a user request — written in each API's own shape
(`messages` with `tools`; `system` with `input_schema` tools; `instructions`, `input` and flat
function tools), so all three render the same prompt tokens and, decoded greedily, the same
`MAX_TOKENS` output tokens. Each call is streamed and timed on the client from sending the request:
TTFT to the first text delta (`delta.content`, `text_delta`, `response.output_text.delta`), tokens/s
as output tokens (the usage each API reports) over the time from the first delta to the end of the
stream. Calls alternate chat, Messages, Responses, `--runs` rounds after one warm-up round (the
prompt is then in the prefix cache for every measured call, for each API alike); the report is each
API's median and its ratio to chat's. The target: Messages and Responses within 5% of chat on both.
Every call's text (its text deltas joined) is recorded: greedy decoding of one prompt must give the
same text and token count through every API and in every round (`api_outputs_agree`; chat's is the
reference), else bench/agent_api.py fails whatever `--no-gate` says.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
from report import ProgressLog, render  # bench/report.py, beside this script
from server import start_server, stop_server, wait_healthy  # bench/server.py

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "talaria" / "talaria.toml"
MAX_TOKENS = 64
TOLERANCE = 0.05  # Messages and Responses within 5% of chat, on TTFT and on tokens/s
SYSTEM = "You are a coding agent. Answer in plain prose; do not call a tool unless you must."
REQUEST = "Explain in a few sentences what a prefix cache is and why an agent benefits from one."
FUNCTIONS = [
    {"name": "shell", "description": "Run a shell command in the repository and return its output",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"name": "read_file", "description": "Read a file of the repository",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "search", "description": "Search the repository's text for a pattern",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}},
]
APIS = ("chat", "messages", "responses")


def request(api: str) -> tuple[str, dict]:
    """(path, body) of the workload's turn in `api`'s shape, streamed, greedy."""
    if api == "chat":
        return "/v1/chat/completions", {
            "model": "smollm2", "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True},
            "tools": [{"type": "function", "function": f} for f in FUNCTIONS],
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": REQUEST}]}
    if api == "messages":
        return "/v1/messages", {
            "model": "smollm2", "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS, "system": SYSTEM,
            "tools": [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                      for f in FUNCTIONS],
            "messages": [{"role": "user", "content": REQUEST}]}
    return "/v1/responses", {
        "model": "smollm2", "stream": True, "temperature": 0, "max_output_tokens": MAX_TOKENS, "store": False,
        "instructions": SYSTEM, "tools": [{"type": "function", **f} for f in FUNCTIONS], "input": REQUEST}


def text_delta(api: str, data: dict) -> str:
    """The text an event adds to the answer ("" for any other event)."""
    if api == "chat":
        return "".join(c.get("delta", {}).get("content") or "" for c in data.get("choices", []))
    if api == "messages":
        is_text = data.get("type") == "content_block_delta" and data["delta"].get("type") == "text_delta"
        return data["delta"]["text"] if is_text else ""
    return data["delta"] if data.get("type") == "response.output_text.delta" else ""


def output_tokens(api: str, data: dict) -> int | None:
    if api == "chat":
        return (data.get("usage") or {}).get("completion_tokens")
    if api == "messages":
        return data["usage"]["output_tokens"] if data.get("type") == "message_delta" else None
    done = data.get("type") in ("response.completed", "response.incomplete")
    return data["response"]["usage"]["output_tokens"] if done else None


def timed(client: httpx.Client, url: str, api: str) -> dict:
    """One streamed call: TTFT, tokens/s, output tokens, its text."""
    path, body = request(api)
    first = tokens = None
    text = ""
    t0 = time.perf_counter()
    with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            delta = text_delta(api, data)
            if first is None and delta:
                first = time.perf_counter()
            text += delta
            tokens = output_tokens(api, data) or tokens
    end = time.perf_counter()
    if first is None or not tokens:
        raise RuntimeError(f"{api}: the stream had no text delta or no usage")
    return {"ttft_s": first - t0, "tok_s": tokens / (end - first), "tokens": tokens, "text": text}


def outputs_agree(samples: dict[str, list[dict]]) -> bool:
    """Whether every measured call gave the text and token count of chat's first: the one prompt,
    decoded greedily, through every API and in every round."""
    reference = samples["chat"][0]
    return all((s["text"], s["tokens"]) == (reference["text"], reference["tokens"])
               for calls in samples.values() for s in calls)


def measure(runs: int, workdir: Path, log: ProgressLog) -> dict:
    log_path = workdir / "talaria-apis.log"
    proc, url = start_server(DEFAULT_CONFIG, log_path)
    samples: dict[str, list[dict]] = {api: [] for api in APIS}
    try:
        wait_healthy(proc, url, log_path)
        with httpx.Client(timeout=120) as client:
            for api in APIS:  # warm-up: the prompt's pages cached, each API's code paths run once
                timed(client, url, api)
            for k in range(runs):
                log(f"APIs, round {k + 1}/{runs}")
                for api in APIS:
                    samples[api].append(timed(client, url, api))
    finally:
        stop_server(proc)
    result: dict = {"api_runs": samples, "api_max_tokens": MAX_TOKENS}
    for api in APIS:
        result[f"{api}_ttft_s"] = statistics.median(s["ttft_s"] for s in samples[api])
        result[f"{api}_tok_s"] = statistics.median(s["tok_s"] for s in samples[api])
        result[f"{api}_tokens"] = sorted({s["tokens"] for s in samples[api]})
    result["api_texts"] = {api: sorted({s["text"] for s in samples[api]}) for api in APIS}
    result["api_outputs_agree"] = outputs_agree(samples)
    result["api_met"] = {}
    for api in APIS[1:]:
        result[f"{api}_ttft_ratio"] = result[f"{api}_ttft_s"] / result["chat_ttft_s"]
        result[f"{api}_tok_s_ratio"] = result[f"{api}_tok_s"] / result["chat_tok_s"]
        result["api_met"][api] = all(abs(result[f"{api}_{m}_ratio"] - 1) <= TOLERANCE for m in ("ttft", "tok_s"))
    return result


def table(m: dict) -> str:
    rows = [("API (SmolLM2, streamed)", "TTFT ms", "tokens/s", "output tokens", "TTFT / chat", "tok/s / chat",
             f"within {TOLERANCE:.0%}", "text = chat's")]
    for api in APIS:
        ratios = ("-", "-", "-") if api == "chat" else (
            f"{m[f'{api}_ttft_ratio']:.3f}", f"{m[f'{api}_tok_s_ratio']:.3f}", "yes" if m["api_met"][api] else "NO")
        same = "yes" if m["api_texts"][api] == m["api_texts"]["chat"] and len(m["api_texts"][api]) == 1 else "NO"
        rows.append((api, f"{m[f'{api}_ttft_s'] * 1e3:.1f}", f"{m[f'{api}_tok_s']:.1f}",
                     ",".join(map(str, m[f"{api}_tokens"])), *ratios, same))
    return render(rows)
