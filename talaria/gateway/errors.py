"""The one error type the gateway turns into an HTTP response, in OpenAI's error shape.

Every failure a client can see — a bad field, a missing key, an unknown model, an instance that is
down — leaves the gateway as `{"error": {"message", "type", "param", "code"}}` with a matching status,
because OpenAI SDKs parse exactly that shape into their typed exceptions. Nothing else (no FastAPI
422 detail list, no traceback) is ever sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from talaria.routing.errors import RETRY_AFTER_S  # noqa: F401  (what a 429 or 503 tells clients to wait)

# OpenAI's `type` values, chosen by status class so clients can branch on them.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error response: HTTP status plus the four OpenAI fields, and optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        """HTTP 400: the request is malformed; `param` names the offending field."""
        return cls(400, message, INVALID_REQUEST, param, code)

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients expect."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"
