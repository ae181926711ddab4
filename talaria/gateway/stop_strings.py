"""Stop strings over a stream of text deltas, with OpenAI's semantics.

The engine only sees token ids, so stop *strings* are matched here, on detokenized text. A stop
string may straddle two deltas ("...</" + "answer>..."), so text that could be the start of a stop
string is held back until the next delta proves it is not. When a stop string completes, the text
before it is released and everything from the stop string on is dropped: OpenAI never returns the
stop string itself.
"""

from __future__ import annotations


class StopStringMatcher:
    """Fed text deltas with `push`; returns only text that can no longer be part of a stop string.

    invariant: no stop string starts inside text already returned — any suffix that is a prefix of
    some stop string is held in `_held`, so every match begins within `_held + delta`.
    """

    __slots__ = ("_held", "_longest", "_stops", "matched", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._held = ""
        self.stopped = False  # a stop string matched; later pushes return ""
        self.matched: str | None = None  # the stop string that matched

    def push(self, delta: str) -> str:
        """Add generated text; return the part that is safe to emit now (possibly empty)."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        text = self._held + delta
        cut = -1
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.matched = at, stop
        if cut != -1:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The generation ended without a match: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
