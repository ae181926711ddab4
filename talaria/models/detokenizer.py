"""Streaming token ids to text without ever emitting half a character.

Decoding token by token breaks in two ways: a multi-byte UTF-8 character split across tokens
decodes to U+FFFD, and decoders that drop a leading space (SentencePiece) lose it when a token is
decoded alone. So we decode a small window that starts one chunk back, emit only the text past what
that earlier chunk decoded to, and hold everything back while the window ends in U+FFFD. The pieces
concatenate to exactly ``decode(all_ids)``; each push decodes a few tokens, not the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push`` returns the new text for the ids pushed so far; ``flush`` returns what was held back."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._window: list[int] = []  # ids from the start of the previous emitted chunk
        self._read = 0  # ids in _window whose text has been emitted
        self._prefix_chars = 0  # len(decode(_window[:_read]))

    def push(self, ids: Iterable[int]) -> str:
        self._window.extend(ids)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT) or len(text) <= self._prefix_chars:
            return ""  # an incomplete character, or nothing visible yet (e.g. a skipped special)
        new = text[self._prefix_chars:]
        # slide: the chunk just emitted becomes the prefix of the next window
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_chars = len(self._decode(self._window))
        return new

    def flush(self) -> str:
        """The held-back tail (e.g. bytes of a character the model never finished), then reset."""
        text = self._decode(self._window)
        new = text[self._prefix_chars:] if len(text) > self._prefix_chars else ""
        self._window, self._read, self._prefix_chars = [], 0, 0
        return new
