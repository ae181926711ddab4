"""Session inference from conversation hashes: follow-ups, edits, models, expiry, bounds, tokens."""

import json
import os
import random
import subprocess
import sys

import pytest

from talaria.routing.continuity import (
    ContinuityIndex,
    assistant_message,
    extend_chain,
    message_chain,
    new_session_id,
    token_chain,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SYSTEM = {"role": "system", "content": "You are a coding agent."}
ASK = {"role": "user", "content": "List the files in src/."}
TOOL_CALLS = [{"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path":"src"}'}}]


def remember_call(index: ContinuityIndex, model: str, session: str, messages: list, reply: str) -> None:
    """What the gateway does after a call: the request's last hash and that hash plus our reply."""
    last = message_chain(messages)[-1]
    index.remember(model, session, [last, extend_chain(last, assistant_message(reply))])


def test_follow_up_with_our_reply_and_a_tool_result_continues_the_session():
    index = ContinuityIndex(Clock())
    remember_call(index, "m", "s1", [SYSTEM, ASK], "I'll run ls.")
    follow_up = [SYSTEM, ASK, assistant_message("I'll run ls."),
                 {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"}]
    assert index.lookup("m", message_chain(follow_up)) == "s1"


def test_follow_up_with_an_edited_reply_still_continues_via_the_request_prefix():
    index = ContinuityIndex(Clock())
    remember_call(index, "m", "s1", [SYSTEM, ASK], "I'll run ls.")
    edited = {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS}
    follow_up = [SYSTEM, ASK, edited, {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    assert index.lookup("m", message_chain(follow_up)) == "s1"


def test_a_different_conversation_does_not_map():
    index = ContinuityIndex(Clock())
    remember_call(index, "m", "s1", [SYSTEM, ASK], "ok")
    other = [SYSTEM, {"role": "user", "content": "Write a poem."}, assistant_message("ok")]
    assert index.lookup("m", message_chain(other)) is None


def test_the_same_conversation_on_another_model_is_another_session():
    index = ContinuityIndex(Clock())
    remember_call(index, "m", "s1", [SYSTEM, ASK], "ok")
    chain = message_chain([SYSTEM, ASK, assistant_message("ok")])
    assert index.lookup("other", chain) is None
    remember_call(index, "other", "s2", [SYSTEM, ASK], "ok")
    assert index.lookup("m", chain) == "s1"
    assert index.lookup("other", chain) == "s2"


def test_sessions_expire_after_ttl_and_are_dropped():
    clock = Clock()
    index = ContinuityIndex(clock, ttl_s=60.0)
    remember_call(index, "m", "s1", [SYSTEM, ASK], "ok")
    chain = message_chain([SYSTEM, ASK, assistant_message("ok")])
    clock.now += 60.0
    assert index.lookup("m", chain) == "s1"
    clock.now += 0.5
    assert index.lookup("m", chain) is None
    assert len(index) == 0


def test_capacity_evicts_the_oldest_session_and_its_keys():
    clock = Clock()
    index = ContinuityIndex(clock, capacity=2)
    convs = [[SYSTEM, {"role": "user", "content": f"task {i}"}] for i in range(3)]
    for i, conv in enumerate(convs):
        clock.now += 1
        remember_call(index, "m", f"s{i}", conv, "ok")
    assert len(index) == 2
    assert index.lookup("m", message_chain(convs[0])) is None
    assert index.lookup("m", message_chain(convs[1])) == "s1"
    assert index.lookup("m", message_chain(convs[2])) == "s2"


def test_a_newer_call_replaces_the_session_keys():
    index = ContinuityIndex(Clock())
    first = [SYSTEM, ASK]
    remember_call(index, "m", "s1", first, "I'll run ls.")
    second = [*first, assistant_message("I'll run ls."), {"role": "tool", "tool_call_id": "c", "content": "a.py"}]
    remember_call(index, "m", "s1", second, "Done.")
    assert len(index) == 1
    # A branch from the first call's request no longer maps: only the latest call's keys are held.
    branch = [*first, {"role": "user", "content": "never mind"}]
    assert index.lookup("m", message_chain(branch)) is None
    assert index.lookup("m", message_chain([*second, assistant_message("Done.")])) == "s1"


def test_a_key_taken_by_a_newer_session_survives_the_older_session_eviction():
    clock = Clock()
    index = ContinuityIndex(clock, capacity=2)
    remember_call(index, "m", "old", [SYSTEM, ASK], "ok")
    clock.now += 1
    remember_call(index, "m", "new", [SYSTEM, ASK], "ok")  # same conversation restarted
    clock.now += 1
    remember_call(index, "m", "third", [SYSTEM], "hi")  # evicts "old"
    assert index.lookup("m", message_chain([SYSTEM, ASK])) == "new"


def test_token_chain_matches_prompts_extending_prompt_plus_output_by_full_pages_only():
    rng = random.Random(0)
    prompt = [rng.randrange(50_000) for _ in range(130)]   # 2 full pages of 64
    output = [rng.randrange(50_000) for _ in range(70)]    # prompt + output: 200 tokens, 3 full pages
    index = ContinuityIndex(Clock())
    index.remember("m", "s1", [token_chain(prompt)[-1], token_chain(prompt + output)[-1]])
    whole_pages = prompt + output + [rng.randrange(50_000) for _ in range(56)]  # 256 tokens
    assert index.lookup("m", token_chain(whole_pages)) == "s1"
    partial = prompt + output[:-4] + [7, 7, 7, 7, 1]  # differs only inside the partial 4th page
    assert len(token_chain(partial)) == 3
    assert index.lookup("m", token_chain(partial)) == "s1"
    diverged = prompt[:100] + [1] * 100  # differs inside the 2nd page
    assert index.lookup("m", token_chain(diverged)) is None
    assert token_chain(prompt[:63]) == []


def test_a_chain_extended_after_its_last_full_page_equals_the_chain_of_the_whole():
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(150)]  # 2 full pages and 22 tokens
    output = [rng.randrange(50_000) for _ in range(100)]
    head = token_chain(prompt)
    assert head + token_chain(prompt[128:] + output, after=head[-1]) == token_chain(prompt + output)


def test_content_part_lists_hash_by_their_parts():
    a = {"role": "user", "content": [{"type": "text", "text": "hello"}]}
    b = {"role": "user", "content": [{"type": "text", "text": "hello!"}]}
    same = {"content": [{"text": "hello", "type": "text"}], "role": "user", "refusal": None}
    assert message_chain([a]) != message_chain([b])
    assert message_chain([a]) == message_chain([same])  # key order and non-canonical fields ignored


def test_chains_are_deterministic_across_processes():
    messages = [SYSTEM, ASK, {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS}]
    tokens = list(range(300))
    script = ("import json, sys; from talaria.routing.continuity import message_chain, token_chain; "
              "m, t = json.loads(sys.argv[1]); print(json.dumps([message_chain(m), token_chain(t)]))")
    arg = json.dumps([messages, tokens])
    expected = [message_chain(messages), token_chain(tokens)]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script, arg], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out) == expected


def test_new_session_id_is_auto_plus_16_hex_and_follows_the_rng():
    sid = new_session_id(random.Random(5))
    assert sid == new_session_id(random.Random(5))
    assert sid.startswith("auto-") and len(sid) == 21
    int(sid[5:], 16)
    assert new_session_id() != new_session_id()


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match="capacity"):
        ContinuityIndex(Clock(), capacity=0)
    with pytest.raises(ValueError, match="page"):
        token_chain([1, 2], page=0)


def test_hundred_thousand_sessions_and_ten_thousand_lookups_stay_bounded():
    clock = Clock()
    index = ContinuityIndex(clock, capacity=100_000)
    for i in range(110_000):
        clock.now += 0.001
        index.remember("m", f"s{i}", [2 * i, 2 * i + 1])
    assert len(index) == 100_000
    assert index.lookup("m", [0, 1]) is None  # evicted
    hits = sum(index.lookup("m", [5, 2 * i + 1]) == f"s{i}" for i in range(100_000, 110_000))
    assert hits == 10_000
