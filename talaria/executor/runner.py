"""Runs one StepPlan's forward on one rank: inputs from the plan, logits for the sampled rows."""

from __future__ import annotations

import torch

from talaria.contracts.step_plan import StepPlan
from talaria.executor.attention import AttentionMeta
from talaria.executor.deltanet import segments
from talaria.executor.kv_cache import KVCache
from talaria.executor.llama import LlamaModel


def run_step(model: LlamaModel, kv: KVCache, plan: StepPlan) -> torch.Tensor | None:
    """Logits (S, V) on rank 0 for the chunks that sample, in plan order; None elsewhere."""
    ids, pos, sample_rows = [], [], []
    for c in plan.chunks:
        ids.extend(c.token_ids)
        pos.extend(range(c.start_pos, c.context_len))
        if c.sample:
            sample_rows.append(len(ids) - 1)
    dev = kv.pages.device
    meta = AttentionMeta.build(plan, kv.page_size, kv.null_page, dev)
    segs = segments(plan.chunks) if kv.states is not None else None  # the state slots of a hybrid model
    hidden = model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, kv, segs)
    if not sample_rows:
        return None
    return model.logits(hidden[torch.tensor(sample_rows, device=dev)])
