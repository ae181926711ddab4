"""`talaria.instance.assembly`: what an instance's config asks for is what gets built, in one place."""

from __future__ import annotations

import dataclasses

import pytest

from talaria.config.schema import Ablation, InstanceConfig, Pool
from talaria.instance.assembly import ServedModel, assemble, new_stager
from talaria.instance.rounds import RoundConfig
from talaria.memory.bump_layout import BumpLayout
from tests.instance.copy_events import CopyEventsStandIn
from tests.instance.scheduler_harness import (
    LAYOUT,
    PAGE_BYTES,
    PS,
    WEIGHTS,
    FakeClock,
    toy_profile,
)

COLD = InstanceConfig("c", Pool.COLD, ("a", "b"), arena_bytes=8192, page_size=PS, max_batch_tokens=32,
                      max_running=5, host_kv_bytes=10 * PAGE_BYTES, staging_chunk_bytes=256, ttft_s=3.0,
                      tpot_s=0.5, gamma=0.5, record_steps=True)


def build(config: InstanceConfig, models=("a", "b"), **options):
    layout = BumpLayout(config.arena_bytes, 256)
    for m in models:
        layout.register(m, WEIGHTS[m], LAYOUT)
    served = [ServedModel(m, WEIGHTS[m], LAYOUT, 100 + i, (7,)) for i, m in enumerate(models)]
    return assemble(config, layout, served, toy_profile(models), CopyEventsStandIn(), FakeClock(2.0), **options)


def test_a_cold_instance_gets_rounds_host_kv_staging_and_its_first_model_open():
    s = build(COLD)
    assert s.active == "a" and s.instance == "c" and s.record_steps
    assert s.rounds is not None and s.rounds.config == RoundConfig.of(COLD)
    assert s.rounds.config.round_s == 1.5 and s.rounds.costs is s.costs
    assert s.memory.host.stats().num_slabs == 10
    assert s.memory.stager is not None and s.memory.stager.target_model == "b"  # staging the next one
    b = s.batchers["b"]
    assert (b.max_batch_tokens, b.max_running, b.model_context, b.eos_token_ids) == (32, 5, 101, {7})
    assert s.costs.alpha > 0


def test_ablations_and_a_hot_pool_build_less():
    s = build(dataclasses.replace(COLD, ablations=(Ablation.HKVR, Ablation.STAGING, Ablation.SP)))
    # HKVR ablated, the host only swaps preempted sequences; with no host KV budget there is none at all
    assert not s.memory.host.sessions and s.memory.stager is None and not s.rounds.config.sp
    assert build(dataclasses.replace(COLD, host_kv_bytes=0)).memory.host is None
    hot = build(InstanceConfig("h", Pool.HOT, ("a",), arena_bytes=4096, page_size=PS), models=("a",))
    assert hot.rounds is None and hot.memory.stager is None and hot.active == "a"
    assert build(COLD, learn=False).costs.alpha == 0.0


@pytest.mark.parametrize(("config", "models", "staged"), [
    (COLD, 2, True), (COLD, 1, False), (dataclasses.replace(COLD, staging_chunk_bytes=0), 2, False),
    (dataclasses.replace(COLD, ablations=(Ablation.ROUND_ONLY,)), 2, False)])
def test_calibration_stages_only_where_the_instance_would(config, models, staged):
    assert (new_stager(config, models) is not None) is staged
