"""Session-prefill end to end: a real `talaria up` with two models on one cold instance, the same
closed-loop agent workload replayed with SP on and then with `ablations = ["sp"]`.

SP must admit returning sessions mid-slot (after the slot's first decode phase, before the slot
ends), must be silent when ablated, and must change only *when* a call runs, never what it returns.
The models are float64 so that different batch compositions cannot flip a greedy near-tie.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from talaria.replay import ReplayResult, ReplaySession, agent_sessions, replay_sync
from tests.conftest import start_server

pytestmark = pytest.mark.slow

TP = 2  # the "two models of one cold instance" on a TP group
MODELS = ["tiny-llama", "tiny-qwen3"]
SHORT_TOKENS, LONG_TOKENS = 4, 48
SHORT_SESSIONS, TURNS, ANCHOR_TURNS = 2, 4, 2  # per model
WORKLOAD = {"system_chars": 240, "tool_chars": 60, "gap_s": (0.005, 0.03)}
CLOCK_SLACK_S = 1e-6  # start + duration_s re-adds a difference of two clock readings: allow rounding
SHAPE = ('hidden_size = 128\nintermediate_size = 256\nnum_layers = 4\nnum_heads = 4\nnum_kv_heads = 2\n'
         'vocab_size = 512\nmax_position = 2048\n')


def config(directory: Path, ablations: list[str]) -> Path:
    models = "".join(
        f'[[models]]\nname = "{name}"\nsource = "synthetic:"\ndtype = "float64"\nseed = {seed}\n\n'
        f'[models.shape]\nfamily = "{family}"\n{SHAPE}\n'
        for name, seed, family in ((MODELS[0], 1, "llama"), (MODELS[1], 2, "qwen3")))
    path = directory / "talaria.toml"
    path.write_text(
        f'[server]\nhost = "127.0.0.1"\n\n{models}'
        f'[[instances]]\nname = "cold-0"\npool = "cold"\nmodels = {json.dumps(MODELS)}\ntp = {TP}\n'
        f'arena_bytes = "64MiB"\nhost_kv_bytes = "16MiB"\nstaging_chunk_bytes = "64KiB"\n'
        f"ttft_s = 1.0\ntpot_s = 0.2\ngamma = 0.8\nablations = {json.dumps(ablations)}\n\n"
        '[router]\npolicy = "session-sticky"\n\n'  # one instance: routing is not under test
        f'[telemetry]\nevents_path = "{directory / "events.jsonl"}"\n')
    return path


def workload() -> list[ReplaySession]:
    """Per model, one anchor session that decodes long, keeping its model's slot open, and two short
    sessions whose returns, after gaps of a few milliseconds, land while the anchor still decodes:
    the situation SP exists for. (Without an anchor, the sessions of a model tend to finish in the
    same step and return after their slot has closed, and SP's chance is left to timing.)"""
    short = agent_sessions(MODELS, SHORT_SESSIONS, TURNS, seed=3, max_tokens=SHORT_TOKENS, **WORKLOAD)
    long = agent_sessions(MODELS, 1, ANCHOR_TURNS, seed=4, max_tokens=LONG_TOKENS, **WORKLOAD)
    return [anchor(s, s.calls[0].body["model"] + "-anchor") for s in long] + short


def anchor(session: ReplaySession, sid: str) -> ReplaySession:
    """`session` renamed to `sid`, starting at once (before the short sessions' offsets)."""
    calls = [replace(c, body={**c.body, "session_id": sid}) for c in session.calls]
    return ReplaySession(sid, (replace(calls[0], gap_before_s=0.0), *calls[1:]))


@dataclass
class Run:
    result: ReplayResult
    events: list[dict]  # the event log, in order


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """The workload with SP on ("on") and ablated ("off"), one fresh server each."""
    sessions = workload()
    out = {}
    for label, ablations in (("on", []), ("off", ["sp"])):
        directory = tmp_path_factory.mktemp(f"sp-{label}")
        server = start_server(config(directory, ablations), directory / "talaria.log")
        try:
            server.wait_healthy()
            result = replay_sync(server.base_url, sessions)
        finally:
            server.stop()
        lines = (directory / "events.jsonl").read_text().splitlines()
        out[label] = Run(result, [json.loads(line) for line in lines if line.strip()])
    return out


def of_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def test_every_call_completes_in_both_runs(runs):
    for label, run in runs.items():
        failed = [(c.session_id, c.index, c.status, c.error) for c in run.result.calls if not c.ok]
        assert not failed, f"SP {label}: {failed}"
        assert len(run.result.calls) == len(MODELS) * (SHORT_SESSIONS * TURNS + ANCHOR_TURNS)
        tokens = {c.usage["completion_tokens"] for c in run.result.calls}
        assert tokens == {SHORT_TOKENS, LONG_TOKENS}


def test_sp_admits_returning_sessions_inside_an_open_slot(runs):
    events = runs["on"].events
    admits = of_kind(events, "sp_admit")
    assert admits, f"SP on admitted nothing; event kinds: {sorted({e['kind'] for e in events})}"
    phases: dict[tuple[str, int], list[dict]] = defaultdict(list)  # (model, round) -> its slot's phases
    for p in of_kind(events, "slot_phase"):
        phases[p["model"], p["round"]].append(p)
    closed_rounds = {r["round"] for r in of_kind(events, "round")}
    checked = 0
    for a in admits:
        assert a["session"].startswith(a["model"] + "-"), a  # a continuation of that model's session
        slot = phases[a["model"], a["round"]]
        d1 = [p for p in slot if p["phase"] == "D1"]  # P -> D1 -> (SP -> D)*: SP comes after D1 ends
        assert d1, f"admitted in a slot with no D1: {a}, slot {slot}"
        assert a["t"] >= d1[0]["start"] + d1[0]["duration_s"] - CLOCK_SLACK_S, f"admitted before D1 ended: {a}, {d1}"
        if a["round"] in closed_rounds:  # the slot has ended, so all of its phases are logged
            start = min(p["start"] for p in slot)
            end = max(p["start"] + p["duration_s"] for p in slot)
            assert start < a["t"] < end, f"admitted outside its slot [{start}, {end}]: {a}"
            assert any(p["phase"] == "SP" for p in slot), slot
            checked += 1
    assert checked, f"no SP admission in a round that closed: {admits}"


def test_sp_off_admits_nothing(runs):
    events = runs["off"].events
    assert of_kind(events, "sp_admit") == []
    assert not [p for p in of_kind(events, "slot_phase") if p["phase"] == "SP"]
    assert of_kind(events, "round"), "no rounds logged: the event log is not on"


def test_outputs_are_identical_with_and_without_sp(runs):
    on = {(c.session_id, c.index): c.text for c in runs["on"].result.calls}
    off = {(c.session_id, c.index): c.text for c in runs["off"].result.calls}
    assert on.keys() == off.keys()
    assert [k for k in on if on[k] != off[k]] == []
