"""Equality rule for MLA models (float64): tiny random DeepSeek-V3 and GLM-5 (glm_moe_dsa) models built
with transformers' own config classes (multi-head latent attention, GLM's sparse-attention indexer
with a layer sharing its selection, sigmoid group-limited routing with shared experts, a dense first
layer) and saved with `save_pretrained` give Talaria the same greedy tokens as transformers' float64
`generate`, at TP 1, 2 and 4: batched prompts longer than GLM's `index_topk` (so the selection
matters), prompts prefilled in page-sized chunks, prefix hits, forced switches and host restores.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from talaria.config.schema import ModelConfig, Pool
from talaria.contracts.arch import ModelArch
from talaria.contracts.call import InstanceCall
from talaria.contracts.kv_layout import kv_layout
from talaria.executor.moe import route
from talaria.executor.parallel import Shard
from talaria.executor.weights import weight_shapes
from talaria.models.source import ModelFiles, prepare_model
from tests.executor.group_turns import group_turns
from tests.executor.hand_profile import write_profile
from tests.executor.test_moe_equivalence import Reference, hf_greedy
from tests.mla_models import INDEXER, TINY, build, save
from tests.tiny_models import GREEDY, engine, instance, run, tokens

PS = 4
MLA = {"dsv3": "deepseek_v3", "glm": "glm_moe_dsa"}  # name -> family
SUBSTRATE = {"pool": Pool.COLD, "page_size": PS, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0, "arena_bytes": 16 << 20}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_models() -> dict:
    return {name: build(family) for name, family in MLA.items()}


@pytest.fixture(scope="module")
def refs(tmp_path_factory, hf_models) -> dict[str, Reference]:
    root = tmp_path_factory.mktemp("mla")
    out = {}
    for name, hf in hf_models.items():
        save(hf, root / name)
        out[name] = Reference(prepare_model(ModelConfig(name=name, source=str(root / name), dtype="float64"), None),
                              hf_greedy(hf))
    return out


@pytest.fixture(scope="module")
def profile_for(tmp_path_factory):
    """A hand-written cost profile per (files, tp): no start-up calibration (tests/executor/hand_profile.py)."""
    def write(files: list[ModelFiles], tp: int) -> str:
        return write_profile(tmp_path_factory.mktemp("profile"), files, tp, SUBSTRATE["arena_bytes"])
    return write


rng = random.Random(5)
PROMPTS = {name: [rng.randrange(256) for _ in range(n)] for name, n in (("dsv3", 29), ("glm", 23))}
LONG = [rng.randrange(256) for _ in range(40)]  # three index_topk's worth
TAIL = [4, 5]


def test_the_layout_caches_the_latent_and_the_index_keys(refs):
    arch = refs["glm"].files.arch
    assert (arch.kv_lora_rank, arch.latent_dim, arch.head_dim, arch.indexer_types) == (16, 24, 16, ("full", "shared", "full"))
    assert arch.mlp_only_layers == (0,) and (arch.n_group, arch.topk_group) == (4, 2)
    for tp in (1, 4):  # the latent is whole on every rank, whatever tp
        layout = kv_layout(arch, tp, PS, "float64")
        assert layout.tensor("latent").shape == (24,) and layout.tensor("latent").layers == (0, 1, 2)
        assert layout.tensor("index_k").layers == (0, 2)  # the shared layer keeps no keys of its own
        assert layout.page_bytes == PS * 8 * (3 * 24 + 2 * 16)
    assert kv_layout(refs["dsv3"].files.arch, 2, PS, "float64").token_bytes == 3 * 24 * 8


def test_parameters_per_rank_are_what_the_ranks_load(hf_models, refs):
    """`param_count` (preflight's arena sizing) counts the checkpoint at tp 1 (the MTP-free model, the
    routers' selection bias included) and, at tp 2 and 4, exactly the tensors a rank allocates."""
    for name, hf in hf_models.items():
        arch = refs[name].files.arch
        stored = sum(p.numel() for p in hf.parameters()) + sum(b.numel() for n, b in hf.named_buffers()
                                                               if n.endswith("e_score_correction_bias"))
        assert arch.param_count() == stored, name
        for tp in (2, 4):
            shapes = weight_shapes(Shard(0, tp, arch))
            assert arch.param_count(tp) == sum(math.prod(s) for s in shapes), (name, tp)


def test_group_limited_routing_keeps_to_the_best_groups(hf_models):
    """The router picks experts only inside the `topk_group` groups whose two best biased scores sum
    highest, and weighs them by their raw sigmoid scores: transformers' router, token for token."""
    hf = hf_models["dsv3"]
    gate = hf.model.layers[1].mlp.gate
    h = torch.randn(64, TINY["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    experts, weights = route(h, gate.weight.double(), arch, gate.e_score_correction_bias.double())
    _, ref_w, ref_e = gate(h)
    order, ref_order = experts.sort(dim=-1), ref_e.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(weights.gather(1, order.indices), ref_w.double().gather(1, ref_order.indices), atol=0)
    groups = experts // (arch.num_experts // arch.n_group)  # every token's experts come from <= topk_group groups
    assert max(len(set(g.tolist())) for g in groups) <= arch.topk_group
    ungrouped = ModelArch.from_hf_config(hf.config.to_dict() | {"n_group": 1, "topk_group": 1})
    assert not torch.equal(route(h, gate.weight.double(), ungrouped, gate.e_score_correction_bias.double())[0]
                           .sort(dim=-1).values, order.values), "the groups changed no token's experts"


def test_the_cases_are_discriminating(refs):
    """An indexer that selected every token (a dense GLM) changes the tokens: the prompts are long
    enough that the selection matters."""
    dense = build("glm_moe_dsa", index_topk=256)
    prompt = LONG
    assert Reference(refs["glm"].files, hf_greedy(dense)).greedy(prompt) != refs["glm"].greedy(prompt)


def test_tp1_batched_chunked_and_resumed_prompts_equal_transformers(refs, profile_for):
    for name, ref in refs.items():
        profile = profile_for([ref.files], 1)
        prompts = [PROMPTS[name], LONG, [17], LONG[:30]]
        for budget in (512, 12):  # everything in one step; page-sized chunks over cached context
            core = engine([ref.files], page_size=PS, host_kv_bytes=1 << 20, profile=profile, max_batch_tokens=budget)
            outs = run(core, [InstanceCall(str(i), name, tuple(p), GREEDY) for i, p in enumerate(prompts)])
            for i, p in enumerate(prompts):
                assert tokens(outs[str(i)]) == ref.greedy(p), f"{name} prompt {i} budget {budget}"
        first = tokens(outs["0"])
        cont = PROMPTS[name] + first + TAIL
        out = run(core, [InstanceCall("c", name, tuple(cont), GREEDY)])["c"]
        assert out[-1].usage.cached_tokens > 0 and tokens(out) == ref.greedy(cont), name


def test_tp1_switches_and_host_restores_keep_tokens(refs, profile_for):
    files = [r.files for r in refs.values()]
    core = engine(files, profile=profile_for(files, 1), **SUBSTRATE)
    answers = {}
    for f in files:
        core.scheduler.force_switch(f.name)
        answers[f.name] = tokens(run(core, [InstanceCall(f"{f.name}-1", f.name, tuple(PROMPTS[f.name]), GREEDY)])
                                 [f"{f.name}-1"])
        assert answers[f.name] == refs[f.name].greedy(PROMPTS[f.name]), f.name
    for f in files:  # each session returns after the other model had the arena: its latents from host
        cont = PROMPTS[f.name] + answers[f.name] + TAIL
        core.scheduler.force_switch(f.name)
        out = run(core, [InstanceCall(f"{f.name}-2", f.name, tuple(cont), GREEDY)])[f"{f.name}-2"]
        assert out[-1].usage.restored_tokens > 0, f"{f.name}: not restored from host"
        assert tokens(out) == refs[f.name].greedy(cont), f.name


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_group_switches_and_restores_equal_transformers(refs, profile_for, tp):
    """Worker processes over gloo: heads split by rank, the latent and the indexer on every rank; both
    models time-share the group, the second turn restored from host."""
    files = [r.files for r in refs.values()]
    config = instance(files, tp=tp, profile=profile_for(files, tp), **SUBSTRATE)
    results = group_turns(config, files, PROMPTS, {name: LONG for name in refs}, TAIL)
    for (name, turn), (prompt, toks, usage) in results.items():
        assert toks == refs[name].greedy(prompt), f"{name} turn {turn} tp={tp}"
    assert INDEXER["index_topk"] < len(LONG)


def test_yarn_rope_and_its_softmax_scale_equal_transformers(tmp_path, profile_for):
    """DeepSeek-V3 ships YaRN: frequencies blended by the ramp, cos/sin and the softmax scale by mscale."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.7, "mscale_all_dim": 1.0}
    hf = build("deepseek_v3", rope_parameters=yarn)
    save(hf, tmp_path / "yarn")
    files = prepare_model(ModelConfig(name="yarn", source=str(tmp_path / "yarn"), dtype="float64"), None)
    assert files.arch.rope_scaling["rope_type"] == "yarn"
    core = engine([files], page_size=PS, host_kv_bytes=0, profile=profile_for([files], 1))
    ref = Reference(files, hf_greedy(hf))
    outs = run(core, [InstanceCall(str(i), "yarn", tuple(p), GREEDY) for i, p in enumerate((LONG, PROMPTS["dsv3"]))])
    assert [tokens(outs[str(i)]) for i in range(2)] == [ref.greedy(LONG), ref.greedy(PROMPTS["dsv3"])]
    plain = Reference(files, hf_greedy(build("deepseek_v3")))
    assert plain.greedy(LONG) != ref.greedy(LONG), "YaRN changed nothing: the case does not discriminate"


def test_the_file_checks_say_what_the_replicated_latent_costs_in_host_memory(refs, tmp_path):
    from talaria.config.loader import load_config
    from talaria.node.preflight import check_files

    glm = refs["glm"].files
    (tmp_path / "talaria.toml").write_text(
        f'[[models]]\nname = "glm"\nsource = "{glm.directory}"\ndtype = "float64"\n\n'
        '[[instances]]\nname = "c"\npool = "cold"\nmodels = ["glm"]\ntp = 4\narena_bytes = 16777216\n')
    info = check_files(load_config(tmp_path / "talaria.toml"))
    token = kv_layout(glm.arch, 4, 16, "float64").token_bytes
    assert any('model "glm": glm_moe_dsa' in line and "4 heads on a latent of 16 + 8 (MLA)" in line for line in info)
    assert (f'instance "c" model "glm": its latent is whole on each of the 4 ranks, so host KV keeps 4 copies: '
            f"{4 * token} B a token on the node") in info


def test_a_short_chunk_over_the_latent_equals_the_expanded_attention(refs):
    """The two forms a prompt chunk may take (`MLA.absorbs` picks), on the same queries, context and
    sparse selection: equal to float64 rounding; and the rule picks latent-direct for short chunks."""
    from talaria.executor.mla import MLA
    from talaria.executor.rope import softmax_scale

    arch = refs["glm"].files.arch
    mla = MLA(Shard(0, 1, arch), softmax_scale(arch))
    g = torch.Generator().manual_seed(2)
    n, length, hl = 7, 30, arch.num_heads
    q = torch.randn(n, hl, arch.head_dim, generator=g, dtype=torch.float64)
    ctx = torch.randn(length, arch.latent_dim, generator=g, dtype=torch.float64)
    kv_b = torch.randn(hl, arch.qk_nope_head_dim + arch.v_head_dim, arch.kv_lora_rank, generator=g, dtype=torch.float64)
    causal = torch.ones(n, length, dtype=torch.bool).tril_(length - n)
    sel = torch.rand(n, length, generator=g) < 0.6
    sel[:, 0] = True  # every query keeps a token
    for mask, chosen in ((causal, None), (causal, sel)):
        a, b = mla._latent_prefill(q, ctx, mask, kv_b, chosen), mla._prefill(q, ctx, mask, kv_b, chosen)
        assert (a - b).abs().max() < 1e-12
    assert mla.absorbs(1) and mla.absorbs(12) and not mla.absorbs(40)  # 16 (8 + 12) / (32 + 8 - 16 - 12) = 26.7


def test_a_decode_batch_reads_its_shared_prefix_once_and_equals_reading_it_per_sequence(refs):
    """Three sequences whose contexts start with the same 6 pages, decoded as one batch with the
    prefix read once and as a plain padded batch: equal to float64 rounding, with a sparse selection."""
    from talaria.executor.attention import _decode_batch
    from talaria.executor.mla import MLA
    from talaria.executor.rope import softmax_scale

    arch = refs["glm"].files.arch
    mla = MLA(Shard(0, 1, arch), softmax_scale(arch))
    g = torch.Generator().manual_seed(4)
    ps, hl = 4, arch.num_heads
    cache = torch.randn(20, ps, arch.latent_dim, generator=g, dtype=torch.float64)
    cache[19] = 0  # the null page
    pages = [(0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 4, 5, 8), (0, 1, 2, 3, 4, 5, 9, 10, 11)]
    ctx = [31, 26, 34]
    q = torch.randn(3, hl, arch.head_dim, generator=g, dtype=torch.float64)
    kv_b = torch.randn(hl, arch.qk_nope_head_dim + arch.v_head_dim, arch.kv_lora_rank, generator=g, dtype=torch.float64)
    once = _decode_batch(None, pages, ctx, 6, ps, 19, torch.device("cpu"))
    padded = _decode_batch(None, pages, ctx, 0, ps, 19, torch.device("cpu"))
    assert once.shared is not None and padded.shared is None
    sel = torch.rand(3, 9 * ps, generator=g) < 0.7  # both batches lay a context out alike: its 9 pages
    sel[:, 0] = True
    for chosen in (None, sel):
        a, b = mla._decode(q, cache, once, kv_b, chosen), mla._decode(q, cache, padded, kv_b, chosen)
        assert (a - b).abs().max() < 1e-12
