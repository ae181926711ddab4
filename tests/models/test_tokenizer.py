"""Our tokenizer against transformers' GGUF tokenizer for SmolLM2, and the synthetic byte tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from talaria.config.schema import ModelConfig
from talaria.models.errors import ChatTemplateError
from talaria.models.source import prepare_model
from talaria.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "naïve café résumé Ünïcödé ß Ω ≈ ∑",
    "日本語のテキスト、中文字符와 한국어",
    "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "numbers 1234567 3.14159 -42 1e-5",
    "I'm sure we'll see they've gone",
    "",
    "   ",
    '{"json": [1, 2, {"nested": null}]}',
    "<repo_name>talaria<file_sep>x.py",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 🙂"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def smollm(smollm_files) -> Tokenizer:
    return Tokenizer.load(smollm_files.directory)


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    return prepare_model(ModelConfig(name="s", source="synthetic:"), None, tmp_path_factory.mktemp("syn")).directory


@pytest.mark.slow
def test_encode_and_decode_equal_transformers(smollm, hf_gguf_tokenizer):
    for text in TEXTS:
        ids = smollm.encode(text)
        assert ids == hf_gguf_tokenizer.encode(text), text
        assert smollm.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True), text


@pytest.mark.slow
def test_chat_template_equals_transformers(smollm, hf_gguf_tokenizer):
    for messages in CONVERSATIONS:
        expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smollm.apply_chat_template(messages) == expected
        assert smollm.encode_chat(messages) == hf_gguf_tokenizer.encode(expected, add_special_tokens=False)


def test_special_ids_and_vocab(smollm):
    assert smollm.bos_token_id == 1 and smollm.eos_token_ids == (2,) and smollm.vocab_size == 49152
    assert smollm.encode("<|im_end|>") == [2]
    assert smollm.decode([2, 19556]) == "Hello" and smollm.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_content_parts_are_joined_as_text(smollm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    plain = [{"role": "user", "content": "one\ntwo"}]
    assert smollm.apply_chat_template(parts) == smollm.apply_chat_template(plain)
    with pytest.raises(ChatTemplateError, match="'image_url' is not supported"):
        smollm.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_generation_prompt_is_optional(smollm):
    messages = CONVERSATIONS[0]
    assert smollm.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
    assert smollm.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_synthetic_tokenizer_round_trips_bytes(byte_dir):
    tok = Tokenizer.load(byte_dir)
    assert tok.encode("é🙂") == list("é🙂".encode())
    assert tok.eos_token_ids == (257,) and tok.bos_token_id == 256 and tok.vocab_size == 320
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(prompt)) == prompt


def test_bos_added_only_when_configured_and_never_to_chat(byte_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(byte_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
    tok = Tokenizer.load(tmp_path)
    assert tok.encode("a") == [256, 97] and tok.encode("a", add_special_tokens=False) == [97]
    assert tok.encode_chat([{"role": "user", "content": "a"}])[0] != 256
    assert Tokenizer.load(byte_dir).encode("a") == [97]


def test_template_errors_are_chat_template_errors(byte_dir, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(byte_dir / name, tmp_path / name)
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": strict}))
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        Tokenizer.load(tmp_path).apply_chat_template([{"role": "system", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.load(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
