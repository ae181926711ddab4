"""The OpenAI-compatible HTTP gateway: a Starlette app over a supervisor's engine groups.

`create_app(supervisor)` serves `/v1/chat/completions`, `/v1/completions` (streamed as SSE or
whole), `/v1/models`, `/health` and `/metrics`. A completion request is: authorize, read the body
under `max_body_bytes`, parse (`openai_protocol`), place (`dispatch` over the session-aware
`router`), then drive the call as text (`generation`) and format it (`responses`); a call placed on
a peer node is forwarded there (`peers`). Every error leaves as OpenAI's error JSON.

Cancellation is the part to get right: a client that goes away must stop the call on the instance.
Both kinds of response run under `CancelOnDisconnect`, which cancels the request's task on
`http.disconnect`; the generation's `finally` then closes the instance stream.

Latency is the other part: a 1-token completion should cost the gateway well under 2 ms. So the app
is plain Starlette (FastAPI's layers cost ~0.1 ms a call and nothing here used them), small bodies
are parsed on the loop, and a whole response is sent before the call's bookkeeping (lease,
continuity, metrics) runs, with nothing else on the loop in between.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from talaria.contracts.call import InstanceCall
from talaria.gateway.admin import admin_routes
from talaria.gateway.errors import (
    AUTHENTICATION,
    INVALID_REQUEST,
    NOT_FOUND,
    RETRY_AFTER_S,
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
)
from talaria.gateway.generation import TextGeneration
from talaria.gateway.metrics import GatewayMetrics
from talaria.gateway.openai_protocol import Endpoint, ParsedRequest, parse_request
from talaria.gateway.output_parser import parse
from talaria.gateway.peer_forward import FORWARDED_HEADER, forward
from talaria.gateway.responses import DONE, ResponseFormat, sse
from talaria.gateway.sse import CancelOnDisconnect, SSEResponse
from talaria.node.errors import InstanceFailed, InstanceUnavailable
from talaria.routing.decision import RouteRequest
from talaria.routing.dispatcher import Dispatcher, Placement
from talaria.routing.errors import Overloaded
from talaria.routing.peers import PeerLink

if TYPE_CHECKING:
    from talaria.node.node_handle import NodeHandle

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody receives it
COUNTED_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models"}
INLINE_PARSE_BYTES = 8192  # smaller bodies are parsed and tokenized on the event loop (well under a ms)


def create_app(
    supervisor: NodeHandle,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    new_id: Callable[[], str] = lambda: secrets.token_hex(16),  # 128 random bits, as uuid4 (a tenth of its cost)
) -> Starlette:
    """The gateway app. `clock` (monotonic) times latencies and session leases; `wall_clock` stamps
    `created`; `InstanceCall.enqueue_time` is on `clock`, the node's monotonic clock; `new_id` makes request ids."""
    gateway = Gateway(supervisor, clock, wall_clock, new_id)
    routes = [  # matched in order: the hot ones first
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics_page, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        *admin_routes(gateway, _read_json),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(RequestCounter, metrics=gateway.metrics)],
                    exception_handlers=_error_handlers())
    app.state.gateway = gateway
    return app


