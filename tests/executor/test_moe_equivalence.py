"""Equality rule for Mixture-of-Experts models (float64): tiny random Qwen3-MoE and Qwen2-MoE models
built with transformers' own config classes and saved with `save_pretrained` give Talaria the same
greedy tokens as transformers' float64 `generate`, at TP 1, 2 and 4, through forced switches and
host KV restores in a cold instance that also serves a dense model.

The four MoE models between them cover both families, `norm_topk_prob` true and false, dense layers
by `mlp_only_layers` and by `decoder_sparse_step`, and both checkpoint layouts save_pretrained
writes (one tensor per expert by default; transformers 5's fused `experts.gate_up_proj` with
`save_original_format=False`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from safetensors import safe_open

from talaria.config.schema import ModelConfig, Pool
from talaria.contracts.call import InstanceCall
from talaria.models.errors import ModelSourceError
from talaria.models.source import ModelFiles, prepare_model
from talaria.models.synthetic import byte_tokenizer
from tests.executor.group_turns import group_turns
from tests.executor.hand_profile import write_profile
from tests.executor.reference import ReferenceLlama
from tests.tiny_models import GREEDY, engine, instance, run, tiny_files, tokens

TINY = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 256}  # tp 4: 2 KV heads replicated, widths divide
MOE = {  # name -> (family, config overrides, fused checkpoint layout)
    "q3-norm-sparse-step": ("qwen3_moe", {"head_dim": 16, "norm_topk_prob": True, "decoder_sparse_step": 2}, False),
    "q3-plain-mlp-only": ("qwen3_moe", {"head_dim": 16, "norm_topk_prob": False, "mlp_only_layers": [0]}, True),
    "q2-plain-mlp-only": ("qwen2_moe", {"shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                                        "mlp_only_layers": [1]}, False),
    "q2-norm-fused": ("qwen2_moe", {"shared_expert_intermediate_size": 48, "norm_topk_prob": True}, True),
}
SUBSTRATE = {"pool": Pool.COLD, "page_size": 4, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0, "arena_bytes": 16 << 20}
DENSE = "tiny-llama"  # the dense model the cold instances also serve


def _prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {name: [rng.randrange(256) for _ in range(rng.randrange(18, 40))] for name in (DENSE, *MOE)}


# every test uses these prompts, so each reference generation runs once per module
PROMPTS = _prompts(1)  # each model's session, turn 1
EXTRA = {name: [(3 * i + len(name)) % 256 for i in range(9)] for name in PROMPTS}  # a second call beside it
TAIL = [4, 5]  # the user's next words after the model's answer: turn 2 = PROMPTS + answer + TAIL


def build(family: str, overrides: dict, norm_topk_prob: bool | None = None):
    """A transformers MoE model in float64 with the eager experts (the only float64 path), weights
    drawn like Talaria's synthetic models so that greedy tokens are well separated."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    config_class = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig}[family]
    kw = TINY | overrides | ({} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob})
    model = AutoModelForCausalLM.from_config(config_class(**kw), dtype=torch.float64,
                                             experts_implementation="eager")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:  # projections, router, experts (E, out, in): 1 / sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return model.eval()


@dataclass
class Reference:
    """A model's files and its greedy tokens by the reference (memoised per prompt)."""

    files: ModelFiles
    generate: Callable[[list[int]], list[int]]
    memo: dict = field(default_factory=dict)

    def greedy(self, prompt: list[int]) -> list[int]:
        if tuple(prompt) not in self.memo:
            self.memo[tuple(prompt)] = self.generate(list(prompt))
        return self.memo[tuple(prompt)]


