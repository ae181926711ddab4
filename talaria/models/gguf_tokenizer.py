"""The tokenizer a GGUF file describes in its metadata, rebuilt as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types and special ids
under llama.cpp's keys. We support byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM,
Llama 3, Qwen) and rebuild it the way transformers' GGUF loader does, so both encode identically.
SentencePiece vocabularies (``"llama"``: Llama 2, Mistral v0.1) are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from talaria.models.byte_level import byte_level_bpe, bytes_to_unicode
from talaria.models.errors import ModelSourceError
from talaria.models.gguf_file import GgufFile

# the string arrays GgufFile.open must keep for gguf_tokenizer
VOCAB_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with; anything else
# (gpt2, smollm, ...) uses GPT-2's own regex, as transformers does
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(gguf: GgufFile, max_length: int) -> tuple[Tokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config)`` for a file opened with ``string_arrays=VOCAB_ARRAYS``."""
    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelSourceError(
            f"{gguf.path}: tokenizer type {kind!r} is not supported, only byte-level BPE ('gpt2'). "
            "Use a GGUF of a model with a byte-level BPE tokenizer (SmolLM, Llama 3, Qwen) or the model's "
            "Hugging Face safetensors directory instead."
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if "tokenizer.ggml.merges" not in meta:
        raise ModelSourceError(f"{gguf.path}: the byte-level vocabulary has no tokenizer.ggml.merges; "
                               "re-convert the model with a current llama.cpp")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_IDS.items()}
    specials = {tokens[i] for i in ids.values() if i is not None}
    # control tokens spelled outside the byte alphabet are llama.cpp mislabels; transformers skips them too
    added = [(t, True) for t, ty in zip(tokens, types)
             if (ty == _CONTROL or t in specials) and set(t) <= alphabet]
    added += [(t, False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    tokenizer = byte_level_bpe(vocab, merges, added, _SPLITS.get(meta.get("tokenizer.ggml.pre")))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": max_length,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    for name, i in ids.items():
        config[name] = tokens[i] if i is not None else None
    return tokenizer, config
