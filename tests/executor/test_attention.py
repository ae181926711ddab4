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
from talaria.executor import cpu_kernels
from talaria.executor.attention import AttentionMeta, paged_attention

PAGE, NH, NKV, HD, LAYERS = 4, 4, 2, 8, 3
kernel = cpu_kernels.paged_decode


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int = HD) -> torch.Tensor:
    """q: (nh, hd) one query; k, v: (ctx, nkv, hd) -> (nh, hd)."""
    g = NH // NKV
    scores = torch.einsum("hd,thd->ht", q, k.repeat_interleave(g, dim=1)) / math.sqrt(hd)
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



@pytest.mark.skipif(cpu_kernels.library() is None, reason="no AVX-512 or no compiler: the kernel cannot run here")
@pytest.mark.parametrize("with_prefill", [False, True])
def test_in_float32_the_cpu_kernel_attends_the_pages_in_place(monkeypatch, with_prefill):
    """float32, heads 16 wide: decode batches run through cpu_kernels.paged_decode (each batch once,
    among a prefill chunk too) and equal the plain attention within float32 rounding; NaN wherever
    no sequence wrote, the null page included, so a read past a context shows."""
    hd, contexts, gen = 16, [5, 9, 12, 3, 1], torch.Generator().manual_seed(3)
    data = torch.full((33, LAYERS, 2, PAGE, NKV, hd), float("nan"))
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]
    free = torch.randperm(32, generator=gen).tolist()
    chunks, keys, values, row = [], [], [], 0
    if with_prefill:  # a 6-token prompt chunk first: the decodes are rows 6.. of the step
        pages = tuple(free.pop() for _ in range(2))
        chunks.append(SeqChunk(99, tuple(range(6)), 0, pages, sample=True))
        row = 6
    for i, ctx in enumerate(contexts):
        pages = tuple(free.pop() for _ in range(-(-ctx // PAGE)))
        k, v = torch.randn(ctx, NKV, hd, generator=gen), torch.randn(ctx, NKV, hd, generator=gen)
        for pos in range(ctx):
            k_cache[pages[pos // PAGE], pos % PAGE], v_cache[pages[pos // PAGE], pos % PAGE] = k[pos], v[pos]
        chunks.append(SeqChunk(i, (0,), ctx - 1, pages, sample=True, decode=True))
        keys.append(k)
        values.append(v)
    meta = AttentionMeta.build(StepPlan("m", tuple(chunks)), PAGE, 32, torch.device("cpu"))
    q = torch.randn(row + len(contexts), NH, hd, generator=gen)
    k_step = torch.randn(row + len(contexts), NKV, hd, generator=gen)
    calls = []
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    out = paged_attention(q, k_step, k_step, k_cache, v_cache, meta, hd ** -0.5)[row:]
    want = torch.stack([plain(q[row + b].double(), keys[b].double(), values[b].double(), hd)
                        for b in range(len(contexts))])
    assert calls == [len(contexts)]
    assert (out.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_later_prompt_chunk_attends_its_prefix_then_itself_causally(dtype):
    """On the CPU in float32 and bfloat16 a chunk after a cached prefix attends to the prefix without a
    mask and to itself causally, the halves joined by their log-sum-exps: that equals causal
    attention over the whole context, GQA included. The chunk's K/V come from the step, the prefix's
    from its pages; NaN wherever nothing was written."""
    gen, start, n = torch.Generator().manual_seed(5), 10, 7  # 10 tokens cached, a 7-token chunk
    data = torch.full((9, 1, 2, PAGE, NKV, HD), float("nan"), dtype=dtype)
    data[8].zero_()  # the null page
    k_cache, v_cache = data[:, 0, 0], data[:, 0, 1]
    pages = (3, 7, 1, 5, 2)
    k, v = torch.randn(start + n, NKV, HD, generator=gen), torch.randn(start + n, NKV, HD, generator=gen)
    for pos in range(start + n):  # the prefix, and this step's K/V written before attention runs
        k_cache[pages[pos // PAGE], pos % PAGE], v_cache[pages[pos // PAGE], pos % PAGE] = k[pos], v[pos]
    meta = AttentionMeta.build(StepPlan("m", (SeqChunk(0, tuple(range(n)), start, pages, sample=True),)), PAGE, 8,
                               torch.device("cpu"))
    q = torch.randn(n, NH, HD, generator=gen)
    out = paged_attention(q.to(dtype), k[start:].to(dtype), v[start:].to(dtype), k_cache, v_cache, meta,
                          1 / math.sqrt(HD))
    want = torch.stack([plain(q[i].double(), k[:start + i + 1].double(), v[:start + i + 1].double())
                        for i in range(n)])
    assert out.dtype == dtype and not out.isnan().any()
    assert (out.double() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 3e-2)

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
    assert len(meta.decodes) == 1  # one batch: shared or padded, never groups
    assert (meta.decodes[0].shared is not None) == (2 * prefix_pages >= max(len(c.page_table) for c in chunks))
    q = torch.randn(len(tails), NH, HD, generator=gen, dtype=torch.float64)
    out = paged_attention(q, torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values]),
                          k_cache, v_cache, meta, 1 / math.sqrt(HD))
    want = torch.stack([plain(q[b], keys[b], values[b]) for b in range(len(tails))])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


class Contexts:
    """A NaN-poisoned layer cache, and contexts written into scattered pages of it; contexts extending
    one prefix hold its pages, as a prompt reused through the prefix cache does."""

    def __init__(self, gen: torch.Generator, num_pages: int = 96) -> None:
        self.gen, self.null = gen, num_pages
        self.data = torch.full((num_pages + 1, 2, 2, PAGE, NKV, HD), float("nan"), dtype=torch.float64)
        self.data[num_pages].zero_()
        self.k_cache, self.v_cache = self.data[:, 1, 0], self.data[:, 1, 1]
        self.free = torch.randperm(num_pages, generator=gen).tolist()

    def extend(self, prefix: tuple | None, tokens: int) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
        """(pages, k, v) of a context: `prefix`'s (whole pages) then `tokens` of its own on fresh pages."""
        none = torch.empty(0, NKV, HD, dtype=torch.float64)
        pages, k, v = prefix or ((), none, none)
        own = tuple(self.free.pop() for _ in range(-(-tokens // PAGE)))
        k = torch.cat((k, torch.randn(tokens, NKV, HD, generator=self.gen, dtype=torch.float64)))
        v = torch.cat((v, torch.randn(tokens, NKV, HD, generator=self.gen, dtype=torch.float64)))
        for j in range(tokens):
            pos = len(pages) * PAGE + j
            self.k_cache[own[j // PAGE], j % PAGE], self.v_cache[own[j // PAGE], j % PAGE] = k[pos], v[pos]
        return pages + own, k, v


def run_step(c: Contexts, seqs: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int]]):
    """Step over `seqs` (pages, k, v, tokens this step: 1 decodes, more prefill the context's last ones)
    -> (the step's metadata, paged output, per-sequence plain attention of every row)."""
    chunks = tuple(SeqChunk(i, (0,) * n, len(k) - n, pages, sample=True, decode=n == 1)
                   for i, (pages, k, _, n) in enumerate(seqs))
    meta = AttentionMeta.build(StepPlan("m", chunks), PAGE, c.null, torch.device("cpu"))
    rows = sum(n for *_, n in seqs)
    q = torch.randn(rows, NH, HD, generator=c.gen, dtype=torch.float64)
    k_new = torch.cat([k[len(k) - n:] for _, k, _, n in seqs])
    v_new = torch.cat([v[len(v) - n:] for _, _, v, n in seqs])
    before = c.data.clone()
    out = paged_attention(q, k_new, v_new, c.k_cache, c.v_cache, meta, 1 / math.sqrt(HD))
    assert torch.equal(c.data.isnan(), before.isnan())  # the cache itself is untouched
    want, row = [], 0
    for _, k, v, n in seqs:  # each row attends to its context up to itself
        want += [plain(q[row + j], k[:len(k) - n + j + 1], v[:len(v) - n + j + 1]) for j in range(n)]
        row += n
    return meta, out, torch.stack(want)


def batches(meta: AttentionMeta) -> list[tuple[list[int] | None, int]]:
    """How the step's decoding sequences were batched: (their rows, pages read once) per batch."""
    return [(None if d.rows is None else d.rows.tolist(), 0 if d.shared is None else len(d.shared))
            for d in meta.decodes]


def test_two_groups_sharing_different_prefixes_and_a_loner():
    """Two agent kinds (different system prompts) decode in one batch with a sequence of its own:
    each group reads its prefix once, the loner runs alone, every output lands on its row."""
    c = Contexts(torch.Generator().manual_seed(11))
    a, b = c.extend(None, 3 * PAGE), c.extend(None, 2 * PAGE)
    seqs = [(*c.extend(a, 1), 1), (*c.extend(b, 3), 1), (*c.extend(None, 9), 1), (*c.extend(a, 2), 1),
            (*c.extend(b, 5), 1), (*c.extend(a, 4), 1)]
    meta, out, want = run_step(c, seqs)
    assert batches(meta) == [([0, 3, 5], 3), ([1, 4], 2), ([2], 0)]
    assert meta.decodes[2].ctx == 9  # the loner gathers exactly its context
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_three_groups_of_different_sizes_and_own_tails():
    """Groups of 4, 2 and 3 sequences, own parts of one to three pages; one group's tails fill their
    pages exactly (nothing to mask), the others' do not."""
    c = Contexts(torch.Generator().manual_seed(12))
    a, b, d = c.extend(None, 4 * PAGE), c.extend(None, 2 * PAGE), c.extend(None, 5 * PAGE)
    specs = [(a, 1), (d, 2), (b, 4), (a, 5), (d, 7), (a, 9), (b, 4), (d, 1), (a, 3)]
    seqs = [(*c.extend(p, t), 1) for p, t in specs]
    meta, out, want = run_step(c, seqs)
    assert batches(meta) == [([0, 3, 5, 8], 4), ([1, 4, 7], 5), ([2, 6], 2)]
    assert meta.decodes[2].valid is None and meta.decodes[0].valid is not None
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_a_group_whose_prefix_is_too_short_runs_padded_beside_one_that_shares():
    """A group sharing one page of 3-4 page contexts is not worth a shared part: its sequences join
    the padded batch with the loner, while the group sharing three pages reads them once."""
    c = Contexts(torch.Generator().manual_seed(13))
    short, long = c.extend(None, PAGE), c.extend(None, 3 * PAGE)
    seqs = [(*c.extend(short, 12), 1), (*c.extend(long, 2), 1), (*c.extend(short, 7), 1), (*c.extend(long, 3), 1),
            (*c.extend(None, 6), 1), (*c.extend(long, 1), 1)]
    meta, out, want = run_step(c, seqs)
    assert batches(meta) == [([1, 3, 5], 3), ([0, 2, 4], 0)]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_groups_among_prefill_chunks():
    """Decoding groups mixed with a fresh prompt and a chunk after a cached prefix: each batch's rows
    are its sequences' rows in the step, between the prefill rows."""
    c = Contexts(torch.Generator().manual_seed(14))
    a, b = c.extend(None, 3 * PAGE), c.extend(None, 4 * PAGE)
    seqs = [(*c.extend(a, 2), 1), (*c.extend(None, 5), 5), (*c.extend(b, 1), 1), (*c.extend(a, 3), 1),
            (*c.extend(None, 6), 1), (*c.extend(a, 7), 3), (*c.extend(b, 6), 1), (*c.extend(a, 4), 1)]
    meta, out, want = run_step(c, seqs)
    assert [(p.row, p.q_len, p.whole, p.mask() is None) for p in meta.prefills] == [(1, 5, True, True),
                                                                                    (9, 3, False, False)]
    chunk = meta.prefills[1]  # 3 queries after a cached prefix: each sees the prefix and itself back
    prefix = chunk.ctx - chunk.q_len
    assert chunk.mask().tolist() == [[j <= prefix + i for j in range(chunk.ctx)] for i in range(chunk.q_len)]
    assert batches(meta) == [([0, 7, 13], 3), ([6, 12], 4), ([8], 0)]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
