"""Multi-head latent attention (DeepSeek-V3, GLM-5) and DeepSeek sparse attention on one TP shard:
shapes, loading, forward.

MLA keys and values every head from one shared latent. Per token the layer computes a latent
c = RMSNorm(kv_a(h)[:kv_lora_rank]) and one rotated key k_r = RoPE(kv_a(h)[kv_lora_rank:]) that all
heads share, and caches exactly those (`latent`, kv_lora_rank + qk_rope_head_dim numbers a token a
layer: 576 for GLM-5 and DeepSeek-V3). `kv_b` expands c into each head's nope key and value:
k_h = [W_UK_h c, k_r], v_h = W_UV_h c. Queries go through a low-rank bottleneck (q_a, RMSNorm, q_b)
into each head's nope and rope parts.

**Long prompt chunks expand; decode and short chunks attend over the latent.** A decoding query
absorbs W_UK into itself, q_h' = [W_UK_h^T q_nope_h, q_rope_h], scores q_h' . [c_j, k_r_j] over the
cached latents as they are, sums the probabilities into a latent output, and applies W_UV_h once: per
step it reads the 576 numbers of each cached token rather than expanding every token into heads x
(nope + v) numbers (`bench/engine.py`'s MLA row). A prompt chunk does the same when it is short (an
agent's tool result after a prefix hit: `MLA.absorbs`, below ~400 queries at GLM-5's dims); a long
one expands its context's latents into keys and values (one matmul, then ordinary attention), which
then costs less than the absorbed form's wider scores. All equal the reference's expanded attention
up to summation order.

**Sparse attention (GLM-5's DSA).** An indexer scores every past token for each query: its own
queries from the query latent, one key a token (`index_k`, cached on the layers that run it),
score = sum_h w_h ReLU(q_h . k) / sqrt(d), in float32 as the reference computes it; each query then
attends only to its `index_topk` best tokens (inside its causal window). A layer marked "shared"
reuses the selection of the layer before. Contexts no longer than `index_topk` select everything,
so the scoring is skipped there (the keys are still cached).

TP: heads split across ranks (q_b rows, kv_b rows, o_proj columns); the latent, the a-projections
and the indexer are replicated, so every rank caches the whole latent and selects the same tokens
(docs/models.md has the bytes). The a-projections of a layer (q_a, kv_a, the indexer's key and head
weights) are one fused matrix: one matmul where the checkpoint has four.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from talaria.executor.attention import AttentionMeta, DecodeBatch, _gather
from talaria.executor.kv_cache import KVCache
from talaria.executor.norms import layer_norm, rms_norm
from talaria.executor.parallel import Shard
from talaria.executor.matmul import linear
from talaria.executor.quant import WeightReader, dense
from talaria.executor.rope import apply_rope, apply_rope_interleaved

Shape = tuple[int, ...]
LATENT_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm and the indexer's key norm: the modules' default eps
SCORE_BYTES = 1 << 26  # float32 indexer scores materialised at once (queries are blocked to fit)


def mla_shapes(shard: Shard, layer: int) -> list[Shape]:
    """Arena tensors of one MLA layer's attention on this shard, in `load_mla` order."""
    a, h, heads = shard.arch, shard.arch.hidden_size, shard.heads
    lq, idx = a.q_lora_rank, a.has_indexer(layer)
    rows = lq + a.latent_dim + (a.index_head_dim + a.index_n_heads if idx else 0)
    shapes = [(rows, h), (heads * a.head_dim, lq or h), (a.kv_lora_rank,),
              (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), (h, heads * a.v_head_dim)]
    shapes += [(lq,)] if lq else []
    shapes += [(a.index_n_heads * a.index_head_dim, lq), (2, a.index_head_dim)] if idx else []
    return shapes