def hf_greedy(model) -> Callable[[list[int]], list[int]]:
    def generate(prompt: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()
    return generate


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 tensors: a second torch thread only waits for a core the machine shares (the
    engine groups' workers run one thread each too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def refs(tmp_path_factory, model_cache) -> dict[str, Reference]:
    """Every model by name: the four MoE models (transformers float64 references) and the dense one
    (the plain reference forward)."""
    root = tmp_path_factory.mktemp("moe")
    dense = tiny_files("llama", model_cache)
    reference = ReferenceLlama(dense.directory)
    models = {DENSE: Reference(dense, lambda prompt: reference.greedy(prompt, GREEDY.max_tokens))}
    for name, (family, overrides, fused) in MOE.items():
        hf = build(family, overrides)
        directory = root / name
        hf.save_pretrained(directory, save_original_format=not fused)
        tok, tok_config = byte_tokenizer(TINY["vocab_size"])
        tok.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
        files = prepare_model(ModelConfig(name=name, source=str(directory), dtype="float64"), None)
        models[name] = Reference(files, hf_greedy(hf))
    return models


@pytest.fixture(scope="module")
def profile_for(tmp_path_factory):
    """A hand-written cost profile per (files, tp): no start-up calibration (tests/executor/hand_profile.py)."""
    def write(files: list[ModelFiles], tp: int) -> str:
        return write_profile(tmp_path_factory.mktemp("profile"), files, tp, SUBSTRATE["arena_bytes"])
    return write


def continuation(refs, name: str) -> list[int]:
    return PROMPTS[name] + refs[name].greedy(PROMPTS[name]) + TAIL


def test_both_checkpoint_layouts_are_what_save_pretrained_wrote(refs):
    for name, (_, _, fused) in MOE.items():
        files = refs[name].files
        with safe_open(files.directory / "model.safetensors", framework="pt") as f:
            keys = set(f.keys())
        layer = next(i for i in range(TINY["num_hidden_layers"]) if files.arch.is_moe_layer(i))
        p = f"model.layers.{layer}.mlp.experts."
        assert (p + "gate_up_proj" in keys) == fused and (p + "0.gate_proj.weight" in keys) == (not fused), name


def test_the_cases_are_discriminating(refs):
    """Dense layers where the config says, and each model's tokens change with norm_topk_prob: a
    wrong normalisation or a wrong dense/MoE layer choice would fail the equality tests below."""
    layers = {name: [refs[name].files.arch.is_moe_layer(i) for i in range(TINY["num_hidden_layers"])] for name in MOE}
    assert layers == {"q3-norm-sparse-step": [False, True, False], "q3-plain-mlp-only": [False, True, True],
                      "q2-plain-mlp-only": [True, False, True], "q2-norm-fused": [True, True, True]}
    for name, (family, overrides, _) in MOE.items():
        flipped = Reference(refs[name].files, hf_greedy(build(family, overrides, not overrides["norm_topk_prob"])))
        assert flipped.greedy(PROMPTS[name]) != refs[name].greedy(PROMPTS[name]), name


def test_tp1_batched_prompts_equal_transformers(refs, profile_for):
    profile = profile_for([refs[name].files for name in MOE], 1)
    for name in MOE:  # one hot instance per model: prompts of different lengths in one batch
        prompts = [PROMPTS[name], EXTRA[name], continuation(refs, name), [17]]
        core = engine([refs[name].files], page_size=4, host_kv_bytes=1 << 20, profile=profile)
        outs = run(core, [InstanceCall(str(i), name, tuple(p), GREEDY) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert tokens(outs[str(i)]) == refs[name].greedy(p), f"{name} prompt {i}"


def test_tp1_switches_and_host_restores_keep_tokens(refs, profile_for):
    files = [r.files for r in refs.values()]
    core = engine(files, profile=profile_for(files, 1), **SUBSTRATE)
    for f in files:  # turn 1 of each session on its own model: a switch before each
        core.scheduler.force_switch(f.name)
        out = run(core, [InstanceCall(f"{f.name}-1", f.name, tuple(PROMPTS[f.name]), GREEDY)])[f"{f.name}-1"]
        assert tokens(out) == refs[f.name].greedy(PROMPTS[f.name]), f.name
    for f in files:  # each session returns while another model holds the arena: restored from host
        cont = continuation(refs, f.name)
        core.scheduler.force_switch(f.name)
        out = run(core, [InstanceCall(f"{f.name}-2", f.name, tuple(cont), GREEDY)])[f"{f.name}-2"]
        committed = len(PROMPTS[f.name]) + GREEDY.max_tokens - 1  # the last sampled token has no KV
        assert out[-1].usage.restored_tokens == committed // 4 * 4, f"{f.name}: not restored from host"
        assert tokens(out) == refs[f.name].greedy(cont), f.name
    assert core.stats().switches == 2 * len(files) - 1


# tp 4 on two cores is slow: there, one model per family (one per checkpoint layout) and the dense one
TP_GROUPS = {2: (DENSE, *MOE), 4: (DENSE, "q3-norm-sparse-step", "q2-norm-fused")}


@pytest.mark.parametrize("tp", sorted(TP_GROUPS))
def test_tp_group_switches_and_restores_equal_transformers(refs, profile_for, tp):
    """An engine group over gloo: MoE models and a dense one time-share the group; turn 1 of each
    session in a batch with a second call, turn 2 after every other model had the arena."""
    files = [refs[name].files for name in TP_GROUPS[tp]]
    config = instance(files, tp=tp, profile=profile_for(files, tp), **SUBSTRATE)
    results = group_turns(config, files, PROMPTS, EXTRA, TAIL)
    for (name, turn), (prompt, toks, usage) in results.items():
        assert toks == refs[name].greedy(prompt), f"{name} turn {turn} tp={tp}"
        if turn == 2:
            assert usage.restored_tokens == (len(prompt) - len(TAIL) - 1) // 4 * 4, f"{name}: not restored from host"


def test_unsupported_model_types_are_refused_with_the_reason(tmp_path):
    v32 = "DeepSeek-V3.2's sparse attention indexer"
    for model_type, words in (("deepseek_v32", v32), ("qwen3_5", "dense Qwen3.5 is not served yet"),
                              ("gemma3", "Talaria serves llama")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 4}))
        with pytest.raises(ModelSourceError, match=f"model_type '{model_type}' is not supported.*{re.escape(words)}"):
            prepare_model(ModelConfig(name="x", source=str(tmp_path)), None)
