"""Calibration (`talaria profile`, cold start-up) on a real in-process engine: every switch path is
measured through the scheduler's own staging and switch code, and the probes leave the instance as
they found it — the first model active, its weights intact (greedy output equals the reference)."""

from __future__ import annotations

import pytest

from talaria.config.schema import Pool
from talaria.executor.calibrate import Probes
from talaria.executor.driver import Driver
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import GREEDY, call, driver, instance, run, tiny_files, tokens

SMALL = Probes(prefill_tokens=(8, 32), cached_tokens=(16,), decode_batches=(1, 2), decode_contexts=(16,),
               repeats=1, copy_bytes=1 << 20)


@pytest.fixture(scope="module")
def two(model_cache):
    return [tiny_files("llama", model_cache), tiny_files("qwen3", model_cache)]


def calibrated(files, **overrides) -> Driver:
    return driver(instance(files, pool=Pool.COLD, **overrides), files, probes=SMALL)


def test_profile_measures_all_three_switch_paths_and_leaves_the_first_model_intact(two):
    core = calibrated(two, staging_chunk_bytes=4096, host_kv_bytes=1 << 20)
    for f in two:
        mp = core.profile.model(f.name)
        layout = core.executor.substrate.images[f.name].layout  # the cache sizes are the descriptor's
        assert (mp.token_bytes, mp.state_bytes) == (layout.token_bytes, layout.state_bytes) != (0, 0)
        assert set(mp.switch) == {"h2d_only", "full_d2d", "partial"}, f.name
        assert all(cost.total_s > 0 for cost in mp.switch.values())
        assert f"of {mp.weights_bytes} weight bytes staged" in mp.sources["switch.partial"]
        staged = int(mp.sources["switch.partial"].split()[4])  # "measured: an open with N of M ..."
        assert 0 < staged < mp.weights_bytes
        assert mp.sources["switch.full_d2d"].startswith(f"measured: an open with {mp.weights_bytes} of")
    assert core.profile.bandwidth.restore_bytes_per_s > 0  # host KV is on: the restore op was timed
    first = two[0]
    assert core.executor.substrate.active == core.scheduler.active == first.name
    prompt = list(range(3, 40))
    out = run(core, [call("r", first.name, prompt)])["r"]
    assert tokens(out) == ReferenceLlama(first.directory).greedy(prompt, GREEDY.max_tokens)


def test_without_staging_only_the_h2d_path_is_measured(two):
    core = calibrated(two, staging_chunk_bytes=0, host_kv_bytes=0)
    assert all(set(core.profile.model(f.name).switch) == {"h2d_only"} for f in two)
    assert core.profile.bandwidth.restore_bytes_per_s is None  # no host KV: restore falls back to H2D
    assert core.profile.bandwidth.restore == core.profile.bandwidth.h2d_bytes_per_s
