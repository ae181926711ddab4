"""The paper-derived cost profiles in profiles/: they load, cover every switch path, reproduce the
slope of the paper's two Qwen3-235B recompute points, carry Table 2's switch phases, and say where every group
of numbers comes from (profiles/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.profile import PHASE_NAMES, Profile
from talaria.contracts.profile_file import load_profile
from talaria.contracts.vocabulary import SwitchPath

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
TP8, TP4 = PROFILES / "paper-tp8.toml", PROFILES / "paper-tp4.toml"
GIB = 2**30

MODELS = {
    TP8: {"Qwen3-235B", "GLM5-nvfp4", "Qwen3.5-122B-A10B"},  # paper §5.1
    TP4: {"Qwen3-32B", "Qwen2.5-32B-Instruct", "Qwen3.5-35B-A3B"},  # paper §5.1, router testbed
}
MODEL_SOURCE_GROUPS = ("prefill", "decode", "switch", "weights_bytes", "kv_bytes_per_token")  # token_bytes: its old key
PROFILE_SOURCE_GROUPS = ("bandwidth", "device_bytes", "hardware")

# paper App. D Table 2, p50 per phase in ms (save_teardown, open_weights, kv_shell, runtime, publish)
TABLE2_P50_MS = {
    "full_d2d": (26.2, 109.6, 0.5, 8.6, 0.2),
    "partial": (26.9, 995.8, 0.5, 8.3, 0.2),
    "h2d_only": (21.9, 2570.6, 0.8, 7.7, 0.2),
}
# paper §1 / §2.1: recompute of a prefix on Qwen3-235B, TP=8 (tokens, seconds)
RECOMPUTE = ((25_000, 4.3), (100_000, 10.9))


@pytest.fixture(scope="module", params=[TP8, TP4], ids=["tp8", "tp4"])
def loaded(request) -> tuple[Path, Profile]:
    return request.param, load_profile(request.param)


def test_both_profiles_load_with_the_expected_shape(loaded):
    path, p = loaded
    assert p.device == "cuda" and p.method == "paper-derived"
    assert p.tp == (8 if path == TP8 else 4)
    assert p.device_bytes == 183 * GIB  # paper §5.1 (TP=8); assumed for the TP=4 testbed
    assert set(p.models) == MODELS[path]


def test_every_model_has_all_three_switch_paths(loaded):
    _, p = loaded
    for name, m in p.models.items():
        assert set(m.switch) == set(SwitchPath), name
        for path, cost in m.switch.items():
            assert len(cost.phase_s) == len(PHASE_NAMES), (name, path)
        # staging can only help: a full gather is cheapest, the host path dearest
        assert m.switch["full_d2d"].total_s < m.switch["partial"].total_s \
            < m.switch["h2d_only"].total_s, name


def test_qwen3_235b_prefill_takes_the_recompute_slope_and_a_forward_s_fixed_cost():
    """The slope of the paper's two recompute TTFTs; the intercept of one forward (the decode step
    at batch 1), not the >= 2.1 s every exact fit needs; so the curve lies below both points."""
    p = load_profile(TP8)
    (t1, s1), (t2, s2) = RECOMPUTE
    for name, m in p.models.items():
        assert m.prefill.base_s == m.decode.base_s, name
    qwen = p.models["Qwen3-235B"].prefill
    assert qwen.per_token_s == pytest.approx((s2 - s1) / (t2 - t1))
    for tokens, seconds in RECOMPUTE:
        assert seconds - 2.2 < p.prefill_s("Qwen3-235B", tokens) < seconds, tokens


def test_tp8_switch_phases_are_table2_p50():
    p = load_profile(TP8)
    for name, m in p.models.items():
        for path, ms in TABLE2_P50_MS.items():
            assert m.switch[path].phase_s == pytest.approx([x / 1000 for x in ms]), (name, path)


def test_tp4_switch_phases_other_than_weights_are_table2_p50():
    p = load_profile(TP4)
    for name, m in p.models.items():
        for path, ms in TABLE2_P50_MS.items():
            got = m.switch[path].phase_s
            for i, phase in enumerate(PHASE_NAMES):
                if phase != "open_weights":
                    assert got[i] == pytest.approx(ms[i] / 1000), (name, path, phase)


def test_every_numeric_group_names_its_source(loaded):
    _, p = loaded
    for key in PROFILE_SOURCE_GROUPS:
        assert p.sources.get(key, "").strip(), f"profile.sources.{key} is missing or empty"
    for name, m in p.models.items():
        for key in MODEL_SOURCE_GROUPS:
            assert m.sources.get(key, "").strip(), f"models.{name}.sources.{key} is missing or empty"


def test_all_weights_fit_one_device(loaded):
    # a mechanism sanity check, not an outcome: every model's shard can be staged on one rank
    _, p = loaded
    assert sum(m.weights_bytes for m in p.models.values()) < p.device_bytes


def test_costs_are_positive_where_a_mechanism_charges_them(loaded):
    _, p = loaded
    assert min(p.bandwidth.h2d_bytes_per_s, p.bandwidth.d2h_bytes_per_s) > 0
    assert p.bandwidth.d2d_bytes_per_s > p.bandwidth.h2d_bytes_per_s
    for name, m in p.models.items():
        assert m.weights_bytes > 0 and m.token_bytes > 0, name
        # a hybrid model keeps one recurrent state per sequence (paper-tp4 does not give it yet)
        assert (m.state_bytes > 0) is ("Qwen3.5" in name and p.tp == 8), name
        assert m.prefill.per_token_s > 0 and m.decode.base_s > 0, name
        assert p.restore_s(name, 25_000) > 0 and p.decode_s(name, 1) > 0, name


def test_qwen35s_sizes_are_the_engines_layout_of_its_stated_dims():
    """paper-tp8's Qwen3.5-122B-A10B token and state bytes are what the engine lays out (kv_layout) at
    TP 8 for the dims its sources state: 48 layers, 3 Gated DeltaNet to 1 attention, 2 KV heads of 256,
    DeltaNet 16 key / 64 value heads of 128, conv kernel 4; BF16 cache, FP32 recurrent state."""
    arch = ModelArch(vocab_size=1, hidden_size=3072, intermediate_size=0, num_layers=48, num_heads=32,
                     num_kv_heads=2, head_dim=256, max_position=8192, family="qwen3_5_moe",
                     layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 12,
                     linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4)
    layout = kv_layout(arch, 8, 16, "bfloat16")
    m = load_profile(TP8).model("Qwen3.5-122B-A10B")
    assert (m.token_bytes, m.state_bytes) == (layout.token_bytes, layout.state_bytes)