def load_mla(reader: WeightReader, prefix: str, shard: Shard, layer: int) -> dict:
    """One MLA layer's attention weights into arena views from the reader (quantized ones packed), in
    `mla_shapes` order; `prefix` is "model.layers.{i}.self_attn.". Returns LayerWeights' MLA fields."""
    a, ckpt, alloc = shard.arch, reader.ckpt, reader.alloc
    lq, idx, h = a.q_lora_rank, a.has_indexer(layer), a.hidden_size
    fused, q_b, kv_norm, kv_b, o_proj, *rest = mla_shapes(shard, layer)
    parts = ([("q_a_proj.weight", lq)] if lq else []) + [("kv_a_proj_with_mqa.weight", a.latent_dim)]
    parts += [("indexer.wk.weight", a.index_head_dim), ("indexer.weights_proj.weight", a.index_n_heads)] if idx else []
    out = {"mla_a": reader.stacked([(prefix + name, 0, n) for name, n in parts], (h,), prefix + "a_proj")}
    qk, nope_v, v = a.head_dim, a.qk_nope_head_dim + a.v_head_dim, a.v_head_dim
    h0, h1 = shard.head_range
    out["mla_q_b"] = reader.linear(prefix + ("q_b_proj.weight" if lq else "q_proj.weight"), 0, h0 * qk, h1 * qk,
                                   shape=q_b, what=prefix + "q_b_proj")
    out["mla_kv_norm"] = alloc(kv_norm, prefix + "kv_a_layernorm")
    ckpt.read_into(out["mla_kv_norm"], prefix + "kv_a_layernorm.weight")
    out["mla_kv_b"] = reader.linear(prefix + "kv_b_proj.weight", 0, h0 * nope_v, h1 * nope_v, shape=kv_b,
                                    what=prefix + "kv_b_proj")
    out["o_proj"] = reader.linear(prefix + "o_proj.weight", 1, h0 * v, h1 * v, shape=o_proj, what=prefix + "o_proj")
    if lq:
        out["mla_q_norm"] = alloc(rest.pop(0), prefix + "q_a_layernorm")
        ckpt.read_into(out["mla_q_norm"], prefix + "q_a_layernorm.weight")
    if idx:
        out["idx_q"] = reader.linear(prefix + "indexer.wq_b.weight", shape=rest[0], what=prefix + "indexer.wq_b")
        out["idx_k_norm"] = alloc(rest[1], prefix + "indexer.k_norm")  # weight, then bias
        ckpt.read_into(out["idx_k_norm"][0], prefix + "indexer.k_norm.weight")
        ckpt.read_into(out["idx_k_norm"][1], prefix + "indexer.k_norm.bias")
    return out


@dataclass(slots=True)
class Selection:
    """The tokens each query of a step attends to, from the last layer that ran the indexer: per
    prefill chunk a (q_len, ctx) bool mask, per decode batch a (B, L) one; None = every token."""

    prefills: list[torch.Tensor | None] = field(default_factory=list)
    decodes: list[torch.Tensor | None] = field(default_factory=list)


