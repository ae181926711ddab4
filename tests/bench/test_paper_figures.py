"""bench/paper_figures.py's verdict (issue 35): each banded row holds only inside its band, on every
seed; and the paper's figures are read before any simulation, a missing file named."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_bench

FIELDS = ("sct_p50_s", "sct_p95_s", "ttft_p50_s", "rounds", "switch_p50_ms", "hbm_peak_gib", "sp_admission_rate")


@pytest.fixture(scope="module")
def figures():
    return load_bench("paper_figures")


@pytest.fixture
def paper(figures, tmp_path) -> dict[str, float]:
    """Every figure a row reads set to 100 (and so Round-only / Talaria to 1)."""
    tables: dict[str, list[str]] = {}
    for _, key, _, _ in figures.ROWS:
        if key is not None:
            table, name = key.split(".")
            tables.setdefault(table, []).append(f"{name} = 100.0")
    path = tmp_path / "figures.toml"
    path.write_text("".join(f"[{table}]\n" + "\n".join(lines) + "\n" for table, lines in tables.items()))
    return figures.paper_values(path)


def rows(figures, paper, talaria_p50: dict[int, float], sp_rate: float) -> dict[str, dict]:
    runs = {seed: {v: {**dict.fromkeys(FIELDS, 100.0), "sct_p50_s": p50 if v == "talaria" else 100.0,
                       "sp_admission_rate": sp_rate} for v in figures.VARIANTS}
            for seed, p50 in talaria_p50.items()}
    return {r["row"]: r for r in figures.rows_of(runs, paper)}


def test_a_banded_row_holds_only_when_every_seed_is_inside_its_band(figures, paper) -> None:
    inside = rows(figures, paper, {0: 124.0, 1: 76.0}, 0.59)
    assert inside["Talaria p50 SCT (s)"]["ratio"] == {0: 1.24, 1: 0.76}
    assert inside["Talaria p50 SCT (s)"]["held"] is True
    assert inside["SP admission rate (Fig. 10)"]["held"] is True  # a value band: 35-60 %
    assert inside["Talaria p95 SCT (s)"]["held"] is None  # no band
    one_seed_out = rows(figures, paper, {0: 100.0, 1: 126.0}, 0.61)
    assert one_seed_out["Talaria p50 SCT (s)"]["held"] is False
    assert one_seed_out["SP admission rate (Fig. 10)"]["held"] is False
    assert one_seed_out["Round-only / Talaria p50"]["ours"] == {0: 1.0, 1: pytest.approx(100 / 126)}


def test_a_missing_figures_file_is_named_with_the_option_that_points_elsewhere(figures, tmp_path) -> None:
    with pytest.raises(SystemExit, match=r"no paper figures at .*missing\.toml.*--figures PATH"):
        figures.paper_values(tmp_path / "missing.toml")
