"""Progress lines for long steps (model conversion, loading) on stderr."""

from __future__ import annotations

import sys
import time


class ProgressPrinter:
    """Callable as progress(stage, done, total); redraws one line per stage, at most 10 times a second."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self._stage = None
        self._last = 0.0
        self._open_line = False  # a tty line was drawn with \r and not yet ended

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        final = done >= total
        if stage == self._stage and not final and now - self._last < 0.1:
            return
        self._last = now
        tty = self.stream.isatty()
        if stage != self._stage and self._open_line:
            self.stream.write("\n")
        self._stage = stage
        pct = 100 * done // max(total, 1)
        line = f"{stage}: {done}/{total} ({pct}%)"
        if tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self._open_line = not final
        elif final or done == 0:
            self.stream.write(line + "\n")
        self.stream.flush()
