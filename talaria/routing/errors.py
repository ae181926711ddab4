"""What routing can refuse, as exceptions the gateway turns into HTTP answers (429 + Retry-After)."""

from __future__ import annotations

RETRY_AFTER_S = 2  # what a refusal tells clients to wait: instances free up or restart within seconds


class Overloaded(Exception):
    """No instance admits the call now and the overload policy turned it away; retry later.
    `retry_after_ms`: the wait exactly (`retry-after-ms`, which the OpenAI and Anthropic SDKs read
    before `Retry-After`); `over_capacity`: not even a place in line (503, or 529 under /v1/messages)."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S, retry_after_ms: int | None = None,
                 over_capacity: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.retry_after_ms = retry_after_ms
        self.over_capacity = over_capacity
