"""Paged attention on torch SDPA: per-step metadata and the per-layer kernel call.

The KV pool is a flat array of token slots (page * page_size + offset). A step's metadata says where
each new token's K/V goes and which slots each sequence attends to. Decoding sequences (one query
each) run as one padded SDPA call; prefill chunks run one call each with a causal mask offset by
the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from talaria.node.step_plan import StepPlan


@dataclass(slots=True)
class PrefillSeq:
    row: int  # first row of this chunk in the flattened step
    q_len: int
    slots: torch.Tensor  # (ctx,) KV slots of the whole context, chunk included
    mask: torch.Tensor | None  # (q_len, ctx) bool, None when the chunk is the whole context (causal)


@dataclass(slots=True)
class AttentionMeta:
    write_slots: torch.Tensor  # (T,) where each new token's K/V goes
    decode_rows: torch.Tensor | None  # (B,) rows of decoding sequences
    decode_slots: torch.Tensor | None  # (B * max_ctx,) context slots, padded, flattened
    decode_mask: torch.Tensor | None  # (B, 1, 1, max_ctx) bool, None when no padding
    prefills: list[PrefillSeq]

    @classmethod
    def build(cls, plan: StepPlan, page_size: int, device: torch.device) -> AttentionMeta:
        write, dec_rows, dec_ctx, prefills = [], [], [], []
        offsets = torch.arange(page_size)
        row = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            pages = torch.tensor(c.page_table[: -(-c.context_len // page_size)], dtype=torch.long)
            slots = (pages[:, None] * page_size + offsets).flatten()[: c.context_len]
            write.append(slots[c.start_pos:])
            if n == 1:
                dec_rows.append(row)
                dec_ctx.append(slots)
            else:
                mask = None
                if c.start_pos:
                    q_pos = torch.arange(c.start_pos, c.context_len)[:, None]
                    mask = torch.arange(c.context_len)[None, :] <= q_pos  # (q_len, ctx)
                prefills.append(PrefillSeq(row, n, slots.to(device), mask))
            row += n
        dec_slots = dec_mask = None
        if dec_ctx:
            lens = [len(s) for s in dec_ctx]
            longest = max(lens)
            dec_slots = torch.zeros(len(dec_ctx), longest, dtype=torch.long)
            for i, s in enumerate(dec_ctx):
                dec_slots[i, : len(s)] = s
            if min(lens) != longest:
                dec_mask = (torch.arange(longest)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        return cls(
            write_slots=torch.cat(write).to(device),
            decode_rows=torch.tensor(dec_rows, dtype=torch.long, device=device) if dec_rows else None,
            decode_slots=dec_slots.flatten().to(device) if dec_slots is not None else None,
            decode_mask=dec_mask.to(device) if dec_mask is not None else None,
            prefills=prefills,
        )


def _gather(cache: torch.Tensor, slots: torch.Tensor, batch: int) -> torch.Tensor:
    """(slots, nkv, hd) cache -> (batch, nkv, ctx, hd) contiguous, for SDPA's fast path."""
    kv = cache.index_select(0, slots)  # index_select: far cheaper than advanced indexing on CPU
    return kv.view(batch, -1, *kv.shape[1:]).transpose(1, 2).contiguous()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, scale: float) -> torch.Tensor:
    """q: (T, nh, hd); caches: (slots, nkv, hd) with this step's K/V already written. -> (T, nh, hd)"""
    if meta.decode_rows is not None and not meta.prefills:  # pure decode: rows are the batch
        b = q.shape[0]
        k, v = _gather(k_cache, meta.decode_slots, b), _gather(v_cache, meta.decode_slots, b)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.squeeze(2)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        b = meta.decode_rows.shape[0]
        k, v = _gather(k_cache, meta.decode_slots, b), _gather(v_cache, meta.decode_slots, b)
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # (B, nh, 1, hd)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out.index_copy_(0, meta.decode_rows, o.squeeze(2))
    for p in meta.prefills:
        qp = q[p.row:p.row + p.q_len].transpose(0, 1).unsqueeze(0)  # (1, nh, q_len, hd)
        k, v = _gather(k_cache, p.slots, 1), _gather(v_cache, p.slots, 1)  # (1, nkv, ctx, hd)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=qp.shape[1] != k.shape[1])
        out[p.row:p.row + p.q_len] = o.squeeze(0).transpose(0, 1)
    return out
