"""The gateway's HTTP plumbing: bounded JSON bodies (in size and in time), responses that run
bookkeeping once sent, the request counter, and every failure turned into the error shape its API
speaks (OpenAI's, or Anthropic's on the Messages API).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from talaria.gateway.anthropic_responses import error_body
from talaria.gateway.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    RETRY_AFTER_S,
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
)
from talaria.gateway.metrics import GatewayMetrics
from talaria.node.errors import CallFailed, InstanceFailed, InstanceUnavailable
from talaria.routing.errors import Overloaded

log = logging.getLogger("talaria.gateway.gateway")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody receives it
COUNTED_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
                 "/v1/responses"}
MESSAGES_API = "/v1/messages"  # paths under it answer errors in Anthropic's shape
OPENAI_MAX_RETRY_AFTER_S = 120  # the OpenAI SDKs obey a Retry-After up to this and give up at once on a longer one
# (openai-python's MAX_RETRY_AFTER_DELAY, `_should_retry`); Anthropic's SDKs obey any


class SentThen(JSONResponse):
    """A JSON response that runs `then` once it has been sent, or has failed to be. The last send
    yields only while the connection is paused for writing, that is before the client can have the
    whole response, so a client's next request, on any connection, finds the lease and continuity
    this call left."""

    def __init__(self, content: Any, headers: dict[str, str], then: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self._then = then

    def render(self, content: Any) -> bytes:
        return _JSON_OUT.encode(content).encode()  # JSONResponse's, minus building an encoder per call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._then()


class RequestCounter:
    """ASGI middleware counting /v1 requests by path and final status (errors included)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response starts, the request died in an unhandled error

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_request(path if path in COUNTED_PATHS else "other", status)


async def read_json(request: Request, limit: int, *, timeout_s: float) -> Any:
    """The body as JSON, refusing more than `limit` bytes whatever Content-Length claims (413), and a
    body not whole within `timeout_s` seconds (408; 0: no deadline). Handlers call it first thing,
    so the deadline runs from the request's headers."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError.invalid("Content-Length must be a non-negative integer")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        # one deadline over the whole body, not per chunk: a byte a second must not keep it alive
        async with asyncio.timeout(timeout_s or None) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "client closed the request") from None
    except TimeoutError:
        if not deadline.expired():
            raise
        raise _too_slow(timeout_s, size) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError.invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode()  # JSON is UTF-8 (RFC 8259)
        body = _JSON.decode(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise APIError.invalid(f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):  # only a \uD800-\uDFFF escape can put a surrogate in a string
        try:
            where = _lone_surrogate(body, "")
        except RecursionError:
            raise APIError.invalid("the request body is nested too deeply") from None
        if where is not None:
            where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate
            raise APIError.invalid(f"{where or 'the body'} holds a lone UTF-16 surrogate escape "
                                   "(\\uD800-\\uDFFF without its pair): not a Unicode character", where or None)
    return body


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or object key) in `value` holding an unpaired surrogate."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        if isinstance(key, str) and _SURROGATE.search(key):
            return where
        found = _lone_surrogate(item, where)
        if found is not None:
            return found
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one past float's range (`1e400`) is refused like NaN."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is outside the range of a finite number")
    return value


OVERLOADED_529 = 529  # Anthropic's status for "overloaded_error": its SDKs and Claude Code retry it
_SURROGATE = re.compile("[\ud800-\udfff]")  # a str decoded from JSON holds them only unpaired
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# built once: json.loads and json.dumps with options build a decoder or an encoder per call
_JSON = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_JSON_OUT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (server.max_body_bytes)", INVALID_REQUEST,
                    None, "request_too_large")


def _too_slow(timeout_s: float, size: int) -> APIError:
    # closing the connection: the rest of the body would otherwise still be read, and the socket held
    return APIError(408, f"the request body did not arrive within {timeout_s:g} s (server.read_timeout_s; "
                    f"{size} bytes came)", INVALID_REQUEST, None, "request_timeout", {"Connection": "close"})


def shaped(error: APIError, path: str) -> dict[str, Any]:
    """`error`'s body in the shape of the API at `path`: Anthropic's under /v1/messages, else OpenAI's."""
    return error_body(error) if path.startswith(MESSAGES_API) else error.body()


def instance_error(e: Exception, request_id: str) -> APIError:
    if isinstance(e, InstanceUnavailable):
        log.info("%s: 503: %s", request_id, e)
        return APIError(503, str(e), UNAVAILABLE, None, "instance_unavailable",
                        {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, CallFailed):
        log.warning("%s: the instance failed this call: %s", request_id, e)
        return APIError(500, f"the instance could not serve this call: {e}", SERVER_ERROR, None, "call_failed")
    log.warning("%s: instance failed mid-call: %s", request_id, e)
    return APIError(503, f"the instance serving this call failed and is restarting ({e}); retry the request",
                    UNAVAILABLE, None, "instance_failed", {"Retry-After": str(RETRY_AFTER_S)})


def _error_response(request: Request, error: APIError) -> JSONResponse:
    request_id = getattr(request.state, "request_id", None)
    log.log(logging.WARNING if error.status >= 500 else logging.INFO, "%s: %d %s",
            request_id or request.url.path, error.status, error.message)
    headers = dict(error.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(shaped(error, request.url.path), status_code=error.status, headers=headers)


def error_handlers() -> dict:
    """Every failure, Starlette's own 404 and 405 included, as JSON in the shape of the API asked
    (Anthropic's under /v1/messages, OpenAI's elsewhere)."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(request, exc)

    async def instance_down(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(request, instance_error(exc, getattr(request.state, "request_id", "-")))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        message = f"no route for {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return _error_response(request, APIError(exc.status_code, str(message), kind, None, None, exc.headers))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        log.error("%s: unhandled error", request_id or request.url.path, exc_info=exc)
        return _error_response(request, APIError(500, f"internal server error (request id {request_id})",
                                                 SERVER_ERROR))

    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        messages = request.url.path.startswith(MESSAGES_API)
        after_s, after_ms = exc.retry_after_s, exc.retry_after_ms
        if not messages and not exc.over_capacity and after_s > OPENAI_MAX_RETRY_AFTER_S:
            # a new session's place in line is kept past this: its client asks again then and is told anew
            after_s, after_ms = OPENAI_MAX_RETRY_AFTER_S, OPENAI_MAX_RETRY_AFTER_S * 1000
        headers = {"Retry-After": str(after_s)}
        if after_ms is not None:  # read first by the OpenAI and Anthropic SDKs
            headers["retry-after-ms"] = str(after_ms)
        if exc.over_capacity:  # Anthropic's clients expect 529 overloaded_error for a server that is overloaded
            status = OVERLOADED_529 if messages else 503
            return _error_response(request, APIError(status, str(exc), UNAVAILABLE, None, "over_capacity", headers))
        return _error_response(request, APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded",
                                                 headers))

    return {APIError: api_error, Overloaded: overloaded, InstanceUnavailable: instance_down,
            InstanceFailed: instance_down, StarletteHTTPException: http_error, Exception: unexpected}
