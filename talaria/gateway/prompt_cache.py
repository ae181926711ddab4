"""Recent prompts' tokens, so an agent's next call tokenizes only what it added.

An agent resends its whole history on every call; tokenizing a 100K-token prompt again costs about
50 ms each time. Each chat prompt the gateway tokenizes is kept here under its conversation's key
(the continuity hash of its messages, talaria/routing/continuity.py), and a later prompt whose
messages extend that conversation is tokenized from it (`Tokenizer.encode_prompt`): the ids up to
the last added token the two rendered prompts share are reused, the rest is tokenized. Bounded by
the characters held; the least recently used prompts go first. Thread-safe: long prompts are parsed
on worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from talaria.models.tokenizer import PromptTokens, Tokenizer

MAX_CHARS = 64 << 20  # prompt text kept, all models together (about as many ids again)


class PromptCache:
    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self._max_chars = max_chars
        self._chars = 0
        self._entries: OrderedDict[tuple[str, int], tuple[str, PromptTokens]] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_tokens = 0  # ids taken from an earlier prompt instead of tokenized again

    def encode(self, tokenizer: Tokenizer, model: str, chain: Sequence[int], text: str) -> tuple[int, ...]:
        """`text`'s ids; `chain`: the continuity hashes of the messages it renders, one per message."""
        prior = None
        with self._lock:
            for key in reversed(chain):  # the longest earlier conversation this one extends
                prior = self._entries.get((model, key))
                if prior is not None:
                    self._entries.move_to_end((model, key))
                    break
        tokens = tokenizer.encode_prompt(text, prior)
        if chain:
            self._remember((model, chain[-1]), text, tokens)
        return tokens.ids

    def _remember(self, key: tuple[str, int], text: str, tokens: PromptTokens) -> None:
        with self._lock:
            self.reused_tokens += tokens.reused
            old = self._entries.pop(key, None)
            if old is not None:
                self._chars -= len(old[0])
            self._entries[key] = (text, tokens)
            self._chars += len(text)
            while self._chars > self._max_chars and len(self._entries) > 1:
                _, (dropped, _) = self._entries.popitem(last=False)
                self._chars -= len(dropped)
