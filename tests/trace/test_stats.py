"""`talaria.trace.stats`: exact statistics of a hand-written trace, nearest-rank percentiles, the table."""

from __future__ import annotations

from talaria.contracts.trace import TraceCall
from talaria.trace.stats import PAPER, format_table, percentile, trace_stats


def call(session: str, index: int, prompt: int, reused: int, completion: int, gap: float) -> TraceCall:
    return TraceCall(session, index, "m", prompt, reused, completion, gap)


# Session a: 3 calls, both continuations reuse the whole context. Session b: 2 calls, the
# continuation keeps 400 of 1,000 tokens (under half). Session c: 1 call. Lines interleave.
TRACE = [
    call("a", 0, 100, 0, 10, 0.0),
    call("b", 0, 1000, 0, 50, 5.0),
    call("a", 1, 200, 110, 20, 0.5),
    call("c", 0, 300, 0, 30, 9.0),
    call("b", 1, 500, 400, 40, 2.0),
    call("a", 2, 400, 220, 60, 1.5),
]


def test_hand_written_trace_stats_are_exact():
    s = trace_stats(TRACE)
    assert (s.sessions, s.calls, s.multi_call_sessions) == (3, 6, 2)
    assert (s.depth_p50, s.depth_p95, s.depth_max) == (2, 3, 3)  # depths 1, 2, 3
    # gaps of continuations only (0.5, 2.0, 1.5): start offsets 0, 5, 9 are not gaps
    assert (s.gap_p50_s, s.gap_p95_s) == (1.5, 2.0)
    assert (s.prompt_p50, s.prompt_p95) == (300, 1000)  # 100 200 300 400 500 1000: ranks 3 and 6
    assert s.reuse_over_half == 2 / 3  # 110 > 50, 220 > 100, 400 < 500
    assert (s.completion_p50, s.completion_p95) == (30, 60)


def test_nearest_rank_percentile():
    values = list(range(1, 21))  # 1..20
    assert percentile(values, 50) == 10
    assert percentile(values, 95) == 19
    assert percentile(values, 100) == 20
    assert percentile(values, 0) == 1
    assert percentile([7.0, 3.0], 50) == 3.0  # order does not matter
    assert percentile([], 50) is None


def test_single_call_sessions_have_no_gap_or_reuse_figures():
    s = trace_stats([call("x", 0, 10, 0, 1, 0.0)])
    assert s.gap_p50_s is None and s.reuse_over_half is None
    assert "gap_p50_s" in format_table(s)


def test_table_shows_trace_and_paper_side_by_side():
    table = format_table(trace_stats(TRACE)).splitlines()
    assert table[0].split() == ["statistic", "trace", "paper", "§2.1"]
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows["calls"] == ["6", f"{PAPER['calls']:,}"]
    assert rows["reuse_over_half"] == ["66.7%", "96.8%"]
    assert rows["gap_p50_s"] == ["1.50", "0.39"]
    assert rows["completion_p50"] == ["30", "-"]
    assert set(rows) == set(PAPER)