class Gateway:
    """Per-app state and the route handlers; no module-level state, so apps can coexist."""

    def __init__(self, supervisor: NodeHandle, clock: Callable[[], float],
                 wall_clock: Callable[[], float], new_id: Callable[[], str]) -> None:
        self.supervisor = supervisor
        self.config = supervisor.config
        self.dispatcher = Dispatcher(supervisor, self.config.router, clock)
        self.dispatcher.peers = [PeerLink(p, self.dispatcher.router, clock, self.config.router.heartbeat_s)
                                 for p in self.config.router.peers]
        self.metrics = GatewayMetrics(supervisor.stats, self.dispatcher.router)
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self._started = int(wall_clock())

    async def health(self, request: Request) -> JSONResponse:
        """200 when every engine group is healthy, else 503; the body lists each instance."""
        groups = self.supervisor.groups
        ok = bool(groups) and all(g.healthy for g in groups)
        instances = {g.name: {"healthy": g.healthy, "in_flight": g.in_flight} for g in groups}
        return JSONResponse({"status": "ok" if ok else "unavailable", "instances": instances},
                            status_code=200 if ok else 503)

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self, request: Request) -> JSONResponse:
        self.authorize(request)
        data = [{"id": name, "object": "model", "created": self._started, "owned_by": "talaria",
                 "max_model_len": self.supervisor.arch(name).max_position}
                for name in self.supervisor.model_names()]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.COMPLETIONS)

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        arrival, arrival_wall = self._clock(), self._wall_clock()
        request_id = f"{'chatcmpl' if endpoint is Endpoint.CHAT else 'cmpl'}-{self._new_id()}"
        request.state.request_id = request_id
        self.authorize(request)
        body = await _read_json(request, self.config.server.max_body_bytes)
        header_session = request.headers.get("x-session-id")
        if int(request.headers.get("content-length") or INLINE_PARSE_BYTES) < INLINE_PARSE_BYTES:
            parsed = parse_request(endpoint, body, self.supervisor, header_session)  # cheaper than a thread hop
        else:  # tokenizing a 100K-token prompt must not stall the loop
            parsed = await asyncio.to_thread(parse_request, endpoint, body, self.supervisor, header_session)
        chat = endpoint is Endpoint.CHAT
        session, chain, inferred = self.dispatcher.session(parsed.model, parsed.session_id,
                                                           body.get("messages", ()) if chat else None,
                                                           parsed.prompt_token_ids)
        local = request.headers.get(FORWARDED_HEADER) is not None  # a peer sent it: serve it here
        route = RouteRequest(parsed.model, session, len(parsed.prompt_token_ids), parsed.sampling.max_tokens,
                             request_id)
        placement = await self.dispatcher.place(route, chain, inferred, chat, parsed.prompt_token_ids, local)
        if placement.peer is not None:
            return await forward(placement.peer, request, body, session, self.dispatcher, placement)
        group = placement.group
        call = InstanceCall(request_id, parsed.model, parsed.prompt_token_ids, parsed.sampling,
                            session, enqueue_time=arrival)
        gen = TextGeneration(group, call, self.supervisor.tokenizer(parsed.model), parsed.stop, self._clock)
        gen.placement = placement
        fmt = ResponseFormat(endpoint, request_id, int(arrival_wall), parsed.model, parsed.include_usage,
                             lambda: f"call_{self._new_id()[:24]}")
        log.debug("%s: %s on %s, %d prompt tokens", request_id, parsed.model, group.name, len(call.prompt_token_ids))
        headers = {"x-request-id": request_id}
        if parsed.stream:
            headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
            return SSEResponse(self._stream(gen, fmt, parsed, arrival), headers=headers)
        return await self._whole(request, gen, fmt, parsed, arrival, headers)

    async def _stream(self, gen: TextGeneration, fmt: ResponseFormat, parsed: ParsedRequest,
                      arrival: float) -> AsyncIterator[bytes]:
        try:
            first = fmt.first_chunk()
            if first is not None:
                yield first
            parser = parsed.output_parser()
            try:
                async with aclosing(gen.text()) as deltas:
                    async for text in deltas:
                        if parser is None:
                            yield fmt.text_chunk(text)
                            continue
                        for event in parser.feed(text):
                            yield fmt.event_chunk(event)
                if parser is not None:
                    for event in parser.finish():
                        yield fmt.event_chunk(event)
            except (InstanceFailed, InstanceUnavailable) as e:
                yield sse(_instance_error(e, gen.call.request_id).body())
                return  # no [DONE]: the stream ends in error
            except Exception:  # headers are sent: report in-band, keep the traceback in the log
                log.exception("%s: unhandled error mid-stream", gen.call.request_id)
                yield sse(APIError(500, f"internal server error (request id {gen.call.request_id})",
                                   SERVER_ERROR).body())
                return
            gen.reply_message = fmt.streamed_message()
            yield fmt.finish_chunk(fmt.finish_reason(gen.finish_reason or "stop"))
            if parsed.include_usage and gen.usage is not None:
                yield fmt.usage_chunk(gen.usage)
            yield DONE
        finally:
            self._record(gen, parsed, arrival)

    async def _whole(self, request: Request, gen: TextGeneration, fmt: ResponseFormat,
                     parsed: ParsedRequest, arrival: float, headers: dict[str, str]) -> Response:
        parts: list[str] = []
        response = None
        try:
            async with CancelOnDisconnect(request.receive), aclosing(gen.text()) as deltas:
                async for text in deltas:
                    parts.append(text)
            if gen.finish_reason is not None and gen.usage is not None:
                if gen.timings is not None:  # what the instance spent on the call; the rest is gateway and pipe
                    headers["x-talaria-instance-time"] = f"{gen.timings.service_s:.6f}"
                headers["x-talaria-instance"] = gen.group.name
                text = "".join(parts)
                output = parse(text, parsed.tool_format, parsed.reasoning) if parsed.output_parser() else None
                body = fmt.whole(text, gen.finish_reason, gen.usage, output)
                if parsed.endpoint is Endpoint.CHAT:
                    gen.reply_message = body["choices"][0]["message"]
                response = _SentThen(body, headers, lambda: self._record(gen, parsed, arrival))
        except (InstanceFailed, InstanceUnavailable) as e:
            raise _instance_error(e, gen.call.request_id) from None
        finally:
            if response is None:  # failed, or the client left: release the call's routing state now
                self._record(gen, parsed, arrival)
        if response is None:
            log.info("%s: client disconnected; call cancelled", gen.call.request_id)
            return Response(status_code=CLIENT_CLOSED)
        return response

    def _record(self, gen: TextGeneration, parsed: ParsedRequest, arrival: float) -> None:
        """Routing state for every call that ends; metrics and the session's lease for normal ends."""
        normal = gen.finish_reason is not None and gen.usage is not None and gen.finished_at is not None
        placement: Placement = gen.placement
        self.dispatcher.finished(placement, gen.usage if normal else None, gen.reply_message, gen.output_ids)
        if normal:
            self.metrics.observe_call(parsed.model, gen.group.name, arrival, gen.first_token_at, gen.finished_at,
                                      gen.usage)

    def authorize(self, request: Request) -> None:
        key = self.config.server.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           AUTHENTICATION, None, "missing_api_key", {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", AUTHENTICATION, None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})


class _SentThen(JSONResponse):
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


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing more than `limit` bytes whatever Content-Length claims."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError.invalid("Content-Length must be a non-negative integer")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "client closed the request") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError.invalid("the request body is empty; send a JSON object")
    try:
        return _JSON.decode(raw.decode())  # JSON is UTF-8 (RFC 8259)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise APIError.invalid(f"the request body is not valid JSON: {e}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


# built once: json.loads and json.dumps with options build a decoder or an encoder per call
_JSON = json.JSONDecoder(parse_constant=_reject_constant)
_JSON_OUT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (server.max_body_bytes)", INVALID_REQUEST,
                    None, "request_too_large")


def _instance_error(e: Exception, request_id: str) -> APIError:
    if isinstance(e, InstanceUnavailable):
        log.info("%s: 503: %s", request_id, e)
        return APIError(503, str(e), UNAVAILABLE, None, "instance_unavailable",
                        {"Retry-After": str(RETRY_AFTER_S)})
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
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _error_handlers() -> dict:
    """Every failure, Starlette's own 404 and 405 included, as OpenAI-shaped JSON."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(request, exc)

    async def instance_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(request, _instance_error(exc, getattr(request.state, "request_id", "-")))

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
        return _error_response(request, APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded",
                                                 {"Retry-After": str(exc.retry_after_s)}))

    return {APIError: api_error, Overloaded: overloaded, InstanceUnavailable: instance_error,
            InstanceFailed: instance_error, StarletteHTTPException: http_error, Exception: unexpected}
