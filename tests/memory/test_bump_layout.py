"""BumpLayout on a 64 KiB toy arena: exact region offsets, the null page, stable bases, LayoutError."""

from __future__ import annotations

import pytest

from talaria.contracts.kv_layout import sized_layout
from talaria.memory.bump_layout import (
    Bases,
    BumpLayout,
    LayoutError,
    Region,
    align_down,
    align_up,
)

ARENA = 65536
RUNTIME = 4096
PAGE = 2048


@pytest.fixture
def layout() -> BumpLayout:
    lay = BumpLayout(ARENA, RUNTIME)
    lay.register("small", 10_000, sized_layout(1, PAGE))  # weights [0, 10240)
    lay.register("large", 40_000, sized_layout(1, PAGE))  # weights [0, 40192)
    lay.register("same", 10_200, sized_layout(1, PAGE))  # aligns to the same 10240 as "small"
    lay.register("huge", 52_000, sized_layout(1, PAGE))  # weights [0, 52224): 1024 bytes short of 5 pages
    return lay


# ---- Region ------------------------------------------------------------------------------------


def test_region_size_overlaps_contains():
    r = Region(100, 200)
    assert r.size == 100
    assert r.overlaps(Region(199, 300)) and r.overlaps(Region(0, 101)) and r.overlaps(Region(120, 130))
    assert not r.overlaps(Region(200, 300))  # half-open: touching is not overlapping
    assert not r.overlaps(Region(0, 100))
    assert not r.overlaps(Region(150, 150))  # an empty range overlaps nothing
    assert r.contains(Region(100, 200)) and r.contains(Region(150, 150))
    assert not r.contains(Region(99, 150)) and not r.contains(Region(150, 201))


def test_region_rejects_reversed_or_negative_bounds():
    with pytest.raises(ValueError):
        Region(10, 5)
    with pytest.raises(ValueError):
        Region(-1, 5)


def test_align_helpers():
    assert align_up(10_000, 256) == 10240 and align_up(10240, 256) == 10240 and align_up(0, 256) == 0
    assert align_down(49392, 256) == 49152 and align_down(256, 256) == 256


# ---- plans -------------------------------------------------------------------------------------


def test_small_model_plan(layout):
    p = layout.plan("small")
    assert p.model == "small"
    assert p.weights == Region(0, 10240)
    assert p.kv == Region(10240, 61440)
    assert p.runtime == Region(61440, 65536)
    assert (p.page_bytes, p.num_pages) == (PAGE, 24)  # 50 KiB of KV = 25 pages, one of them null
    assert p.page_region(0) == Region(10240, 12288)
    assert p.page_region(23) == Region(57344, 59392)
    assert p.null_page == 24 and p.page_region(p.null_page) == Region(59392, 61440)
    assert p.page_pool == Region(10240, 59392)


def test_large_model_plan_leaves_alignment_slack_after_the_null_page(layout):
    p = layout.plan("large")
    assert p.weights == Region(0, 40192)
    assert p.kv == Region(40192, 61440)
    assert p.runtime == Region(61440, 65536)
    assert p.num_pages == 9
    assert p.page_region(p.null_page) == Region(58624, 60672)  # 768 unused bytes up to kv.end
    assert p.kv.size >= (p.num_pages + 1) * p.page_bytes


def test_page_region_out_of_range(layout):
    p = layout.plan("large")
    with pytest.raises(IndexError):
        p.page_region(10)
    with pytest.raises(IndexError):
        p.page_region(-1)


def test_pages_overlapping_never_includes_the_null_page(layout):
    p = layout.plan("small")
    assert p.pages_overlapping(Region(10240, 12288)) == range(1)
    assert p.pages_overlapping(Region(12287, 12289)) == range(2)  # straddles the page 0/1 boundary
    assert p.pages_overlapping(Region(49152, 50960)) == range(19, 20)
    assert p.pages_overlapping(Region(0, 10240)) == range(0)  # weights only
    assert p.pages_overlapping(Region(0, 65536)) == range(24)  # whole arena: pages, no null page
    assert p.pages_overlapping(Region(59392, 61440)) == range(0)  # the null page itself
    assert p.pages_overlapping(Region(20000, 20000)) == range(0)


def test_plans_are_deterministic(layout):
    assert layout.plan("small") == layout.plan("small")
    other = BumpLayout(ARENA, RUNTIME)
    other.register("small", 10_000, sized_layout(1, PAGE))
    assert other.plan("small") == layout.plan("small")


def test_unaligned_runtime_is_rounded_down_to_an_aligned_start():
    lay = BumpLayout(ARENA, 4000)
    lay.register("m", 10_000, sized_layout(1, PAGE))
    assert lay.plan("m").runtime == Region(61440, 65536)  # 65536 - 4000 = 61536 rounds down to 61440


# ---- errors ------------------------------------------------------------------------------------


def test_model_too_large_raises_layout_error_with_missing_bytes(layout):
    assert layout.min_arena_bytes("huge") == 52224 + 5 * PAGE + RUNTIME == 66560
    with pytest.raises(LayoutError) as e:
        layout.plan("huge")
    msg = str(e.value)
    assert "'huge'" in msg and "1024 bytes short" in msg and "raise arena_bytes" in msg and "66560" in msg
    assert isinstance(e.value, MemoryError)


def test_exactly_min_arena_bytes_fits_with_min_pages(layout):
    lay = BumpLayout(layout.min_arena_bytes("huge"), RUNTIME)
    lay.register("huge", 52_000, sized_layout(1, PAGE))
    assert lay.plan("huge").num_pages == BumpLayout.MIN_PAGES
    smaller = BumpLayout(layout.min_arena_bytes("huge") - 256, RUNTIME)
    smaller.register("huge", 52_000, sized_layout(1, PAGE))
    with pytest.raises(LayoutError, match="256 bytes short"):
        smaller.plan("huge")


def test_register_conflicts_and_unknown_models(layout):
    layout.register("small", 10_000, sized_layout(1, PAGE))  # same sizes: no-op
    with pytest.raises(ValueError, match="already registered"):
        layout.register("small", 10_001, sized_layout(1, PAGE))
    with pytest.raises(ValueError):
        layout.register("zero", 0, sized_layout(1, PAGE))
    with pytest.raises(KeyError, match="not registered"):
        layout.plan("nope")


# ---- activation and bases ----------------------------------------------------------------------


def test_activate_records_the_plan_and_failures_change_nothing(layout):
    assert layout.active is None and layout.active_plan is None
    plan = layout.activate("small")
    assert layout.active == "small" and layout.active_plan == plan
    with pytest.raises(LayoutError):
        layout.activate("huge")
    assert layout.active == "small"
    layout.activate("large")
    assert layout.active == "large"


def test_weights_and_runtime_bases_never_move_kv_base_moves_with_weight_size(layout):
    small, large, same = layout.bases("small"), layout.bases("large"), layout.bases("same")
    assert small == Bases(weights=0, kv=10240, runtime=61440)
    assert large == Bases(weights=0, kv=40192, runtime=61440)
    assert same == small  # equal aligned weight size: the pointer check passes, the KV shell is reused
