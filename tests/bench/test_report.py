"""bench/report.py's verdict: a missed target fails a benchmark unless --no-gate; a wrong result fails
it whatever --no-gate says."""

from __future__ import annotations

import argparse

import pytest

from tests.bench.scripts import load_bench


@pytest.fixture(scope="module")
def report():
    return load_bench("report")


def test_a_missed_target_fails_unless_exploring(report, capsys) -> None:
    assert report.gate(["ratio_tok_s_8 = 0.71 < 0.8"], [], no_gate=False) == 1
    assert "targets missed: ratio_tok_s_8 = 0.71 < 0.8" in capsys.readouterr().out
    assert report.gate(["ratio_tok_s_8 = 0.71 < 0.8"], [], no_gate=True) == 0
    assert "--no-gate" in capsys.readouterr().out


def test_a_wrong_result_fails_even_when_exploring(report, capsys) -> None:
    assert report.gate([], ["chat and messages decoded different text"], no_gate=True) == 1
    assert "FAILED: chat and messages decoded different text" in capsys.readouterr().out


def test_all_met_passes(report, capsys) -> None:
    assert report.gate([], [], no_gate=False) == 0
    assert capsys.readouterr().out.strip() == "all targets met"


def test_the_flag(report) -> None:
    ap = argparse.ArgumentParser()
    report.add_gate_flag(ap)
    assert ap.parse_args([]).no_gate is False and ap.parse_args(["--no-gate"]).no_gate is True

