"""Equality rule for hybrid models (float64): tiny random Qwen3-Next and Qwen3.5-MoE models built with
transformers' own config classes (Gated DeltaNet layers between gated attention layers, MoE with a
gated shared expert) and saved with `save_pretrained` give Talaria the same greedy tokens as
transformers' float64 `generate` (its pure-torch delta rule, which computes in float32 as the engine
does), at TP 1 and 2: batched prompts longer than a delta-rule chunk, prompts prefilled in page-sized
chunks, preemption, forced switches and host restores, and prefix hits that resume from a state
snapshot. Every resumed call asserts where it resumed: a DeltaNet state exists only where a
snapshot was published, so the position is the last page boundary its previous call reached.
"""

from __future__ import annotations

import random

import pytest
import torch

from talaria.config.schema import ModelConfig, Pool
from talaria.contracts.call import InstanceCall
from talaria.contracts.kv_layout import kv_layout
from talaria.models.source import ModelFiles, prepare_model
from tests.executor.group_turns import group_turns
from tests.executor.hand_profile import write_profile
from tests.executor.test_moe_equivalence import Reference, hf_greedy
from tests.hybrid_models import TINY, build, save
from tests.tiny_models import GREEDY, arena_for_pages, engine, instance, run, tokens

PS = 4
HYBRID = {"next": "qwen3_next", "q35": "qwen3_5_moe"}  # name -> family
TINY_TYPES = ["linear_attention"] * 3 + ["full_attention"]  # transformers' default: every 4th layer attends
SUBSTRATE = {"pool": Pool.COLD, "page_size": PS, "debug_poison": True, "staging_chunk_bytes": 4096,
             "host_kv_bytes": 8 << 20, "ttft_s": 3600.0, "arena_bytes": 16 << 20}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Reference]:
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for name, family in HYBRID.items():
        hf = build(family)
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


rng = random.Random(3)
PROMPTS = {name: [rng.randrange(256) for _ in range(n)] for name, n in (("next", 29), ("q35", 23))}
LONG = [rng.randrange(256) for _ in range(150)]  # over two chunks of the chunked delta rule
TAIL = [4, 5]


def snapshot_at(prompt: list[int]) -> int:
    """Where a call returning after `prompt` and its answer resumes: the last page boundary its
    computed tokens reached (a snapshot is published at every one; the last sampled token has none)."""
    return (len(prompt) + GREEDY.max_tokens - 1) // PS * PS


def test_the_layout_keeps_attention_pages_and_deltanet_states(refs):
    arch = refs["next"].files.arch
    layout = kv_layout(arch, 2, PS, "float64")
    assert (layout.tensor("k").layers, layout.tensor("conv").layers) == ((3,), (0, 1, 2))
    # per rank: 1 KV head of 16 dims; conv channels 2 * 1 key head * 8 + 2 value heads * 8, 3 past inputs
    assert layout.page_bytes == 2 * PS * 16 * 8 and layout.tensor("conv").shape == (32, 3)
    assert layout.tensor("ssm").shape == (2, 8, 8) and layout.tensor("ssm").dtype == "float32"
    assert layout.state_bytes == 3 * (32 * 3 * 8 + 2 * 8 * 8 * 4)


def test_the_cases_are_discriminating(refs):
    """A zero-centred norm read as a plain one changes the tokens: the equality below would catch it
    (the weights are not degenerate)."""
    for name, family in HYBRID.items():
        plain = build(family)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                if n.endswith("input_layernorm.weight"):
                    p.add_(1.0)  # what a norm without the 1 + w would compute on the reference's weights
        assert Reference(refs[name].files, hf_greedy(plain)).greedy(PROMPTS[name]) != refs[name].greedy(PROMPTS[name])


def test_tp1_batched_and_chunked_prompts_equal_transformers(refs, profile_for):
    for name, ref in refs.items():
        profile = profile_for([ref.files], 1)
        prompts = [PROMPTS[name], LONG, [17], LONG[:70]]
        for budget in (512, 12):  # everything in one step; page-sized chunks (states carried between them)
            core = engine([ref.files], page_size=PS, host_kv_bytes=1 << 20, profile=profile, max_batch_tokens=budget)
            outs = run(core, [InstanceCall(str(i), name, tuple(p), GREEDY) for i, p in enumerate(prompts)])
            for i, p in enumerate(prompts):
                assert tokens(outs[str(i)]) == ref.greedy(p), f"{name} prompt {i} budget {budget}"


def test_tp1_a_prefix_hit_resumes_at_the_snapshot_and_preemption_recomputes(refs, profile_for):
    for name, ref in refs.items():
        core = engine([ref.files], page_size=PS, host_kv_bytes=0, profile=profile_for([ref.files], 1))
        first = run(core, [InstanceCall("1", name, tuple(PROMPTS[name]), GREEDY)])["1"]
        cont = PROMPTS[name] + tokens(first) + TAIL
        out = run(core, [InstanceCall("2", name, tuple(cont), GREEDY)])["2"]
        assert out[-1].usage.cached_tokens == snapshot_at(PROMPTS[name]), f"{name}: resumed elsewhere"
        assert tokens(first) == ref.greedy(PROMPTS[name]) and tokens(out) == ref.greedy(cont), name
        # a pool of 40 pages for three calls of 60 tokens: sequences are preempted and recomputed
        options = {"page_size": PS, "host_kv_bytes": 0, "profile": profile_for([ref.files], 1)}
        small = engine([ref.files], arena_bytes=arena_for_pages(ref.files, 40, **options), **options)
        prompts = [LONG[i:i + 50] for i in (0, 40, 90)]
        outs = run(small, [InstanceCall(str(i), name, tuple(p), GREEDY) for i, p in enumerate(prompts)])
        assert small.scheduler.batchers[name].preemptions > 0, f"{name}: nothing was preempted"
        for i, p in enumerate(prompts):
            assert tokens(outs[str(i)]) == ref.greedy(p), f"{name} preempted prompt {i}"


