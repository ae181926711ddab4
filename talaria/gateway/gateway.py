"""The HTTP gateway: a Starlette app over a node's engine groups, speaking OpenAI's and Anthropic's APIs.

`create_app(node)` serves `/v1/chat/completions`, `/v1/completions`, OpenAI's `/v1/responses`,
Anthropic's `/v1/messages` (and `/v1/messages/count_tokens`), each streamed as SSE or whole, plus
`/v1/models`, `/health`, `/metrics` and the admin routes, at most `max_connections` requests at once
(`limits`). A completion request is: authorize, read the body under `max_body_bytes` and
`read_timeout_s`, parse (`openai_protocol`, `anthropic_protocol`, `responses_protocol`), place (the
routing `dispatcher` over the session-aware router), then drive the call as text (`generation`),
parse the text into reasoning, content and tool calls (`output_parser`) and format it in the API's
shape (`responses`, `anthropic_responses`, `responses_api`); a call placed on a peer node is
forwarded there (`peer_forward`). Every error leaves as JSON in the API's shape (`http`).

Cancellation is the part to get right: a client that goes away must stop the call on the instance.
Both kinds of response run under `CancelOnDisconnect`, which cancels the request's task on
`http.disconnect`; the generation's `finally` then closes the instance stream. A client that stays
but stops reading is disconnected after `send_timeout_s` (`limits`), and so cancelled the same way.

Latency is the other part: a 1-token completion should cost the gateway well under 2 ms. So the app
is plain Starlette (FastAPI's layers cost ~0.1 ms a call and nothing here used them), small bodies
are parsed on the loop (larger ones on a worker thread, tokenized with the GIL released and from the
conversation's previous prompt when there is one), and a whole response is sent before the call's
bookkeeping (lease, continuity, metrics) runs, with nothing else on the loop in between.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from talaria.contracts.call import InstanceCall
from talaria.gateway.admin import admin_routes
from talaria.gateway.anthropic_protocol import parse_messages
from talaria.gateway.anthropic_responses import MessageFormat
from talaria.gateway.auth import Keys, cache_namespace
from talaria.gateway.errors import SERVER_ERROR, APIError
from talaria.gateway.generation import TextGeneration
from talaria.gateway.http import (
    CLIENT_CLOSED,
    RequestCounter,
    SentThen,
    error_handlers,
    instance_error,
    read_json,
)
from talaria.gateway.limits import ConnectionLimit
from talaria.gateway.metrics import GatewayMetrics
from talaria.gateway.openai_protocol import Endpoint, ParsedRequest, parse_request
from talaria.gateway.output_parser import Content
from talaria.gateway.peer_forward import FORWARDED_HEADER, PeerUnreachable, forward
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.response_store import ResponseStore
from talaria.gateway.responses import ResponseFormat
from talaria.gateway.responses_api import ResponsesFormat
from talaria.gateway.responses_protocol import parse_responses
from talaria.gateway.sse import CancelOnDisconnect, SSEResponse, client_left
from talaria.node.errors import InstanceFailed, InstanceUnavailable
from talaria.routing.decision import RouteRequest
from talaria.routing.dispatcher import Dispatcher, Placement
from talaria.routing.peer_set import PeerSet

if TYPE_CHECKING:
    from talaria.node.node_handle import NodeHandle

log = logging.getLogger(__name__)

MAX_FORWARDS = 3  # a call whose peer could not be reached is placed again, this many times in all
INLINE_PARSE_BYTES = 8192  # smaller bodies are parsed and tokenized on the event loop (well under a ms)
ID_PREFIX = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETIONS: "cmpl-", Endpoint.MESSAGES: "msg_",
             Endpoint.RESPONSES: "resp_"}  # as each API writes them

# every format has: start, event_chunk, end, error_chunk, whole, reply_message
Format = ResponseFormat | MessageFormat | ResponsesFormat


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
        Route("/v1/messages", gateway.messages, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics_page, methods=["GET"]),
        Route("/v1/messages/count_tokens", gateway.count_tokens, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        *admin_routes(gateway, partial(read_json, timeout_s=gateway.config.server.read_timeout_s)),
    ]
    middleware = [Middleware(RequestCounter, metrics=gateway.metrics),  # outermost: it counts the limit's 503s
                  Middleware(ConnectionLimit, limit=gateway.config.server.max_connections)]
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=error_handlers())
    app.state.gateway = gateway
    return app


class Gateway:
    """Per-app state and the route handlers; no module-level state, so apps can coexist."""

    def __init__(self, supervisor: NodeHandle, clock: Callable[[], float],
                 wall_clock: Callable[[], float], new_id: Callable[[], str]) -> None:
        self.supervisor = supervisor
        self.config = supervisor.config
        self.keys = Keys(self.config.server)
        self.dispatcher = Dispatcher(supervisor, self.config.router, clock)
        self.node_id = secrets.token_hex(16)  # on its telemetry answers: a node that finds itself among its peers knows it
        self.peers = PeerSet(self.config.router, self.config.server, self.dispatcher.router, clock,
                             self.dispatcher.peers, self.node_id)
        self.draining = False  # POST /talaria/admin/drain: peers and probes see it leaving (admin.py)
        self.metrics = GatewayMetrics(supervisor.stats, self.dispatcher.router, self.peers, supervisor.events)
        self.prompts = PromptCache()
        self.stored_responses = ResponseStore(clock)  # the Responses API's previous_response_id
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self._started = int(wall_clock())

    async def health(self, request: Request) -> JSONResponse:
        """200 when every engine group is healthy, else 503; the body lists each instance: its state
        (starting, ready, restarting, stopped), calls in flight, restarts and why it last failed. A
        draining node answers 503 "draining": readiness probes take it out of its Service."""
        groups = self.supervisor.groups
        ok = bool(groups) and all(g.healthy for g in groups) and not self.draining
        instances = {g.name: {"healthy": g.healthy, "state": g.state, "in_flight": g.in_flight,
                              "restarts": g.restarts, "last_failure": g.last_failure} for g in groups}
        status = "ok" if ok else "draining" if self.draining else "unavailable"
        return JSONResponse({"status": status, "instances": instances}, status_code=200 if ok else 503)

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

    async def messages(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.MESSAGES)

    async def responses(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.RESPONSES)

    async def count_tokens(self, request: Request) -> JSONResponse:
        """Anthropic's token count: the prompt a Messages request would make, tools and system included."""
        self.authorize(request)
        body = await read_json(request, self.config.server.max_body_bytes, timeout_s=self.config.server.read_timeout_s)
        parsed = await self._parse(request, Endpoint.MESSAGES, body, count_only=True)
        return JSONResponse({"input_tokens": len(parsed.prompt_token_ids)})

    async def _parse(self, request: Request, endpoint: Endpoint, body: Any, count_only: bool = False) -> ParsedRequest:
        header_session = request.headers.get("x-session-id")
        if endpoint is Endpoint.RESPONSES:  # OpenAI's coding agent names its session in `session-id`
            args = (parse_responses, body, self.supervisor, self.stored_responses, self.authorize(request),
                    request.headers.get("session-id") or header_session, self.prompts)
        elif endpoint is Endpoint.MESSAGES:
            args = (parse_messages, body, self.supervisor, self.config.server, header_session, self.prompts, count_only)
        else:
            args = (parse_request, endpoint, body, self.supervisor, header_session, self.prompts)
        if int(request.headers.get("content-length") or INLINE_PARSE_BYTES) < INLINE_PARSE_BYTES:
            return args[0](*args[1:])  # cheaper than a thread hop
        return await asyncio.to_thread(*args)  # tokenizing a 100K-token prompt must not stall the loop

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        arrival, arrival_wall = self._clock(), self._wall_clock()
        request_id = f"{ID_PREFIX[endpoint]}{self._new_id()}"
        request.state.request_id = request_id
        tenant = self.authorize(request)
        body = await read_json(request, self.config.server.max_body_bytes, timeout_s=self.config.server.read_timeout_s)
        parsed = await self._parse(request, endpoint, body)
        namespace = cache_namespace(tenant, parsed.cache_salt)
        session, chain, inferred = self.dispatcher.session(parsed.model, parsed.session_id, parsed.messages,
                                                           parsed.prompt_token_ids, namespace)
        local = request.headers.get(FORWARDED_HEADER) is not None  # a peer sent it: serve it here
        route = RouteRequest(parsed.model, session, len(parsed.prompt_token_ids), parsed.sampling.max_tokens,
                             request_id, tenant)
        place = partial(self.dispatcher.place, route, chain, inferred, parsed.messages is not None,
                        parsed.prompt_token_ids, local, lambda: client_left(request.receive))
        placement = await place()
        for attempt in range(1, MAX_FORWARDS + 1):
            if placement.peer is None:
                break
            try:
                return await forward(placement.peer, request, body, session, self.dispatcher, placement, tenant)
            except PeerUnreachable:  # it never got the call and is out of placement now: placed again
                if attempt == MAX_FORWARDS:
                    raise
                placement = await place()
        group = placement.group
        call = InstanceCall(request_id, parsed.model, parsed.prompt_token_ids, parsed.sampling,
                            session, enqueue_time=arrival, cache_salt=namespace)
        gen = TextGeneration(group, call, self.supervisor.tokenizer(parsed.model), parsed.stop, self._clock)
        gen.placement = placement
        if endpoint is Endpoint.MESSAGES:
            fmt: Format = MessageFormat(request_id, parsed.model, lambda: f"toolu_{self._new_id()[:24]}",
                                        parsed.reasoning_shown)
        elif endpoint is Endpoint.RESPONSES:
            tokenizer = self.supervisor.tokenizer(parsed.model)
            fmt = ResponsesFormat(request_id, int(arrival_wall), parsed.model, parsed.api,
                                  lambda: self._new_id()[:24], lambda text: len(tokenizer.encode(text, False)),
                                  self.stored_responses)
        else:
            fmt = ResponseFormat(endpoint, request_id, int(arrival_wall), parsed.model, parsed.include_usage,
                                 lambda: f"call_{self._new_id()[:24]}")
        log.debug("%s: %s on %s, %d prompt tokens", request_id, parsed.model, group.name, len(call.prompt_token_ids))
        headers = {"x-request-id": request_id}
        if parsed.stream:
            headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
            return SSEResponse(self._stream(gen, fmt, parsed, arrival), headers=headers)
        return await self._whole(request, gen, fmt, parsed, arrival, headers)

    async def _stream(self, gen: TextGeneration, fmt: Format, parsed: ParsedRequest,
                      arrival: float) -> AsyncIterator[bytes]:
        try:
            yield fmt.start(len(parsed.prompt_token_ids))
            parser = parsed.output_parser()
            try:
                async with aclosing(gen.text()) as deltas:
                    async for text in deltas:
                        for event in parser.feed(text) if parser is not None else (Content(text),):
                            yield fmt.event_chunk(event)
                for event in parser.finish() if parser is not None else ():
                    yield fmt.event_chunk(event)
            except (InstanceFailed, InstanceUnavailable) as e:
                yield fmt.error_chunk(instance_error(e, gen.call.request_id))
                return  # the stream ends in error
            except Exception:  # headers are sent: report in-band, keep the traceback in the log
                log.exception("%s: unhandled error mid-stream", gen.call.request_id)
                yield fmt.error_chunk(APIError(500, f"internal server error (request id {gen.call.request_id})",
                                               SERVER_ERROR))
                return
            gen.reply_message = fmt.reply_message()
            yield fmt.end(gen.finish_reason or "stop", gen.usage, gen.stop_sequence)
        finally:
            self._record(gen, parsed, arrival)

    async def _whole(self, request: Request, gen: TextGeneration, fmt: Format,
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
                output = parsed.parse_output(text) if parsed.messages is not None else None
                body = fmt.whole(text, output, gen.finish_reason, gen.usage, gen.stop_sequence)
                gen.reply_message = fmt.reply_message()
                response = SentThen(body, headers, lambda: self._record(gen, parsed, arrival))
        except (InstanceFailed, InstanceUnavailable) as e:
            raise instance_error(e, gen.call.request_id) from None
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
        ttft = gen.first_token_at - arrival if gen.first_token_at is not None else None
        self.dispatcher.finished(placement, gen.usage if normal else None, gen.reply_message, gen.output_ids, ttft)
        if normal:
            self.metrics.observe_call(parsed.model, gen.group.name, arrival, gen.first_token_at, gen.finished_at,
                                      gen.usage)

    def authorize(self, request: Request) -> str:
        """The tenant a `/v1` call is made for (talaria/gateway/auth.py); a 401 without a valid key."""
        return self.keys.tenant(request)
