"""`talaria.contracts.profile`: round trip (and files with the key before the cache layout descriptor),
one bad snippet per validation error, curve and transfer arithmetic (state snapshots included), switch
estimates, and the non-negative fits calibration relies on."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest

from talaria.contracts.profile import (
    PHASE_NAMES,
    PROFILE_SCHEMA,
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    ProfileError,
    SwitchCost,
)
from talaria.contracts.profile_file import (
    dump_profile,
    load_profile,
    parse_profile,
    save_profile,
)
from talaria.contracts.step_plan import MemoryOps, SeqChunk, StepPlan
from talaria.contracts.vocabulary import SwitchPath
from talaria.executor.curve_fit import fit_decode, fit_linear, fit_prefill

GOOD = """\
[profile]
schema = 1
hardware = "cpu: test box, 2 threads"
device = "cpu"
tp = 1
device_bytes = 268435456
created = "2026-11-30T12:00:00+00:00"
method = "start-up calibration"

[profile.sources]
hardware = "lscpu"

[bandwidth]
h2d_bytes_per_s = 1.0e10
d2h_bytes_per_s = 5.0e9
d2d_bytes_per_s = 4.0e10

[models.tiny-llama]
weights_bytes = 1000000000
token_bytes = 4096

[models.tiny-llama.prefill]
base_s = 0.001
per_token_s = 1e-5
per_token_context_s = 0.0

[models.tiny-llama.decode]
base_s = 0.002
per_seq_s = 1e-4

[models.tiny-llama.switch.h2d_only]
phase_s = [0.001, 0.01, 0.0001, 0.0001, 0.00001]

