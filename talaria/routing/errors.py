"""What routing can refuse, as exceptions the gateway turns into HTTP answers (429 + Retry-After)."""

from __future__ import annotations

RETRY_AFTER_S = 2  # what a refusal tells clients to wait: instances free up or restart within seconds


class Overloaded(Exception):
    """No instance admits the call now and the overload policy turned it away; retry later."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
