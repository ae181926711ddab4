"""SwitchRecord: a logical switch costs its slowest rank and takes its worst rank's path."""

from __future__ import annotations

import json

import pytest

from talaria.contracts.vocabulary import SwitchPath
from talaria.memory.switch_record import (
    RankSwitchRecord,
    SwitchPhase,
    SwitchRecord,
)


def rank(r: int, phases: tuple[float, ...], path: SwitchPath = SwitchPath.FULL_D2D, rebuilt: bool = False,
         to_model: str = "b") -> RankSwitchRecord:
    return RankSwitchRecord(rank=r, from_model="a", to_model=to_model, path=path, phase_ms=phases,
                            staged_bytes=900, dirty_bytes=0, total_bytes=1000, rebuilt_runtime=rebuilt)


def test_phases_are_the_papers_five_in_order():
    assert [p.name for p in SwitchPhase] == ["SAVE_TEARDOWN", "OPEN_WEIGHTS", "KV_SHELL", "RUNTIME", "PUBLISH"]


def test_rank_total_and_phase_lookup():
    r = rank(0, (26.2, 109.6, 0.5, 8.6, 0.2))
    assert r.total_ms == pytest.approx(145.1)
    assert r.phase(SwitchPhase.OPEN_WEIGHTS) == 109.6 and r.phase(SwitchPhase.PUBLISH) == 0.2


def test_rank_record_validates_phases():
    with pytest.raises(ValueError, match="5"):
        rank(0, (1.0, 2.0))
    with pytest.raises(ValueError, match="negative"):
        rank(0, (1.0, -2.0, 0.0, 0.0, 0.0))
    assert rank(0, [1, 2, 3, 4, 5]).phase_ms == (1.0, 2.0, 3.0, 4.0, 5.0)  # a list is normalised


def test_total_is_the_max_over_ranks_of_each_ranks_sum():
    # rank 0 has the largest single phase (50) but rank 1 the largest sum (10 * 5 = 50 < 4 * 14 + 0 = 56)
    rec = SwitchRecord((rank(0, (0.0, 50.0, 0.0, 0.0, 0.0)), rank(1, (14.0, 14.0, 14.0, 14.0, 0.0)),
                        rank(2, (1.0, 1.0, 1.0, 1.0, 1.0))))
    assert rec.total_ms == 56.0


def test_path_is_the_worst_over_ranks():
    full, part, h2d = SwitchPath.FULL_D2D, SwitchPath.PARTIAL, SwitchPath.H2D_ONLY
    z = (0.0,) * 5
    assert SwitchRecord((rank(0, z, full), rank(1, z, full))).path is full
    assert SwitchRecord((rank(0, z, full), rank(1, z, part))).path is part
    assert SwitchRecord((rank(0, z, h2d), rank(1, z, part), rank(2, z, full))).path is h2d


def test_record_rejects_empty_or_inconsistent_ranks():
    with pytest.raises(ValueError):
        SwitchRecord(())
    with pytest.raises(ValueError, match="disagree"):
        SwitchRecord((rank(0, (0.0,) * 5), rank(1, (0.0,) * 5, to_model="c")))


def test_to_dict_is_json_ready():
    rec = SwitchRecord((rank(0, (1.0, 2.0, 3.0, 4.0, 5.0), SwitchPath.PARTIAL),
                        rank(1, (1.0, 1.0, 1.0, 1.0, 1.0), rebuilt=True)))
    d = json.loads(json.dumps(rec.to_dict()))
    assert d["from_model"] == "a" and d["to_model"] == "b"
    assert d["path"] == "partial" and d["total_ms"] == 15.0 and d["rebuilt_runtime"] is True
    assert d["ranks"][0]["phase_ms"] == {"save_teardown": 1.0, "open_weights": 2.0, "kv_shell": 3.0,
                                         "runtime": 4.0, "publish": 5.0}
    assert d["ranks"][1]["total_ms"] == 5.0 and d["ranks"][1]["path"] == "full_d2d"
    assert d["ranks"][0]["staged_bytes"] == 900 and d["ranks"][0]["total_bytes"] == 1000