[models.tiny-llama.sources]
prefill = "measured at start-up"
"""


def make_profile(switch: dict[str, SwitchCost] | None = None, state_bytes: int = 0) -> Profile:
    model = ModelProfile(
        name="m", weights_bytes=8_000_000_000, token_bytes=131_072, state_bytes=state_bytes,
        prefill=PrefillCurve(0.01, 2e-4, 1e-8), decode=DecodeCurve(0.02, 3e-4, 5e-7),
        switch=switch if switch is not None else {}, sources={"decode": "paper Table 2"})
    return Profile(hardware="cuda: NVIDIA H200 x8", device="cuda", tp=8, device_bytes=141 << 30,
                   created="2026-11-30T12:00:00+00:00", method="paper-derived",
                   bandwidth=Bandwidth(h2d_bytes_per_s=5e10, d2h_bytes_per_s=2.5e10,
                                       d2d_bytes_per_s=4e11),
                   models={"m": model}, sources={"bandwidth": "nvbandwidth"})


def test_parse_reads_every_key_and_defaults_the_optional_ones():
    p = parse_profile(GOOD, "profiles/x.toml")
    m = p.model("tiny-llama")
    assert (p.schema, p.tp, p.device_bytes, p.device) == (PROFILE_SCHEMA, 1, 268435456, "cpu")
    assert p.bandwidth == Bandwidth(1e10, 5e9, 4e10)
    assert (m.token_bytes, m.state_bytes) == (4096, 0)  # state_bytes defaults to 0: no per-sequence state
    assert m.decode == DecodeCurve(0.002, 1e-4, 0.0)  # per_context_token_s defaults to 0
    assert m.switch == {SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0.001, 0.01, 0.0001, 0.0001, 1e-5))}
    assert m.sources == {"prefill": "measured at start-up"}
    assert p.sources == {"hardware": "lscpu"}


def test_the_example_in_the_docs_parses():
    doc = (Path(__file__).parents[2] / "docs" / "profile.md").read_text(encoding="utf-8")
    example = re.search(r"```toml\n(.*?)```", doc, re.DOTALL).group(1)
    p = parse_profile(example, "docs/profile.md")
    assert p.switch_s("tiny-llama") == pytest.approx(0.001 + 0.01 + 0.0001 + 0.0001 + 0.00001)


@pytest.mark.parametrize("profile", [
    make_profile(),
    make_profile(state_bytes=3 << 20),
    make_profile({SwitchPath.FULL_D2D: SwitchCost(SwitchPath.FULL_D2D, (0.1, 0.2, 0.3, 0.4, 0.5)),
                  SwitchPath.PARTIAL: SwitchCost(SwitchPath.PARTIAL, (1e-9, 1 / 3, 0.0, 2.5e-7, 7.0))}),
    parse_profile(GOOD),
])
def test_dump_then_parse_gives_the_same_profile(profile):
    assert parse_profile(dump_profile(profile)) == profile


def test_a_file_with_the_old_key_loads_and_is_written_back_with_the_new_ones():
    old = parse_profile(edit("token_bytes = 4096", "kv_bytes_per_token = 4096"), "profiles/old.toml")
    assert old == parse_profile(GOOD)
    assert (old.model("tiny-llama").token_bytes, old.model("tiny-llama").state_bytes) == (4096, 0)
    text = dump_profile(old)
    assert "kv_bytes_per_token" not in text and "token_bytes = 4096\nstate_bytes = 0\n" in text


def test_a_state_slot_round_trips_through_the_file_and_sizes_the_layout():
    p = parse_profile(edit("token_bytes = 4096\n", "token_bytes = 4096\nstate_bytes = 1048576\n"))
    m = p.model("tiny-llama")
    assert m.state_bytes == 1 << 20
    assert parse_profile(dump_profile(p)) == p
    layout = m.layout(16)
    assert (layout.page_bytes, layout.token_bytes, layout.state_bytes) == (16 * 4096, 4096, 1 << 20)
    assert layout.stateful
    assert not make_profile().model("m").layout(16).stateful


def test_save_then_load_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "new" / "dir" / "h200.toml"
    save_profile(make_profile(), path)
    assert load_profile(path) == make_profile()
    assert [f.name for f in path.parent.iterdir()] == ["h200.toml"]


def test_save_refuses_a_profile_it_could_not_load_back(tmp_path):
    bad = make_profile({SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0.1, -0.2, 0.0, 0.0, 0.0))})
    with pytest.raises(ProfileError, match=r"switch\.h2d_only\.phase_s\.open_weights = -0\.2"):
        save_profile(bad, tmp_path / "bad.toml")
    assert list(tmp_path.iterdir()) == []


def test_load_of_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(ProfileError, match=r"nope\.toml: no such profile.*talaria profile"):
        load_profile(tmp_path / "nope.toml")


def edit(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


@pytest.mark.parametrize("text, fragments", [
    (edit("schema = 1", "schema = 2"), ["profile.schema = 2", "re-run `talaria profile`"]),
    (edit("schema = 1\n", ""), ["profile.schema is missing", "re-run `talaria profile`"]),
    (edit("tp = 1", "tpp = 1"), ["profile.tpp is not a known key", "did you mean 'tp'?"]),
    (edit("[bandwidth]", "[bandwith]"), ["bandwith is not a known key", "'bandwidth'"]),
    (edit("per_token_s = 1e-5", "per_token_s = -1"),
     ["models.tiny-llama.prefill.per_token_s = -1 must be >= 0"]),
    (edit("d2h_bytes_per_s = 5.0e9", "d2h_bytes_per_s = 0"),
     ["bandwidth.d2h_bytes_per_s = 0 must be > 0"]),
    (edit("base_s = 0.002", 'base_s = "fast"'),
     ["models.tiny-llama.decode.base_s = 'fast' must be a finite number"]),
    (edit("base_s = 0.002", "base_s = nan"), ["models.tiny-llama.decode.base_s = nan"]),
    (edit("switch.h2d_only]", "switch.h2d_onyl]"),
     ["models.tiny-llama.switch.h2d_onyl is not a known switch path", "'h2d_only'",
      "full_d2d, partial, h2d_only"]),
    (edit(", 0.00001]", "]"),
     ["models.tiny-llama.switch.h2d_only.phase_s", "list of 5", ", ".join(PHASE_NAMES)]),
    (edit("[0.001,", "[-0.001,"),
     ["models.tiny-llama.switch.h2d_only.phase_s.save_teardown = -0.001 must be >= 0"]),
    (edit("token_bytes = 4096\n", ""),
     ["models.tiny-llama.token_bytes is missing"]),
    (edit("token_bytes = 4096\n", "token_bytes = 4096\nkv_bytes_per_token = 4096\n"),
     ["models.tiny-llama.kv_bytes_per_token is the old name of token_bytes", "keep one"]),
    (edit("token_bytes = 4096\n", "token_bytes = 4096\nstate_bytes = -1\n"),
     ["models.tiny-llama.state_bytes = -1 must be a whole number >= 0"]),
    (edit("weights_bytes = 1000000000", "weights_bytes = 1.5e9"),
     ["models.tiny-llama.weights_bytes = 1500000000.0 must be a whole number"]),
    (edit("[models.tiny-llama.decode]\nbase_s = 0.002\nper_seq_s = 1e-4\n", ""),
     ["models.tiny-llama.decode is missing"]),
    (edit('device = "cpu"', 'device = "tpu"'), ["profile.device = 'tpu' must be one of: cpu, cuda"]),
    (edit("tp = 1", "tp = 0"), ["profile.tp = 0 must be a whole number >= 1"]),
    (edit('created = "2026-11-30T12:00:00+00:00"', 'created = "last tuesday"'),
     ["profile.created = 'last tuesday' is not an ISO 8601 date-time"]),
    (edit('prefill = "measured at start-up"', "prefill = 3"),
     ["models.tiny-llama.sources.prefill = 3 must be a non-empty string"]),
    (edit("[bandwidth]", "[bandwidth\n"), ["not valid TOML"]),
])
def test_each_validation_error_names_the_file_and_the_key(text, fragments):
    with pytest.raises(ProfileError) as info:
        parse_profile(text, "profiles/x.toml")
    message = str(info.value)
    assert message.startswith("profiles/x.toml: ")
    for fragment in fragments:
        assert fragment in message


def test_an_unquoted_toml_datetime_is_accepted_as_iso_text():
    p = parse_profile(edit('"2026-11-30T12:00:00+00:00"', "2026-11-30T12:00:00+00:00"))
    assert p.created == "2026-11-30T12:00:00+00:00"


def test_curve_arithmetic_on_chosen_numbers():
    pre = PrefillCurve(base_s=0.5, per_token_s=0.25, per_token_context_s=0.125)
    # 0.5 + 0.25*4 + 0.125*4*(6 + 2) = 0.5 + 1 + 4
    assert pre.seconds(4, cached=6) == 5.5
    assert pre.seconds(0, cached=100) == 0.0
    dec = DecodeCurve(base_s=0.5, per_seq_s=0.25, per_context_token_s=0.0625)
    assert dec.seconds(batch=2, context=16) == 0.5 + 0.5 + 1.0
    assert dec.seconds(batch=0, context=16) == 0.0
    with pytest.raises(ValueError):
        pre.seconds(-1)
    p = make_profile()
    assert p.prefill_s("m", 4, 6) == p.model("m").prefill.seconds(4, 6)
    assert p.decode_s("m", 2, 16) == p.model("m").decode.seconds(2, 16)


def test_restore_and_save_divide_kv_bytes_by_the_right_bandwidth():
    p = make_profile()  # 131072 B/token, h2d 5e10 B/s, d2h 2.5e10 B/s
    assert p.restore_s("m", 1000) == pytest.approx(131_072_000 / 5e10, rel=1e-15)
    assert p.save_s("m", 1000) == pytest.approx(131_072_000 / 2.5e10, rel=1e-15)
    assert p.save_s("m", 1000) == pytest.approx(2 * p.restore_s("m", 1000), rel=1e-15)
    assert p.restore_s("m", 0) == 0.0
    measured = dataclasses.replace(p, bandwidth=dataclasses.replace(p.bandwidth, restore_bytes_per_s=1e10))
    assert measured.restore_s("m", 1000) == pytest.approx(131_072_000 / 1e10, rel=1e-15)  # the measured rate wins
    assert parse_profile(dump_profile(measured)) == measured


def test_restore_and_save_move_state_snapshots_beside_the_tokens():
    p = make_profile(state_bytes=3 << 20)  # 131072 B/token, a 3 MiB state slot
    assert p.restore_s("m", 1000, states=2) == (131_072_000 + 2 * (3 << 20)) / 5e10
    assert p.save_s("m", 1000, states=1) == (131_072_000 + (3 << 20)) / 2.5e10
    assert p.restore_s("m", 0, states=1) == (3 << 20) / 5e10  # a snapshot at the start of no pages
    assert p.restore_s("m", 1000) == 131_072_000 / 5e10  # no states: the tokens alone
    # a stateless model's price is the tokens' bytes over the rate, exactly, whatever `states` says
    assert make_profile().restore_s("m", 1000, states=3) == 131_072_000 / 5e10


def test_switch_s_uses_the_recorded_phases_and_estimates_missing_paths():
    recorded = SwitchCost(SwitchPath.H2D_ONLY, (0.25, 2.0, 0.125, 0.0625, 0.0625))
    p = make_profile({SwitchPath.H2D_ONLY: recorded})
    assert recorded.total_s == 2.5
    assert p.switch_s("m") == p.switch_s("m", 0.0) == 2.5
    # full_d2d: 8e9 B / 4e11 B/s = 0.02 s, plus the four non-weight phases of h2d_only (0.5 s)
    assert p.switch_s("m", 1.0) == pytest.approx(0.02 + 0.5, rel=1e-12)
    # partial at half coverage: half way between the two opens
    assert p.switch_s("m", 0.5) == pytest.approx((2.5 + 0.52) / 2, rel=1e-12)


def test_switch_s_with_nothing_recorded_is_the_weight_copy_alone():
    p = make_profile()
    assert p.switch_s("m", 0.0) == pytest.approx(8e9 / 5e10, rel=1e-12)
    assert p.switch_s("m", 1.0) == pytest.approx(8e9 / 4e11, rel=1e-12)
    assert p.switch_s("m", 0.5) == pytest.approx((0.16 + 0.02) / 2, rel=1e-12)


@pytest.mark.parametrize("coverage", [0.1, 0.25, 0.5, 0.9])
def test_a_partial_open_interpolates_the_weight_copy_by_what_is_left_to_copy_from_host(coverage):
    d2d = SwitchCost(SwitchPath.FULL_D2D, (0.01, 0.1, 0.02, 0.03, 0.04))
    partial = SwitchCost(SwitchPath.PARTIAL, (0.5, 7.0, 0.25, 0.125, 0.0625))  # measured at some coverage
    h2d = SwitchCost(SwitchPath.H2D_ONLY, (0.02, 2.1, 0.04, 0.06, 0.08))
    p = make_profile({SwitchPath.FULL_D2D: d2d, SwitchPath.PARTIAL: partial, SwitchPath.H2D_ONLY: h2d})
    phases = p.switch_phases("m", coverage)
    assert phases[1] == pytest.approx(0.1 + (2.1 - 0.1) * (1 - coverage), rel=1e-12)
    assert (phases[0], *phases[2:]) == (0.5, 0.25, 0.125, 0.0625)  # the rest as the partial open measured them
    assert p.switch_s("m", coverage) == pytest.approx(sum(phases), rel=1e-15)
    # without both ends recorded, the measured partial open is taken whole
    alone = make_profile({SwitchPath.PARTIAL: partial})
    assert alone.switch_phases("m", coverage) == partial.phase_s


def test_a_step_is_one_batched_prefill_one_decode_and_its_restores():
    p = make_profile()
    prefill, decode = p.model("m").prefill, p.model("m").decode
    chunks = (SeqChunk(1, (5,) * 30, 0, (0,), True), SeqChunk(2, (6,) * 20, 64, (1,), True),
              SeqChunk(3, (7,), 99, (2,), True, decode=True), SeqChunk(4, (8,), 9, (3,), True, decode=True))
    plan = StepPlan("m", chunks, MemoryOps(restores=((0, 5), (1, 6))))
    want_prefill = prefill.seconds(30, 0) + prefill.seconds(20, 64) - prefill.base_s  # the fixed cost once
    want_restore = 2 * 16 * p.model("m").token_bytes / p.bandwidth.restore  # 2 pages of 16 tokens
    assert p.step_parts(plan, 16) == pytest.approx((want_prefill, want_restore, decode.seconds(2, 100 + 10)))
    assert p.step_s(plan, 16) == pytest.approx(want_prefill + want_restore + decode.seconds(2, 110), rel=1e-15)
    assert p.step_s(StepPlan("m", ()), 16) == 0.0


def test_a_step_prices_its_state_restores_with_its_page_restores():
    p = make_profile(state_bytes=1 << 20)
    decode = (SeqChunk(3, (7,), 99, (2,), True, decode=True),)
    both = StepPlan("m", decode, MemoryOps(restores=((0, 5), (1, 6)), state_restores=((4, 1),)))
    assert p.step_parts(both, 16)[1] == (2 * 16 * 131_072 + (1 << 20)) / p.bandwidth.restore
    alone = StepPlan("m", decode, MemoryOps(state_restores=((4, 1), (5, 2))))  # two snapshots, no pages
    assert p.step_parts(alone, 16)[1] == 2 * (1 << 20) / p.bandwidth.restore
    assert p.step_s(alone, 16) == p.decode_s("m", 1, 100) + 2 * (1 << 20) / p.bandwidth.restore


def test_lookups_of_unknown_models_say_what_exists():
    p = make_profile()
    with pytest.raises(ProfileError, match=r"no model 'big'.*it has: m"):
        p.decode_s("big", 1)


def test_with_model_adds_or_replaces_and_leaves_the_original_alone():
    p = make_profile()
    other = ModelProfile("n", 1, 2, PrefillCurve(0, 0), DecodeCurve(0, 0), {})
    faster = ModelProfile("m", 1, 2, PrefillCurve(0, 0), DecodeCurve(1, 1), {})
    assert set(p.with_model(other).models) == {"m", "n"}
    assert p.with_model(faster).model("m") is faster
    assert p.model("m") is not faster and set(p.models) == {"m"}


def test_fits_recover_exact_coefficients():
    shapes = [(n, c) for n in (1, 16, 128, 512, 2048) for c in (0, 256, 4096)]
    want = PrefillCurve(3e-3, 4.5e-5, 2.5e-9)
    got = fit_prefill([(n, c, want.seconds(n, c)) for n, c in shapes])
    for g, w in zip((got.base_s, got.per_token_s, got.per_token_context_s),
                    (want.base_s, want.per_token_s, want.per_token_context_s)):
        assert g == pytest.approx(w, rel=1e-9)
    want_d = DecodeCurve(7e-3, 1.25e-4, 3e-8)
    got_d = fit_decode([(b, c, want_d.seconds(b, c)) for b in (1, 4, 32) for c in (10, 5000, 90000)])
    for g, w in zip((got_d.base_s, got_d.per_seq_s, got_d.per_context_token_s),
                    (want_d.base_s, want_d.per_seq_s, want_d.per_context_token_s)):
        assert g == pytest.approx(w, rel=1e-9)


def test_fit_prefill_keeps_the_base_cost_exact_at_long_context():
    # columns spanning 1 to ~6e10: unscaled least squares loses the 3 ms base to rounding
    shapes = [(n, c) for n in (1, 7, 512, 8192, 65536) for c in (0, 4096, 131072, 1_000_000)]
    want = PrefillCurve(3e-3, 4.5e-5, 2.5e-11)
    got = fit_prefill([(n, c, want.seconds(n, c)) for n, c in shapes])
    assert got.base_s == pytest.approx(want.base_s, rel=1e-9)
    assert got.per_token_s == pytest.approx(want.per_token_s, rel=1e-9)
    assert got.per_token_context_s == pytest.approx(want.per_token_context_s, rel=1e-9)


def test_a_zero_coefficient_is_recovered_as_zero_not_as_a_tiny_negative():
    want = DecodeCurve(0.0, 2e-4, 1e-7)
    got = fit_decode([(b, c, want.seconds(b, c)) for b in (1, 8, 64) for c in (0, 100, 7000)])
    assert got.base_s >= 0.0
    assert got.base_s == pytest.approx(0.0, abs=1e-15)
    assert got.per_seq_s == pytest.approx(2e-4, rel=1e-9)


def test_fit_decode_clamps_a_negative_ols_intercept_and_refits_the_slope():
    # convex in batch: a straight line through these points crosses zero above batch 0
    samples = [(1, 0, 1.0e-4), (2, 0, 2.0e-4), (4, 0, 5.0e-4), (8, 0, 1.2e-3)]
    b = np.array([s for _, _, s in samples])
    x = np.array([[1.0, n] for n, _, _ in samples])
    assert np.linalg.lstsq(x, b, rcond=None)[0][0] < 0  # the case this test is about
    got = fit_decode(samples)
    assert got.base_s == 0.0 and got.per_context_token_s == 0.0
    n = x[:, 1]
    assert got.per_seq_s == pytest.approx(float(n @ b / (n @ n)), rel=1e-12)  # through the origin


def test_fit_prefill_on_noisy_samples_never_goes_negative():
    rng = random.Random(7)
    ols_negative_intercepts = 0
    for _ in range(50):
        samples = [(n, 0, max(1e-6, 1e-5 * n + 1e-9 * n * n / 2 + rng.gauss(0, 2e-4)))
                   for n in (1, 2, 4, 8, 16, 32)]
        x = np.array([[1.0, n, n * n / 2] for n, _, _ in samples])
        ols = np.linalg.lstsq(x, np.array([s for _, _, s in samples]), rcond=None)[0]
        ols_negative_intercepts += ols[0] < 0
        got = fit_prefill(samples)
        assert min(got.base_s, got.per_token_s, got.per_token_context_s) >= 0.0
    assert ols_negative_intercepts >= 5  # the data really is the case OLS gets wrong


def test_fit_linear_rejects_mismatched_input():
    with pytest.raises(ValueError, match="one row per sample"):
        fit_linear([(1.0, 2.0)], [1.0, 2.0])
    with pytest.raises(ValueError):
        fit_decode([(0, 10, 0.1)])
