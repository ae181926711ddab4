"""`talaria.trace.mooncake`: hash-chain session rebuilding on hand-made requests, and on the real
Mooncake conversation trace against the figures its README measured."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from talaria.contracts.trace import TraceError, read_trace, sessions, write_trace
from talaria.trace.mooncake import BLOCK_TOKENS, MooncakeRequest, convert, read_mooncake
from talaria.trace.stats import percentile, trace_stats

MOONCAKE = Path(__file__).resolve().parents[2].parent / "shared/data/traces/mooncake_conversation_trace.jsonl"


def req(ms: int, tokens: int, hashes: list[int], out: int = 10) -> MooncakeRequest:
    return MooncakeRequest(ms, tokens, out, tuple(hashes))


def test_a_request_continues_the_one_whose_complete_blocks_it_starts_with():
    calls = convert([
        req(1000, 1300, [0, 1, 2]),  # complete blocks 0, 1; block 2 is partial
        req(3000, 2000, [0, 1, 5, 6]),  # grows past the partial block: continues request 0
        req(3500, 900, [9, 8]),  # unrelated
        req(7000, 2600, [0, 1, 5, 6, 7, 8]),  # continues request 1
    ], model="m")
    assert [(c.session, c.index) for c in calls] == [("mc00000", 0), ("mc00000", 1), ("mc00001", 0), ("mc00000", 2)]
    assert [c.reused_tokens for c in calls] == [0, 2 * BLOCK_TOKENS, 0, min(2600, 4 * BLOCK_TOKENS)]
    assert [c.gap_s for c in calls] == [0.0, 2.0, 2.5, 4.0]  # first calls: offset from the first arrival
    assert calls[3].block_hashes == (0, 1, 5, 6, 7, 8) and {c.model for c in calls} == {"m"}


def test_one_shared_block_is_not_a_conversation():
    calls = convert([req(0, 700, [0, 1]), req(10, 3000, [0, 1, 2, 3, 4, 5])])
    assert [c.index for c in calls] == [0, 0]  # the parent had a single complete block


def test_longest_parent_wins_and_ties_go_to_the_most_recent():
    calls = convert([
        req(0, 1024, [0, 1]),
        req(1, 2048, [0, 1, 2, 3]),  # continues 0
        req(2, 2048, [0, 1, 2, 3]),  # same prompt again: continues 1 (its parent), reuses it all
        req(3, 4096, [0, 1, 2, 3, 4, 5, 6, 7]),  # longest parents: 1 and 2 tie; 2 is more recent
    ])
    assert [(c.session, c.index) for c in calls] == [("mc00000", i) for i in range(4)]
    assert calls[2].reused_tokens == 2048


def test_a_fork_starts_a_new_session():
    calls = convert([req(0, 1024, [0, 1]), req(1, 1536, [0, 1, 2]), req(2, 1536, [0, 1, 3])])
    assert [(c.session, c.index, c.reused_tokens) for c in calls] == \
           [("mc00000", 0, 0), ("mc00000", 1, 1024), ("mc00001", 0, 0)]


def test_bad_files_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]})
                    + "\n" + json.dumps({"timestamp": 1, "input_length": 5}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: missing 'output_length'"):
        read_mooncake(path)
    path.write_text("{not json\n")
    with pytest.raises(TraceError, match="bad.jsonl:1: not JSON"):
        read_mooncake(path)


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the shared Mooncake trace is not at {MOONCAKE}")
def test_real_mooncake_trace(tmp_path):
    calls = convert(read_mooncake(MOONCAKE))
    path = tmp_path / "mc.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        write_trace(calls, f)
    assert read_trace(path) == calls
    assert len(calls) == 12_031
    stats = trace_stats(calls)
    assert (stats.prompt_p50, stats.completion_p50, stats.completion_p95) == (6_909, 350, 698)  # README
    # README: rebuilt chains are chat-like sessions of p50 2 / p95 6 calls, about two minutes apart.
    chains = [len(seq) for seq in sessions(calls).values() if len(seq) > 1]
    assert percentile(chains, 50) == 2
    assert 5 <= percentile(chains, 95) <= 7
    assert 60 <= stats.gap_p50_s <= 180
    by_session = sessions(calls)
    for seq in by_session.values():
        for prev, call in pairwise(seq):
            shared = 0
            while shared < min(len(prev.block_hashes), len(call.block_hashes)) and \
                    prev.block_hashes[shared] == call.block_hashes[shared]:
                shared += 1
            assert call.reused_tokens == min(call.prompt_tokens, BLOCK_TOKENS * shared)
            assert shared >= 2 and call.gap_s >= 0
