"""Token masks from grammars: rank 0 constrains the calls that ask for it, and only those.

A call whose `SamplingParams.grammar` is set (talaria/gateway/grammar.py builds them) samples each
token from the ones its grammar allows next; once the grammar is complete only the model's end of
turn is allowed, so the call finishes. llguidance computes a mask in tens of microseconds from a
compiled grammar and the model's vocabulary. Compiling is the costly part (a coding agent's 17 tools,
60 KB of schemas, take about 0.2 s against SmolLM2's vocabulary: `python bench/agent_api.py`), so each
distinct grammar is compiled once per model and every call that brings it again starts from a copy of
that matcher: a second call with the same tools compiles nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from talaria.models.source import ModelFiles

COMPILED_KEPT = 64  # grammars kept compiled per instance, least recently used dropped first


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (a cache miss)
    compile_s: float = 0.0  # seconds spent compiling them
    reuses: int = 0  # calls that started from an already compiled grammar


class GrammarError(ValueError):
    """A grammar the vocabulary cannot follow (the gateway validated it without the vocabulary)."""


class GrammarMasks:
    def __init__(self, models: dict[str, ModelFiles]) -> None:
        self._files = models
        self._tokenizers: dict[str, LLTokenizer] = {}
        self._compiled: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()  # (model, grammar) -> pristine
        self._matchers: dict[str, LLMatcher] = {}  # request id -> its matcher
        self.stats = GrammarStats()

    def allowed(self, request_id: str, model: str, grammar: str, vocab: int) -> torch.Tensor:
        """The tokens `request_id` may sample next: a bool tensor of `vocab` entries."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = self._start(model, grammar)
        tokenizer = self._tokenizers[model]
        if matcher.is_error() or matcher.is_stopped():  # complete (or broken): only the end of turn
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[tokenizer.eos_tokens] = True
            return mask
        words = np.empty((vocab + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
        return torch.from_numpy(bits).bool()

    def consume(self, request_id: str, token: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.is_stopped():
            matcher.consume_token(token)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def _start(self, model: str, grammar: str) -> LLMatcher:
        key = (model, grammar)
        pristine = self._compiled.get(key)
        if pristine is not None:
            self._compiled.move_to_end(key)
            self.stats.reuses += 1
            return pristine.deep_copy()
        t0 = time.perf_counter()
        pristine = LLMatcher(self._tokenizer(model), grammar)
        if pristine.is_error():
            raise GrammarError(f"the grammar cannot be followed with {model}'s vocabulary: {pristine.get_error()}")
        self.stats.compiles += 1
        self.stats.compile_s += time.perf_counter() - t0
        self._compiled[key] = pristine
        while len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return pristine.deep_copy()

    def _tokenizer(self, model: str) -> LLTokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            files = self._files[model]
            text = (files.directory / "tokenizer.json").read_text(encoding="utf-8")
            eos = list(files.arch.eos_token_ids)
            if not eos:
                raise GrammarError(f"{model} declares no end-of-turn token, so a constrained call could not end")
            tok = self._tokenizers[model] = LLTokenizer(text, n_vocab=files.arch.vocab_size, eos_token=eos)
        return tok
