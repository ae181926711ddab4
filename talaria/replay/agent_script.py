"""A synthetic agent workload for closed-loop replay: deep sessions of self-extending prompts.

Its shape follows the SWE-Bench sessions the paper characterises (§2.1). A session is one agent
task on one model. Between calls a tool runs for a short gap. Each call's prompt is the previous
call's prompt plus the assistant's turn and the tool's result, so almost all of it is a prefix the
server has already seen (the paper: 96.8% of continuations reuse more than half of the previous
prefix). That repeated prefix is what session-prefill and the host KV registry exploit, and what a
round scheduler that makes a returning session wait for its model's next slot throws away.

    call 0:  system(model) + task(session)
    call k:  call k-1 + assistant placeholder(k) + tool result(session, k)

The assistant turn is a fixed placeholder, not the model's actual output: fixed replay holds every
request body constant across the configurations being compared, so agent paths cannot diverge
(paper App. A). Sessions of one model share its system prompt, as agents of one harness do. All
text is ASCII, so a byte-level tokenizer (the synthetic models') sees one token per character.

Everything random comes from one `random.Random(seed)`: the same arguments give the same sessions.
"""

from __future__ import annotations

import random

from talaria.replay.closed_loop import ReplayCall, ReplaySession

# Words tool output and instructions are made of: code-ish, so the text looks like an agent's.
WORDS = ("def", "return", "self", "value", "import", "config", "test", "assert", "error", "path", "line",
         "None", "list", "dict", "for", "in", "if", "else", "class", "patch", "diff", "file", "src",
         "raise", "pass", "index", "result", "args", "kwargs", "True", "False", "main", "module")
ASSISTANT_TURN = "\n<assistant>step {k}: calling the tool</assistant>\n"  # k = the call it follows
TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>\n"
TASK = "Task {session}: "  # opens each session's task line, after the model's system prompt


def agent_sessions(
    models: list[str],
    sessions_per_model: int,
    turns: int,
    *,
    seed: int,
    system_chars: int,
    tool_chars: int,
    max_tokens: int | tuple[int, int],
    gap_s: tuple[float, float],
) -> list[ReplaySession]:
    """`sessions_per_model` sessions of `turns` calls for every model, interleaved by model.

    Prompts: call 0 is the model's `system_chars`-character system prompt plus the session's task
    line (about 60 characters); every later call appends the assistant placeholder (about 45
    characters) and a `tool_chars`-character tool result. So the last prompt is roughly
    system_chars + 60 + (turns - 1) * (45 + tool_chars) characters; keep it under the models'
    context. Every body asks for exactly `max_tokens` greedy tokens (`ignore_eos`, temperature 0)
    under the session's id; a (low, high) pair draws each call's count uniformly from it, as real
    completions vary, which also keeps one model's sessions from finishing in the same decode step
    and returning together. Gaps are uniform in `gap_s`; each session's first call waits a seeded
    offset in [0, gap_s[1]] so sessions start interleaved rather than in lockstep."""
    lo, hi = gap_s
    tok_lo, tok_hi = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    if not models or len(set(models)) != len(models):
        raise ValueError(f"models must be distinct and at least one, got {models}")
    if sessions_per_model < 1 or turns < 1:
        raise ValueError("sessions_per_model and turns must each be at least 1")
    if not 1 <= tok_lo <= tok_hi:
        raise ValueError(f"max_tokens must be an int >= 1 or a (low, high) pair with 1 <= low <= high, "
                         f"got {max_tokens}")
    if system_chars < 0 or tool_chars < 0:
        raise ValueError("system_chars and tool_chars must be >= 0")
    if not 0 <= lo <= hi:
        raise ValueError(f"gap_s must be (low, high) with 0 <= low <= high, got {gap_s}")

    rng = random.Random(seed)
    systems = {m: _system_prompt(rng, m, system_chars) for m in models}
    sessions = []
    for i in range(sessions_per_model):
        for m in models:
            sid = f"{m}-s{i}"
            prompt = systems[m] + TASK.format(session=sid) + _text(rng, 40) + "\n"
            calls = [ReplayCall(_body(m, sid, prompt, _tokens(rng, tok_lo, tok_hi)), rng.uniform(0.0, hi))]
            for k in range(1, turns):
                prompt += ASSISTANT_TURN.format(k=k - 1) + TOOL_OPEN + _text(rng, tool_chars) + TOOL_CLOSE
                calls.append(ReplayCall(_body(m, sid, prompt, _tokens(rng, tok_lo, tok_hi)), rng.uniform(lo, hi)))
            sessions.append(ReplaySession(sid, tuple(calls)))
    return sessions


def _body(model: str, session_id: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "session_id": session_id}


def _tokens(rng: random.Random, lo: int, hi: int) -> int:
    return lo if lo == hi else rng.randint(lo, hi)  # a fixed count draws nothing: same stream as before


def _system_prompt(rng: random.Random, model: str, chars: int) -> str:
    head = f"You are a coding agent running on {model}. Use the tool; read its output; fix the bug.\n"
    return (head + _text(rng, chars))[:chars]


def _text(rng: random.Random, chars: int) -> str:
    """Exactly `chars` characters of seeded code-ish words, broken into lines."""
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS) + ("\n" if rng.random() < 0.1 else " ")
        out.append(word)
        size += len(word)
    return "".join(out)[:chars]
