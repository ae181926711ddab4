"""Byte-level BPE tokenizers (GPT-2 style) built with the `tokenizers` library.

Both the GGUF converter (``tokenizer.ggml.model == "gpt2"``) and the synthetic model need one, so
the construction lives here once: it matches what transformers builds for a byte-level GGUF
vocabulary, which the tests check token for token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, so every byte string is spellable."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_bpe(
    vocab: Mapping[str, int],
    merges: Sequence[tuple[str, str]],
    added: Sequence[tuple[str, bool]] = (),
    split_regex: str | None = None,
) -> Tokenizer:
    """A byte-level BPE tokenizer.

    ``added`` lists tokens matched whole in raw text before BPE runs, as ``(token, special)``;
    special ones are dropped by ``decode(skip_special_tokens=True)``. ``split_regex`` replaces
    GPT-2's pre-tokenizer regex for vocabularies trained with another split (Llama 3, Qwen2).
    """
    model = models.BPE(
        vocab=dict(vocab),
        merges=list(merges),
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    if split_regex is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(t, normalized=False, special=True) for t, is_special in added if is_special]
    plain = [AddedToken(t, normalized=False, special=False) for t, is_special in added if not is_special]
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)
    return tokenizer
