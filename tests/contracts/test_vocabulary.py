"""`talaria.contracts.vocabulary`: one rule from staging coverage to switch path, one spelling per word."""

from __future__ import annotations

import json

import pytest

from talaria.contracts.vocabulary import KVLocation, SwitchPath


@pytest.mark.parametrize(("coverage", "path"), [(0.0, SwitchPath.H2D_ONLY), (1e-9, SwitchPath.PARTIAL),
                                                (0.5, SwitchPath.PARTIAL), (0.999999, SwitchPath.PARTIAL),
                                                (1.0, SwitchPath.FULL_D2D)])
def test_coverage_decides_the_path(coverage, path):
    assert SwitchPath.for_coverage(coverage) is path


def test_paths_rank_best_first_and_travel_as_their_values():
    assert [p.severity for p in SwitchPath] == [0, 1, 2]
    assert json.dumps([SwitchPath.PARTIAL, KVLocation.HOST]) == '["partial", "host"]'
    assert SwitchPath("full_d2d") is SwitchPath.FULL_D2D and {"missing": 1}[KVLocation.MISSING] == 1
