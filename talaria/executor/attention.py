"""Paged attention on torch SDPA: per-step metadata and the per-layer kernel call.

KV lives in pages (see kv_cache.py). A step's metadata says where each new token's K/V goes
(page, offset) and which pages each sequence attends to. Decoding sequences (one query each) run as
one padded SDPA call; prefill chunks run one call each with a causal mask offset by the cached
prefix. A lone decoding sequence gathers exactly its context. In a padded batch, positions past a
sequence's context (the tail of its last page, padding pages) are masked and also zeroed: a masked
position still multiplies its V by a zero weight, and a page's unwritten tail may hold anything —
another model's bytes after a switch, a staged chunk, NaN in poison mode — while 0 * NaN is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from talaria.contracts.step_plan import StepPlan


@dataclass(slots=True)
class PrefillSeq:
    row: int  # first row of this chunk in the flattened step
    q_len: int
    ctx: int  # context length, chunk included
    pages: torch.Tensor  # (ceil(ctx / page_size),) pages of the context
    mask: torch.Tensor | None  # (q_len, ctx) bool, None when the chunk is the whole context (causal)


@dataclass(slots=True)
class DecodeBatch:
    rows: torch.Tensor | None  # (B,) rows of decoding sequences; None when they are all the rows
    pages: torch.Tensor  # (B * max_pages,) context pages, padded with the null page
    valid: torch.Tensor | None  # (B, max_pages * page_size) bool, None when no position is invalid
    batch: int
    ctx: int | None  # a lone sequence's context length: gather exactly that, nothing to mask


@dataclass(slots=True)
class AttentionMeta:
    write_pages: torch.Tensor  # (T,) page of each new token's K/V
    write_offsets: torch.Tensor  # (T,) offset inside that page
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]

    @classmethod
    def build(cls, plan: StepPlan, page_size: int, null_page: int, device: torch.device) -> AttentionMeta:
        w_pages: list[int] = []
        w_offs: list[int] = []
        dec_rows, dec_pages, dec_ctx, prefills = [], [], [], []
        row = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            for pos in range(c.start_pos, c.context_len):
                w_pages.append(c.page_table[pos // page_size])
                w_offs.append(pos % page_size)
            pages = c.page_table[: -(-c.context_len // page_size)]
            if n == 1:
                dec_rows.append(row)
                dec_pages.append(pages)
                dec_ctx.append(c.context_len)
            else:
                mask = None
                if c.start_pos:
                    q_pos = torch.arange(c.start_pos, c.context_len)[:, None]
                    mask = (torch.arange(c.context_len)[None, :] <= q_pos).to(device)  # (q_len, ctx)
                prefills.append(PrefillSeq(row, n, c.context_len, torch.tensor(pages, device=device), mask))
            row += n
        decode = None
        if dec_rows:
            width = max(len(p) for p in dec_pages)
            flat = [p for pages in dec_pages for p in (*pages, *[null_page] * (width - len(pages)))]
            valid = None
            lone = dec_ctx[0] if len(dec_ctx) == 1 else None
            if lone is None and any(ctx != width * page_size for ctx in dec_ctx):
                valid = (torch.arange(width * page_size)[None, :] < torch.tensor(dec_ctx)[:, None]).to(device)
            decode = DecodeBatch(
                rows=None if not prefills else torch.tensor(dec_rows, device=device),
                pages=torch.tensor(flat, device=device), valid=valid, batch=len(dec_rows), ctx=lone)
        return cls(torch.tensor(w_pages, device=device), torch.tensor(w_offs, device=device), decode, prefills)


def _gather(cache: torch.Tensor, pages: torch.Tensor, batch: int, valid: torch.Tensor | None,
            ctx: int | None = None) -> torch.Tensor:
    """(pages, page_size, nkv, hd) cache -> (batch, nkv, len, hd) view of one gathered copy (SDPA
    takes the strides), invalid positions zeroed."""
    kv = cache.index_select(0, pages)  # (batch * n, page_size, nkv, hd), a fresh copy
    kv = kv.view(batch, -1, *kv.shape[2:])  # (batch, n * page_size, nkv, hd)
    if ctx is not None:
        kv = kv[:, :ctx]
    elif valid is not None:
        kv.masked_fill_(~valid[:, :, None, None], 0.0)  # in the copy: the cache is untouched
    return kv.transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMeta, scale: float) -> torch.Tensor:
    """q: (T, nh, hd); k, v: (T, nkv, hd), this step's; caches: (pages, page_size, nkv, hd) with this
    step's K/V written. -> (T, nh, hd)"""
    k_new, v_new = k, v
    gqa = q.shape[1] != k_cache.shape[2]
    d = meta.decode
    if d is not None and d.rows is None:  # pure decode: the rows are the batch
        k, v = _gather(k_cache, d.pages, d.batch, d.valid, d.ctx), _gather(v_cache, d.pages, d.batch, d.valid, d.ctx)
        mask = d.valid[:, None, None, :] if d.valid is not None else None
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa).squeeze(2)
    out = torch.empty_like(q)
    if d is not None:
        k, v = _gather(k_cache, d.pages, d.batch, d.valid, d.ctx), _gather(v_cache, d.pages, d.batch, d.valid, d.ctx)
        mask = d.valid[:, None, None, :] if d.valid is not None else None
        o = F.scaled_dot_product_attention(q.index_select(0, d.rows).unsqueeze(2), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=gqa)  # (B, nh, 1, hd)
        out.index_copy_(0, d.rows, o.squeeze(2))
    for p in meta.prefills:
        qp = q[p.row:p.row + p.q_len].transpose(0, 1).unsqueeze(0)  # (1, nh, q_len, hd)
        if p.mask is None:  # the chunk is the whole context: its own K/V, no gather
            k = k_new[p.row:p.row + p.q_len].transpose(0, 1).unsqueeze(0).contiguous()  # (1, nkv, ctx, hd)
            v = v_new[p.row:p.row + p.q_len].transpose(0, 1).unsqueeze(0).contiguous()
        else:
            k = _gather(k_cache, p.pages, 1, None, p.ctx)  # (1, nkv, ctx, hd)
            v = _gather(v_cache, p.pages, 1, None, p.ctx)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[p.row:p.row + p.q_len] = o.squeeze(0).transpose(0, 1)
    return out
