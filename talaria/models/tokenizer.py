"""The tokenizer of a prepared model directory: encode, decode, chat template, streaming decode.

Wraps ``tokenizers.Tokenizer`` (the fast Rust tokenizer) with the bits of ``tokenizer_config.json``
the gateway needs: whether to prepend BOS, the special tokens, and the Jinja chat template. It
reads only files, so a converted GGUF, a synthetic model and an HF checkpoint all load the same way.

Control tokens come only from the chat template. A client's text (every string of the messages and
tools) goes into the template *quoted*: where it holds a special token's text (`<|im_start|>`), a
QUOTE character is put inside that text, so the rendered prompt has no such token there, and
`encode_prompt` tokenizes the stretch around it, unquoted, as ordinary text. Text without special
tokens is left as it is, so its prompt and ids are exactly those of the plain rendering. Added tokens
not marked special (Qwen's `<tool_call>`) are vocabulary, parsed wherever they appear, as the library
does. (The legacy completions prompt is the client's raw text, tokenized by `encode`, special tokens
parsed.)
"""

from __future__ import annotations

import json
import re
import threading
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import tokenizers

from talaria.models.chat_template import ChatTemplate
from talaria.models.detokenizer import IncrementalDetokenizer
from talaria.models.errors import ChatTemplateError, ModelSourceError
from talaria.models.hf_dir import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER,
    TOKENIZER_CONFIG,
    read_json,
)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
QUOTE = "\ufdd0"  # a Unicode noncharacter: inside a special token's text in client text; doubled for itself
_UNQUOTE = re.compile(QUOTE + "(" + QUOTE + "?)")


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt's ids, and where its added tokens (`<|im_start|>`, ...) end. The tokenizer splits the
    text at added tokens before anything else, so the text up to the end of one is tokenized the same
    whatever follows it: a longer prompt that shares the text up to one of these cuts reuses the ids
    before it."""

    ids: tuple[int, ...]
    cut_chars: tuple[int, ...]  # character offsets just past an added token, ascending
    cut_tokens: tuple[int, ...]  # the ids up to there (that added token included)
    reused: int = 0  # leading ids taken from an earlier prompt rather than tokenized


class Tokenizer:
    """Text <-> ids for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, add_bos_token: bool, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: ChatTemplate | None):
        self._backend = backend
        self._add_bos = add_bos_token and bos_token_id is not None
        self._added = frozenset(backend.get_added_tokens_decoder())  # ids split out before tokenizing
        self._special = _special_text(backend)  # matches a special token's text (None: the model has none)
        self._as_text: tokenizers.Tokenizer | None = None  # a copy that takes special tokens' text as text
        self._as_text_lock = threading.Lock()
        self._cuts_stable = _cuts_are_stable(backend)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self._chat_template = chat_template

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (+ eos ids from config/generation_config)."""
        try:
            backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER))
            config = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for malformed JSON
            raise ModelSourceError(f"{directory}: cannot load the tokenizer ({e}); "
                                   "re-prepare the model or re-download tokenizer.json") from None
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        bos = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos = _config_eos(directory)
        if special["eos_token"] and (tok_eos := backend.token_to_id(special["eos_token"])) is not None:
            eos = tuple(dict.fromkeys(eos + (tok_eos,)))
        source = _template_source(directory, config)
        template = ChatTemplate(source, special) if source else None
        return cls(backend, add_bos_token=bool(config.get("add_bos_token", False)), bos_token_id=bos,
                   eos_token_ids=eos, chat_template=template)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for ``text``; the only special token ever added is BOS, when the model asks for it."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            return [self.bos_token_id, *ids]
        return ids

    def encode_prompt(self, text: str, prior: tuple[str, PromptTokens] | None = None) -> PromptTokens:
        """The ids of `text`, a prompt as `apply_chat_template` renders it (quoted client text is
        tokenized as text; no BOS: templates write their own), reusing `prior` (an earlier prompt's
        text and tokens) up to the end of the last added token inside the text the two share; equal
        to tokenizing `text` whole. Only the new part is tokenized, by `encode_batch`, which releases
        the GIL, so a long prompt tokenized on a worker thread does not stall the event loop."""
        start, keep, chars, toks = 0, 0, (), ()
        if prior is not None and self._cuts_stable:
            before, tokens = prior
            k = bisect_right(tokens.cut_chars, _common_prefix(text, before))  # cuts inside the shared text
            if k:
                start, keep = tokens.cut_chars[k - 1], tokens.cut_tokens[k - 1]
                chars, toks = tokens.cut_chars[:k], tokens.cut_tokens[:k]
        ids, new_chars, new_toks = self._tokenize(text[start:])
        ids = (prior[1].ids[:keep] if keep else ()) + tuple(ids)
        return PromptTokens(ids, chars + tuple(start + c for c in new_chars),
                            toks + tuple(keep + n for n in new_toks), keep)

    def _tokenize(self, text: str) -> tuple[list[int], list[int], list[int]]:
        """(ids, the character offset just past each added token, the ids up to there) of a prompt.

        Added tokens split the text before anything else, so the stretches between them are
        tokenized apart; a stretch holding quoted client text is tokenized again, unquoted, by a
        copy of the tokenizer that takes special tokens' text as text, and its ids replace the
        first ones. Every other id is the plain tokenization's. (With cuts that are not stable, see
        `_cuts_are_stable`, such a stretch tokenized alone may start differently than in place.)"""
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        ids, offsets = encoding.ids, encoding.offsets  # (each access builds a new list)
        added = [i for i, token in enumerate(ids) if token in self._added]
        ends = [offsets[i][1] for i in added]
        if QUOTE not in text:
            return ids, ends, [i + 1 for i in added]
        # the stretches before each added token and after the last: ids [i, j), characters [a, b)
        stretches = list(zip([0, *(i + 1 for i in added)], [*added, len(ids)],
                             [0, *ends], [*(offsets[i][0] for i in added), len(text)]))
        quoted = {k: _UNQUOTE.sub(r"\1", text[a:b]) for k, (_, _, a, b) in enumerate(stretches) if QUOTE in text[a:b]}
        as_text = self._text_backend().encode_batch(list(quoted.values()), add_special_tokens=False)
        again = {k: e.ids for k, e in zip(quoted, as_text)}
        out, toks = [], []
        for k, (i, j, _, _) in enumerate(stretches):
            out += again[k] if k in again else ids[i:j]
            if j < len(ids):  # the added token after the stretch
                out.append(ids[j])
                toks.append(len(out))
        return out, ends, toks

    def _text_backend(self) -> tokenizers.Tokenizer:
        """The backend with `encode_special_tokens` set, made on first use (copying it takes ~0.2 s):
        a flag of its own, as the shared backend is used by other threads meanwhile."""
        with self._as_text_lock:
            if self._as_text is None:
                self._as_text = tokenizers.Tokenizer.from_str(self._backend.to_str())
                self._as_text.encode_special_tokens = True
            return self._as_text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template_source(self) -> str | None:
        """The chat template's Jinja text (None without a template)."""
        return self._chat_template.source if self._chat_template is not None else None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for a conversation, its client text quoted (tokenize it with
        `encode_prompt`); raises ChatTemplateError if it cannot be rendered."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template; use the completions endpoint "
                                    "or add chat_template to its tokenizer_config.json")
        return self._chat_template.render(self.quote(messages), add_generation_prompt,
                                          self.quote(tools) if tools else None)

    def quote(self, value: Any) -> Any:
        """`value` (a string, or lists and mappings of them, keys included) with QUOTE put after the
        first character of each special token's text, and QUOTE itself doubled; other values as
        they are. One-character special tokens cannot be quoted and are not."""
        # invariant: quoted text holds no special token's text; one could only form across the edge
        # of client text and template text, if a template wrote part of a special token's text
        if isinstance(value, str):
            value = value.replace(QUOTE, QUOTE + QUOTE) if QUOTE in value else value
            found = self._special is not None
            while found:  # again for overlapping matches ("<a" + "a>" in "<a>")
                value, found = self._special.subn(_quoted, value)
            return value
        if isinstance(value, Mapping):
            return {self.quote(k): self.quote(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.quote(v) for v in value]
        return value

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Ids of the rendered conversation. No BOS is added: templates write their own, as in
        transformers' ``apply_chat_template(tokenize=True)``."""
        return list(self.encode_prompt(self.apply_chat_template(messages, add_generation_prompt, tools)).ids)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder whose pieces concatenate to ``decode(all_ids)``."""
        return IncrementalDetokenizer(lambda ids: self.decode(ids, skip_special_tokens))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _config_eos(directory: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for name in (CONFIG, GENERATION_CONFIG):
        try:
            eos = read_json(directory / name).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template`` from the config (a string, or HF's list of named templates), else
    ``chat_template.jinja`` beside it, as newer transformers save it."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template or None


def _quoted(match: re.Match[str]) -> str:
    return match[0][0] + QUOTE + match[0][1:]


def _special_text(backend: tokenizers.Tokenizer) -> re.Pattern[str] | None:
    """A pattern for the special tokens' texts, longest first (the tokenizer takes the longest match)."""
    texts = sorted((t.content for t in backend.get_added_tokens_decoder().values()
                    if t.special and len(t.content) > 1 and QUOTE not in t.content), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _cuts_are_stable(backend: tokenizers.Tokenizer) -> bool:
    """Whether text tokenizes the same when cut just past an added token: no normalizer over the whole
    text, no prefix space or Metaspace prefix added to the start of an input (which a tail tokenized
    alone would get and the whole text would not), added tokens that strip no whitespace around them
    and none the start of another (which a longer text could match instead). Byte-level BPE
    tokenizers (GPT-2, SmolLM2, Qwen, Llama 3) qualify; others are tokenized whole every time."""
    spec = json.loads(backend.to_str())
    pre = json.dumps(spec.get("pre_tokenizer"))
    if spec.get("normalizer") is not None or '"add_prefix_space": true' in pre or "Metaspace" in pre:
        return False
    added = backend.get_added_tokens_decoder().values()
    contents = sorted(t.content for t in added)
    return (not any(t.lstrip or t.rstrip or t.single_word for t in added)
            and not any(b.startswith(a) for a, b in pairwise(contents)))


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix, by bisection over C-level comparisons."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