def test_tp1_switches_and_host_restores_keep_tokens(refs, profile_for):
    files = [r.files for r in refs.values()]
    core = engine(files, profile=profile_for(files, 1), **SUBSTRATE)
    answers = {}
    for f in files:
        core.scheduler.force_switch(f.name)
        answers[f.name] = tokens(run(core, [InstanceCall(f"{f.name}-1", f.name, tuple(PROMPTS[f.name]), GREEDY)])
                                 [f"{f.name}-1"])
        assert answers[f.name] == refs[f.name].greedy(PROMPTS[f.name]), f.name
    for f in files:  # each session returns after the other model had the arena: pages and state from host
        cont = PROMPTS[f.name] + answers[f.name] + TAIL
        core.scheduler.force_switch(f.name)
        out = run(core, [InstanceCall(f"{f.name}-2", f.name, tuple(cont), GREEDY)])[f"{f.name}-2"]
        assert out[-1].usage.restored_tokens == snapshot_at(PROMPTS[f.name]), f"{f.name}: not restored from host"
        assert tokens(out) == refs[f.name].greedy(cont), f.name


def test_tp2_group_switches_and_restores_equal_transformers(refs, profile_for):
    """Two workers over gloo: DeltaNet heads, their conv channels and state split by rank; both
    models time-share the group, the second turn restored from host."""
    files = [r.files for r in refs.values()]
    config = instance(files, tp=2, profile=profile_for(files, 2), **SUBSTRATE)
    results = group_turns(config, files, PROMPTS, {name: LONG[:70] for name in refs}, TAIL)
    for (name, turn), (prompt, toks, usage) in results.items():
        assert toks == refs[name].greedy(prompt), f"{name} turn {turn} tp=2"
        if turn == 2:
            assert usage.restored_tokens == snapshot_at(PROMPTS[name]), f"{name}: not restored from host"


def test_a_vision_language_checkpoint_serves_its_text_model(tmp_path, profile_for):
    """Qwen3.5 ships as a vision-language checkpoint: a `qwen3_5_moe` config whose `text_config` is the
    text model, weights under model.language_model.*, beside a vision tower the engine never reads."""
    from transformers import Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeConfig,
    )

    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
    hf = Qwen3_5MoeForConditionalGeneration._from_config(Qwen3_5MoeConfig(text_config=TINY, vision_config=vision),
                                                         dtype=torch.float64, experts_implementation="eager")
    text = build("qwen3_5_moe")  # the text model's weights drawn as above, into the VL model
    with torch.no_grad():
        for name, p in text.named_parameters():
            hf.get_parameter(name.replace("model.", "model.language_model.", 1)).copy_(p)
    save(hf.eval(), tmp_path)
    files = prepare_model(ModelConfig(name="vl", source=str(tmp_path), dtype="float64"), None)
    assert files.arch.family == "qwen3_5_moe" and files.arch.layer_types == tuple(TINY_TYPES)
    core = engine([files], page_size=PS, host_kv_bytes=0, profile=profile_for([files], 1))
    weights = core.executor.substrate.images["vl"].weights
    visual = sum(p.numel() for n, p in hf.named_parameters() if ".visual." in n) * 8
    assert visual and weights.bytes_read == (sum(p.numel() for p in text.parameters())) * 8  # no vision byte read
    out = run(core, [InstanceCall("1", "vl", tuple(PROMPTS["q35"]), GREEDY)])["1"]
    assert tokens(out) == hf_greedy(hf)(PROMPTS["q35"])


def test_start_up_calibration_probes_a_hybrid_model_within_its_context(refs):
    """No profile given: the instance calibrates, its probe sequences holding state slots and their
    positions within the model's 256-token context (a pool of thousands of tokens would reach past
    its RoPE tables), and the profile prices a state restore beside the tokens."""
    files = refs["next"].files
    core = engine([files], pool=Pool.COLD, page_size=PS, host_kv_bytes=1 << 20, max_batch_tokens=512, ttft_s=3600.0)
    layout = kv_layout(files.arch, 1, PS, files.dtype)
    priced = core.profile.model("next")
    assert (priced.token_bytes, priced.state_bytes) == (layout.token_bytes, layout.state_bytes)
    assert core.executor.substrate.plan.num_pages * PS > files.arch.max_position
    out = run(core, [InstanceCall("1", "next", tuple(PROMPTS["next"]), GREEDY)])["1"]
    assert tokens(out) == refs["next"].greedy(PROMPTS["next"])


def test_tp1_a_branching_call_resumes_at_a_snapshot_inside_the_first_prompt(refs, profile_for):
    """snapshot_every_tokens = 8: a 40-token prompt publishes snapshots at 8, 16, 24 and 32; a call
    sharing its first 21 tokens resumes at 16 (its last snapshot below its own newest token)."""
    for name, ref in refs.items():
        core = engine([ref.files], page_size=PS, host_kv_bytes=0, profile=profile_for([ref.files], 1),
                      snapshot_every_tokens=8)
        assert tokens(run(core, [InstanceCall("1", name, tuple(LONG[:40]), GREEDY)])["1"]) == ref.greedy(LONG[:40])
        branch = LONG[:21] + [7, 7, 7]
        out = run(core, [InstanceCall("2", name, tuple(branch), GREEDY)])["2"]
        assert out[-1].usage.cached_tokens == 16 and tokens(out) == ref.greedy(branch), name
