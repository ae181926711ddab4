"""One call on an engine group, seen as text: token ids -> detokenized deltas -> stop strings.

The instance speaks token ids only; the gateway turns them into the text a client sees. A
`TextGeneration` drives `group.generate(call)` and yields text that is safe to send. It stops
consuming the instance's stream as soon as a stop string matches, and always closes that stream on
the way out — on a match, an error, or when the consumer is cancelled because the client left — which
is what cancels the call on the instance and frees its KV.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from talaria.contracts.call import CallTimings, FinishReason, InstanceCall, Usage
from talaria.gateway.stop_strings import StopStringMatcher
from talaria.node.errors import CallFailed, InstanceFailed

if TYPE_CHECKING:
    from talaria.models.tokenizer import Tokenizer
    from talaria.node.supervisor import EngineGroup


class TextGeneration:
    """Text deltas of one call; after `text()` is exhausted, `finish_reason` and `usage` are set.

    `finish_reason` stays None when the call did not finish normally (cancelled or failed).
    """

    def __init__(self, group: EngineGroup, call: InstanceCall, tokenizer: Tokenizer,
                 stops: tuple[str, ...], clock: Callable[[], float]) -> None:
        self.group = group
        self.call = call
        self._tokenizer = tokenizer
        self._stops = stops
        self._stop_ids = frozenset(call.sampling.stop_token_ids)  # the model's EOS folded in by parse_request
        self._clock = clock
        self.finish_reason: str | None = None  # "stop" | "length", OpenAI's values
        self.usage: Usage | None = None
        self.completion_tokens = 0
        self.output_ids: list[int] = []  # every generated token, for the session continuity index
        self.reply: list[str] = []  # every text delta sent
        self.stop_sequence: str | None = None  # the stop string that ended the text, if one did
        self.reply_message: dict | None = None  # the assistant message as the client has it (chat), when whole
        self.placement = None  # the router's Placement of this call (talaria.routing.dispatcher)
        self.timings: CallTimings | None = None  # the instance's own account of the call (final record)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    async def text(self) -> AsyncIterator[str]:
        """Yield non-empty text deltas; raise InstanceFailed if the instance fails the call."""
        outputs = self.group.generate(self.call)
        detok = self._tokenizer.detokenizer()
        matcher = StopStringMatcher(self._stops)
        try:
            async for out in outputs:
                ids = out.token_ids
                if ids:
                    if self.first_token_at is None:
                        self.first_token_at = self._clock()
                    self.completion_tokens += len(ids)
                    self.output_ids += ids
                if out.finish is None:
                    safe = matcher.push(detok.push(ids)) if ids else ""
                    if matcher.stopped:  # cached_tokens is unknown here: the final record never comes
                        self.stop_sequence = matcher.matched
                        self._finish("stop", None)
                    if safe:
                        self.reply.append(safe)
                        yield safe
                    if matcher.stopped:
                        return
                    continue
                if out.finish is FinishReason.STOP and ids and ids[-1] in self._stop_ids:
                    ids = ids[:-1]  # the EOS / stop token ends the text; it is not part of it
                elif out.finish not in (FinishReason.STOP, FinishReason.LENGTH):
                    raise CallFailed(out.error or f"the instance ended the call with {out.finish.value!r}")
                safe = matcher.push(detok.push(ids) + detok.flush())
                safe += matcher.flush()
                self.stop_sequence = matcher.matched
                self._finish("stop" if matcher.stopped else out.finish.value, out.usage)
                self.timings = out.timings
                if safe:
                    self.reply.append(safe)
                    yield safe
                return
            raise InstanceFailed("the instance closed the call without a final record")
        finally:
            if self.finished_at is None:
                self.finished_at = self._clock()
            # Closing the instance stream is what cancels the call there. It runs even when this
            # task is being cancelled (client disconnect): asyncio delivers a cancellation once.
            await outputs.aclose()

    def _finish(self, reason: str, usage: Usage | None) -> None:
        self.finished_at = self._clock()
        self.finish_reason = reason
        self.usage = usage or Usage(len(self.call.prompt_token_ids), self.completion_tokens, 0)
