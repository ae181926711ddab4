"""Streaming detokenization equals a full decode and never shows half a character."""

from __future__ import annotations

import pytest

from talaria.config.schema import ModelConfig
from talaria.models.detokenizer import IncrementalDetokenizer
from talaria.models.source import prepare_model
from talaria.models.tokenizer import Tokenizer

TEXT = "Grüße 👋🏽 from 東京! 🇯🇵 emoji family 👨‍👩‍👧 and code: `x = 'ü'` ✔ done 🙂"


@pytest.fixture(scope="module", params=["smollm2", "synthetic"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "smollm2":
        return Tokenizer.load(request.getfixturevalue("smollm_files").directory)
    files = prepare_model(ModelConfig(name="s", source="synthetic:"), None, tmp_path_factory.mktemp("syn"))
    return Tokenizer.load(files.directory)  # one token per byte: every multi-byte char is split


def test_token_by_token_concatenates_to_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = tokenizer.detokenizer()
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_chunks_of_any_size_and_skipped_specials(tokenizer):
    ids = tokenizer.encode(TEXT)
    eos = tokenizer.eos_token_ids[0]
    ids = ids[:5] + [eos] + ids[5:] + [eos]
    for size in (2, 3, 7):
        detok = tokenizer.detokenizer()
        out = "".join(detok.push(ids[i:i + size]) for i in range(0, len(ids), size)) + detok.flush()
        assert out == tokenizer.decode(ids) == TEXT


def test_incomplete_character_is_held_until_flush(tmp_path):
    files = prepare_model(ModelConfig(name="s", source="synthetic:"), None, tmp_path)
    tokenizer = Tokenizer.load(files.directory)  # one token per byte
    detok = tokenizer.detokenizer()
    partial = list("🙂".encode())[:2]
    assert detok.push([ord("a")]) == "a"
    assert detok.push(partial) == ""
    assert detok.flush() == tokenizer.decode(partial) == "\ufffd"


def test_each_push_decodes_a_small_window(tokenizer):
    windows = []

    def decode(ids):
        windows.append(len(ids))
        return tokenizer.decode(ids)

    detok = IncrementalDetokenizer(decode)
    ids = tokenizer.encode(TEXT * 20)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == TEXT * 20
    assert max(windows) < 16  # a trailing window, not the whole sequence