class MLA:
    """One model's MLA layers on one shard: the constants their forward needs."""

    def __init__(self, shard: Shard, scale: float) -> None:
        a = shard.arch
        self.a, self.heads, self.scale = a, shard.heads, scale
        self.rope = apply_rope_interleaved if a.rope_interleave else apply_rope

    def forward(self, h: torch.Tensor, lw, layer: int, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
                kv: KVCache, selection: Selection | None) -> tuple[torch.Tensor, Selection | None]:
        """h: (T, H) normed hidden states -> ((T, H) this rank's partial sum, the step's selection for
        the next layer). The layer's latents (and index keys) are written to its pages first."""
        a, T, hl = self.a, h.shape[0], self.heads
        lq, ld, r, nope = a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim
        indexed = a.has_indexer(layer)
        split = ([lq] if lq else []) + [ld, r] + ([a.index_head_dim, a.index_n_heads] if indexed else [])
        parts = list(linear(h, lw.mla_a).split(split, dim=-1))
        q_latent = rms_norm(parts.pop(0), lw.mla_q_norm, LATENT_NORM_EPS) if lq else h
        c = rms_norm(parts.pop(0), lw.mla_kv_norm, LATENT_NORM_EPS)  # (T, ld)
        k_rope = self.rope(parts.pop(0).unsqueeze(1), cos, sin).squeeze(1)  # (T, r)
        q = linear(q_latent, lw.mla_q_b).view(T, hl, nope + r)
        q = torch.cat((q[..., :nope], self.rope(q[..., nope:], cos, sin)), dim=-1)  # (T, hl, nope + r)
        latent = torch.cat((c, k_rope), dim=-1)  # (T, ld + r): what the cache holds
        cache = kv.view("latent", layer)  # (pages + 1, page_size, ld + r)
        cache.index_put_((meta.write_pages, meta.write_offsets), latent)
        if indexed:
            selection = self._select(q_latent, parts, lw, layer, cos, sin, meta, kv)
        kv_b = dense(lw.mla_kv_b, h.dtype).view(hl, nope + a.v_head_dim, ld)  # dequantized once for the layer
        out = torch.empty(T, hl, a.v_head_dim, dtype=h.dtype, device=h.device)
        for i, d in enumerate(meta.decodes):
            sel = selection.decodes[i] if selection is not None else None
            o = self._decode(q if d.rows is None else q.index_select(0, d.rows), cache, d, kv_b, sel)
            if d.rows is None:
                out = o
            else:
                out.index_copy_(0, d.rows, o)
        for i, p in enumerate(meta.prefills):
            ctx = latent[p.row:p.row + p.q_len] if p.whole else _gather(cache, p.pages, 1, p.ctx)[0]
            sel = selection.prefills[i] if selection is not None else None
            chunk = self._latent_prefill if self.absorbs(p.q_len) else self._prefill
            out[p.row:p.row + p.q_len] = chunk(q[p.row:p.row + p.q_len], ctx, p.mask(), kv_b, sel)
        return linear(out.reshape(T, -1), lw.o_proj), selection

    def _prefill(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, kv_b: torch.Tensor,
                 sel: torch.Tensor | None) -> torch.Tensor:
        """Expanded attention of a chunk's queries q (n, hl, nope + r) over its context's latents
        (ctx_len, ld + r) -> (n, hl, v)."""
        a, hl = self.a, self.heads
        ld, nope = a.kv_lora_rank, a.qk_nope_head_dim
        kv = linear(ctx[:, :ld], kv_b.flatten(0, 1)).view(-1, hl, nope + a.v_head_dim)  # (L, hl, nope + v)
        k = torch.cat((kv[..., :nope], ctx[:, None, ld:].expand(-1, hl, -1)), dim=-1).transpose(0, 1)  # (hl, L, qk)
        v = kv[..., nope:].transpose(0, 1)  # (hl, L, v)
        if sel is not None:
            mask = sel if mask is None else mask & sel
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)  # (hl, n, v)
        return o.transpose(0, 1)

    def absorbs(self, n: int) -> bool:
        """Whether a chunk of `n` queries attends over the latent directly (else it expands its
        context): expanding costs every context token ld (nope + v) multiply-adds a head, whatever n;
        the latent-direct form costs each query-token pair 2 ld + r - qk - v more a head than expanded
        attention does. So latent-direct wins below n = ld (nope + v) / (2 ld + r - qk - v) queries, at
        any context length: ~400 at GLM-5's dims (an agent's tool result after a prefix hit)."""
        a = self.a
        extra = 2 * a.kv_lora_rank + a.qk_rope_head_dim - a.head_dim - a.v_head_dim
        return extra <= 0 or n * extra < a.kv_lora_rank * (a.qk_nope_head_dim + a.v_head_dim)

    def _latent_prefill(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, kv_b: torch.Tensor,
                        sel: torch.Tensor | None) -> torch.Tensor:
        """Latent-direct attention of a chunk's queries q (n, hl, nope + r) over its context's latents
        (L, ld + r) -> (n, hl, v), as a decode step's: `mask` (n, L) its causal window (None: the chunk
        is the whole context)."""
        a = self.a
        ld, nope = a.kv_lora_rank, a.qk_nope_head_dim
        n, length = q.shape[0], ctx.shape[0]
        keep = mask if mask is not None else torch.ones(n, length, dtype=torch.bool, device=q.device).tril_(length - n)
        keep = keep if sel is None else keep & sel
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), kv_b[:, :nope])  # (hl, n, ld): W_UK absorbed
        q = torch.cat((q_latent, q[..., nope:].transpose(0, 1)), dim=-1)  # (hl, n, ld + r)
        scores = torch.matmul(q, ctx.t()) * self.scale  # (hl, n, L)
        scores.masked_fill_(~keep, float("-inf"))
        low = torch.float32 if q.element_size() < 4 else None  # half precision: softmax in float32
        o_latent = torch.matmul(scores.softmax(dim=-1, dtype=low).to(q.dtype), ctx[:, :ld])  # (hl, n, ld)
        return torch.bmm(o_latent, kv_b[:, nope:].transpose(1, 2)).transpose(0, 1)  # W_UV: (n, hl, v)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, d: DecodeBatch, kv_b: torch.Tensor,
                sel: torch.Tensor | None) -> torch.Tensor:
        """Latent-direct attention of B decoding queries q (B, hl, nope + r) -> (B, hl, v). A prefix
        the batch shares (attention.py: an agent's system prompt and tools) is read once for all of
        it: its scores and its share of the output are one matmul each over the batch's queries."""
        a = self.a
        ld, nope = a.kv_lora_rank, a.qk_nope_head_dim
        B, hl = q.shape[:2]
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), kv_b[:, :nope])  # (hl, B, ld): W_UK absorbed
        q = torch.cat((q_latent.transpose(0, 1), q[..., nope:]), dim=-1)  # (B, hl, ld + r)
        own = _gather(cache, d.pages, d.batch, d.ctx, d.stale)  # (B, L_own, ld + r): each sequence's pages
        scores = torch.bmm(q, own.transpose(1, 2))  # (B, hl, L_own)
        valid, shared = d.valid, None
        if d.shared is not None:
            shared = cache.flatten(1).index_select(0, d.shared).view(-1, cache.shape[-1])  # (S, ld + r), once
            scores = torch.cat(((q.reshape(B * hl, -1) @ shared.t()).view(B, hl, -1), scores), dim=-1)
            valid = None if valid is None else torch.cat((valid.new_ones(B, shared.shape[0]), valid), dim=1)
        scores *= self.scale
        keep = valid if sel is None else (sel if valid is None else valid & sel)  # over [shared, own]
        if keep is not None:
            scores.masked_fill_(~keep[:, None, :], float("-inf"))
        low = torch.float32 if q.element_size() < 4 else None  # half precision: softmax in float32
        p = scores.softmax(dim=-1, dtype=low).to(q.dtype)
        n = 0 if shared is None else shared.shape[0]
        o_latent = torch.bmm(p[..., n:], own[..., :ld])  # (B, hl, ld)
        if shared is not None:
            o_latent += (p[..., :n].reshape(B * hl, n) @ shared[:, :ld]).view(B, hl, ld)
        return torch.bmm(o_latent.transpose(0, 1), kv_b[:, nope:].transpose(1, 2)).transpose(0, 1)  # W_UV: (B, hl, v)

    def _select(self, q_latent: torch.Tensor, parts: list[torch.Tensor], lw, layer: int, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMeta, kv: KVCache) -> Selection:
        """Run the layer's indexer: write its keys, and choose each query's tokens where its context is
        longer than index_topk."""
        a, r = self.a, self.a.qk_rope_head_dim
        T = q_latent.shape[0]
        k_in, head_w = parts
        k = layer_norm(k_in, lw.idx_k_norm[0], lw.idx_k_norm[1], LATENT_NORM_EPS).unsqueeze(1)  # (T, 1, d)
        k = torch.cat((self.rope_index(k[..., :r], cos, sin), k[..., r:]), dim=-1).squeeze(1)  # (T, d)
        cache = kv.view("index_k", layer)
        cache.index_put_((meta.write_pages, meta.write_offsets), k)
        topk = a.index_topk
        if all(d.longest <= topk for d in meta.decodes) and all(p.ctx <= topk for p in meta.prefills):
            return Selection([None] * len(meta.prefills), [None] * len(meta.decodes))
        q = linear(q_latent, lw.idx_q).view(T, a.index_n_heads, a.index_head_dim)
        q = torch.cat((self.rope_index(q[..., :r], cos, sin), q[..., r:]), dim=-1)  # (T, ih, d)
        w = head_w.float() * a.index_n_heads ** -0.5  # (T, ih)
        out = Selection()
        for d in meta.decodes:
            rows = slice(None) if d.rows is None else d.rows
            keys, valid = _decode_context(cache, d)  # (B, L, d)
            out.decodes.append(self._top(q[rows].unsqueeze(1), w[rows].unsqueeze(1), keys,
                                         None if valid is None else valid[:, None, :]).squeeze(1)
                               if d.longest > topk else None)
        for p in meta.prefills:
            if p.ctx <= topk:
                out.prefills.append(None)
                continue
            keys = k[p.row:p.row + p.q_len] if p.whole else _gather(cache, p.pages, 1, p.ctx)[0]
            causal = torch.ones(p.q_len, p.ctx, dtype=torch.bool, device=k.device).tril_() if p.whole else p.mask()
            block = max(1, SCORE_BYTES // (4 * a.index_n_heads * p.ctx))  # queries per block of scores
            rows = range(p.row, p.row + p.q_len, block)
            out.prefills.append(torch.cat([
                self._top(q[i:min(i + block, p.row + p.q_len)].unsqueeze(0),
                          w[i:min(i + block, p.row + p.q_len)].unsqueeze(0), keys.unsqueeze(0),
                          causal[i - p.row:i - p.row + block].unsqueeze(0))[0] for i in rows]))
        return out

    def _top(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Index scores of queries q (B, n, ih, d) with head weights w (B, n, ih) over keys (B, L, d),
        `keep` (B, n or 1, L) the positions they may choose -> (B, n, L) bool: each query's top-k of them."""
        scale = self.a.index_head_dim ** -0.5
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(1, 2).unsqueeze(1)) * scale)  # (B, n, ih, L)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # (B, n, L)
        if keep is not None:
            index = index.masked_fill(~keep, float("-inf"))
        top = index.topk(min(self.a.index_topk, index.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
        return chosen if keep is None else chosen & keep  # a query with fewer than k choices takes all it may

    def rope_index(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The indexer's RoPE: GLM-5 rotates interleaved pairs there too."""
        return apply_rope_interleaved(x, cos, sin)


def _decode_context(cache: torch.Tensor, d: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode batch's per-token cache rows, (B, L, dims), with positions past a context in its
    last page zeroed; and which positions are valid (None: all). A shared prefix is gathered once
    and put before each sequence's own pages."""
    own = _gather(cache, d.pages, d.batch, d.ctx, d.stale)  # (B, L_own, dims)
    if d.shared is None:
        return own, d.valid
    shared = cache.flatten(1).index_select(0, d.shared).view(1, -1, cache.shape[-1])  # (1, S, dims)
    ctx = torch.cat((shared.expand(d.batch, -1, -1), own), dim=1)
    if d.valid is None:
        return ctx, None
    return ctx, torch.cat((d.valid.new_ones(d.batch, shared.shape[1]), d.valid), dim=1)
