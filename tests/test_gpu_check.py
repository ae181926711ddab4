"""`bench/gpu_check.sh --dry-run`: every step of the prepared GPU check runs on the CPU at toy sizes
and leaves its results in the folder, with figures that hang together (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from talaria.config.loader import load_config
from talaria.contracts.profile_file import load_profile

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["machine", "equivalence-float64", "equivalence-float32", "layer-floor", "layer-floor-fp8", "deltanet", "switch",
         "profile-8b-dense", "profile-30b-a3b-moe"]
SHAPES = ["8b-dense", "30b-a3b-moe"]  # the profiled shapes; the layer floor measures a hybrid and an MLA set too
LAYER_SHAPES = [*SHAPES, "qwen3.5-122b-layers", "glm5-layers"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check")
    run = subprocess.run([str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", str(out)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:] + "".join(
        f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((out / "logs").glob("*.log")))
    return out


def test_every_step_ran_and_passed(results: Path) -> None:
    summary = json.loads((results / "summary.json").read_text())
    assert summary["ok"] and summary["dry_run"] and summary["machine"] == "cpu-dry-run"
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" and s["exit_code"] == 0 and 0 < s["seconds"] <= s["budget_s"]
               for s in summary["steps"])
    assert {p.stem for p in (results / "logs").glob("*.log")} == set(STEPS)
    machine = json.loads((results / "machine.json").read_text())
    assert machine["device"] == "cpu" and machine["gpus"] == [] and machine["torch"]


BATCHED = "test_batched_prompts_of_different_lengths[llama]"
RESTORE = "test_restores_copy_each_slab_into_its_page[slabs wider than pages]"


@pytest.mark.parametrize("dtype, must_run", [("float64", {BATCHED, RESTORE}), ("float32", {BATCHED})])
def test_the_equivalence_tests_ran_on_the_device_and_passed(results: Path, dtype: str, must_run: set[str]) -> None:
    suite = ET.parse(results / f"equivalence-{dtype}.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= len(must_run)
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0")
    assert must_run <= {case.get("name") for case in suite.iter("testcase")}


def test_layer_floor_rows_are_times_over_bandwidth_floors(results: Path) -> None:
    floor = json.loads((results / "layer_floor.json").read_text())
    assert floor["device"] == "cpu" and floor["tiny"] and floor["copy_bytes_per_s"] > 0
    assert list(floor["shapes"]) == LAYER_SHAPES
    for shape in floor["shapes"].values():
        rows = [shape["prefill"], *shape["decode"]]
        assert [d["batch"] for d in shape["decode"]] == floor["sizes"]["batches"]
        for row in rows:
            assert row["ms_per_layer"] > 0 and row["bytes_per_layer"] > 0
            assert row["floor_ms_per_layer"] == pytest.approx(row["bytes_per_layer"] / floor["copy_bytes_per_s"] * 1e3)
            assert row["ratio"] == pytest.approx(row["ms_per_layer"] / row["floor_ms_per_layer"])
        arch = shape["arch"]
        if arch["num_experts"]:  # a step reads the experts its tokens went to: at least top-k, at most all
            assert all(arch["num_experts_per_tok"] <= r["experts_per_layer"] <= arch["num_experts"] for r in rows)
            one, more = shape["decode"][0], shape["decode"][-1]
            assert one["experts_per_layer"] == arch["num_experts_per_tok"]  # one token: exactly its top-k
            assert more["bytes_per_layer"] > one["bytes_per_layer"]
        else:
            assert all("experts_per_layer" not in r for r in rows)
        if arch["indexer_types"]:  # GLM-5: decoded past index_topk, so its indexer chooses the tokens
            assert all(d["context"] > arch["index_topk"] for d in shape["decode"])


def test_the_fp8_layer_floor_counts_the_packed_bytes(results: Path) -> None:
    """The same shapes with FP8 projections read fewer bytes a layer than in float32: the packed ones."""
    plain = json.loads((results / "layer_floor.json").read_text())["shapes"]
    fp8 = json.loads((results / "layer_floor_fp8.json").read_text())["shapes"]
    assert list(fp8) == SHAPES and all(fp8[s]["fp8_weights"] for s in SHAPES)
    for s in SHAPES:
        assert fp8[s]["decode"][0]["bytes_per_layer"] < 0.5 * plain[s]["decode"][0]["bytes_per_layer"], s


def test_switch_bench_ran_both_paths_at_toy_sizes(results: Path) -> None:
    switch = json.loads((results / "switch.json").read_text())
    assert switch["device"] == "cpu" and switch["config"]["tiny"]
    assert len(switch["runs"]) == 3
    assert all((r["switch_d2d"]["path"], r["switch_h2d"]["path"]) == ("full_d2d", "h2d_only") for r in switch["runs"])
    assert switch["switch_d2d_ms"] > 0 and switch["switch_h2d_ms"] > 0 and switch["restore_gib_s"] > 0


@pytest.mark.parametrize("shape", SHAPES)
def test_profiles_name_the_machine_and_cover_the_shape(results: Path, shape: str) -> None:
    cfg = load_config(results / "configs" / f"cpu-dry-run-{shape}.toml")
    assert [m.name for m in cfg.models] == [shape]
    profile = load_profile(results / "profiles" / f"cpu-dry-run-{shape}-layers.toml")
    assert profile.device == "cpu" and profile.hardware.startswith("cpu:")
    costs = profile.model(shape)
    assert costs.prefill.seconds(64) > 0 and costs.decode.seconds(1, 64) > 0
