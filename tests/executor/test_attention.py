"""Paged decode attention against attention written the plain way, one sequence at a time.

The caches are poisoned with NaN everywhere no sequence has written, so a gather that reads a
position it should not, or a padded batch that lets a stale position into the sum, gives NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from talaria.contracts.step_plan import SeqChunk, StepPlan
from talaria.executor.attention import AttentionMeta, paged_attention

PAGE, NH, NKV, HD, LAYERS = 4, 4, 2, 8, 3


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (nh, hd) one query; k, v: (ctx, nkv, hd) -> (nh, hd)."""
    g = NH // NKV
    scores = torch.einsum("hd,thd->ht", q, k.repeat_interleave(g, dim=1)) / math.sqrt(HD)
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v.repeat_interleave(g, dim=1))


@pytest.mark.parametrize("contexts", [[1], [7], [5, 9, 12, 3], [8, 8], [16, 4, 9]])
def test_decode_batch_equals_each_sequence_alone(contexts):
    gen = torch.Generator().manual_seed(len(contexts))
    num_pages = 32
    # page-major like kv_cache.py: (pages + null, layers, K|V, page_size, nkv, hd), NaN where unwritten
    data = torch.full((num_pages + 1, LAYERS, 2, PAGE, NKV, HD), float("nan"), dtype=torch.float64)
    data[num_pages].zero_()
    layer = 1
    k_cache, v_cache = data[:, layer, 0], data[:, layer, 1]
    free = torch.randperm(num_pages, generator=gen).tolist()  # pages scattered, not in order
    chunks, keys, values = [], [], []
    for i, ctx in enumerate(contexts):
        pages = tuple(free.pop() for _ in range(-(-ctx // PAGE)))
        k = torch.randn(ctx, NKV, HD, generator=gen, dtype=torch.float64)
        v = torch.randn(ctx, NKV, HD, generator=gen, dtype=torch.float64)
        for pos in range(ctx):  # the context, this step's token included, written to its pages
            k_cache[pages[pos // PAGE], pos % PAGE] = k[pos]
            v_cache[pages[pos // PAGE], pos % PAGE] = v[pos]
        chunks.append(SeqChunk(i, (0,), ctx - 1, pages, sample=True, decode=True))
        keys.append(k)
        values.append(v)
    meta = AttentionMeta.build(StepPlan("m", tuple(chunks)), PAGE, num_pages, torch.device("cpu"))
    q = torch.randn(len(contexts), NH, HD, generator=gen, dtype=torch.float64)
    k_new = torch.stack([k[-1] for k in keys])
    v_new = torch.stack([v[-1] for v in values])
    before = data.clone()
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 1 / math.sqrt(HD))
    want = torch.stack([plain(q[b], keys[b], values[b]) for b in range(len(contexts))])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(data.isnan(), before.isnan())  # the cache itself is untouched


def test_decode_rows_among_a_prefill_chunk():
    """A step mixing a prefill chunk with decoding sequences puts each output on its own rows."""
    gen = torch.Generator().manual_seed(7)
    num_pages = 16
    data = torch.full((num_pages + 1, 1, 2, PAGE, NKV, HD), float("nan"), dtype=torch.float64)
    data[num_pages].zero_()
    k_cache, v_cache = data[:, 0, 0], data[:, 0, 1]
    prefill = torch.randn(6, 2, NKV, HD, generator=gen, dtype=torch.float64)  # 6 tokens, K and V
    dec = torch.randn(5, 2, NKV, HD, generator=gen, dtype=torch.float64)  # one sequence, ctx 5
    for pos in range(6):
        k_cache[pos // PAGE, pos % PAGE], v_cache[pos // PAGE, pos % PAGE] = prefill[pos, 0], prefill[pos, 1]
    for pos in range(5):
        p = (4, 5)[pos // PAGE]
        k_cache[p, pos % PAGE], v_cache[p, pos % PAGE] = dec[pos, 0], dec[pos, 1]
    plan = StepPlan("m", (SeqChunk(0, (0,) * 6, 0, (0, 1), sample=True), SeqChunk(1, (0,), 4, (4, 5), sample=True)))
    meta = AttentionMeta.build(plan, PAGE, num_pages, torch.device("cpu"))
    q = torch.randn(7, NH, HD, generator=gen, dtype=torch.float64)
    k = torch.cat((prefill[:, 0], dec[-1:, 0]))
    v = torch.cat((prefill[:, 1], dec[-1:, 1]))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 1 / math.sqrt(HD))
    g = NH // NKV
    causal = F.scaled_dot_product_attention(q[:6].transpose(0, 1), prefill[:, 0].repeat_interleave(g, 1).transpose(0, 1),
                                            prefill[:, 1].repeat_interleave(g, 1).transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out[:6], causal.transpose(0, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[6], plain(q[6], dec[:, 0], dec[:, 1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("prefix_pages", "tails"), [
    (3, [1, 2, 4, 3]),  # the shared part is read once: own tails of 1-4 tokens
    (2, [4, 1]),  # a tail that fills its page
    (4, [5, 9, 3]),  # own parts of two pages
    (1, [12, 7]),  # shared less than half the longest context: the padded batch reads everything
])
def test_sequences_sharing_a_prefix_equal_each_sequence_alone(prefix_pages, tails):
    """Sequences whose contexts start with the same pages (a prompt reused through the prefix cache)."""
    gen = torch.Generator().manual_seed(prefix_pages)
    num_pages = 32
    data = torch.full((num_pages + 1, LAYERS, 2, PAGE, NKV, HD), float("nan"), dtype=torch.float64)
    data[num_pages].zero_()
    k_cache, v_cache = data[:, 0, 0], data[:, 0, 1]
    free = torch.randperm(num_pages, generator=gen).tolist()
    shared = tuple(free.pop() for _ in range(prefix_pages))
    prefix_k = torch.randn(prefix_pages * PAGE, NKV, HD, generator=gen, dtype=torch.float64)
    prefix_v = torch.randn(prefix_pages * PAGE, NKV, HD, generator=gen, dtype=torch.float64)
    for pos in range(prefix_pages * PAGE):
        k_cache[shared[pos // PAGE], pos % PAGE], v_cache[shared[pos // PAGE], pos % PAGE] = prefix_k[pos], prefix_v[pos]
    chunks, keys, values = [], [], []
    for i, tail in enumerate(tails):
        own = tuple(free.pop() for _ in range(-(-tail // PAGE)))
        k = torch.cat((prefix_k, torch.randn(tail, NKV, HD, generator=gen, dtype=torch.float64)))
        v = torch.cat((prefix_v, torch.randn(tail, NKV, HD, generator=gen, dtype=torch.float64)))
        for j in range(tail):
            pos = prefix_pages * PAGE + j
            k_cache[own[j // PAGE], j % PAGE], v_cache[own[j // PAGE], j % PAGE] = k[pos], v[pos]
        chunks.append(SeqChunk(i, (0,), len(k) - 1, shared + own, sample=True, decode=True))
        keys.append(k)
        values.append(v)
    meta = AttentionMeta.build(StepPlan("m", tuple(chunks)), PAGE, num_pages, torch.device("cpu"))
    assert (meta.decode.shared is not None) == (2 * prefix_pages >= max(len(c.page_table) for c in chunks))
    q = torch.randn(len(tails), NH, HD, generator=gen, dtype=torch.float64)
    out = paged_attention(q, torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values]),
                          k_cache, v_cache, meta, 1 / math.sqrt(HD))
    want = torch.stack([plain(q[b], keys[b], values[b]) for b in range(len(tails))])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
