"""A Responses API event stream read off the wire and checked for form, for the tests of issue 32.

`stream_events` reads the server-sent events of a streamed `responses.create` as raw text and
validates each one against the `openai` SDK's own types (`ResponseStreamEvent`, a pydantic union
discriminated by `type`): the SDK's `Stream` builds its events with `construct`, which checks
nothing, so a missing field or a wrong literal would pass through it unseen. `check_well_formed`
asserts the sequence's grammar, what a client that assembles the response relies on.
"""

from __future__ import annotations

import json
from typing import Any

import openai
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

EVENT = TypeAdapter(ResponseStreamEvent)

STATUS = {"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}
# per item type: the events between its output_item.added and .done, deltas left out, and the delta
# event's type; a reasoning item carries no events when no summary was asked
SHAPES = {"message": (("response.content_part.added", "response.output_text.done", "response.content_part.done"),
                      "response.output_text.delta"),
          "reasoning": (("response.reasoning_summary_part.added", "response.reasoning_summary_text.done",
                         "response.reasoning_summary_part.done"), "response.reasoning_summary_text.delta"),
          "function_call": (("response.function_call_arguments.done",), "response.function_call_arguments.delta")}


def stream_events(client: openai.OpenAI, **request: Any) -> list[Any]:
    """The events of one streamed `responses.create(**request)`, each validated as the SDK's type;
    every `event:` line names its `data:`'s type."""
    events = []
    with client.responses.with_streaming_response.create(stream=True, **request) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in raw.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name, (name, data["type"])
                events.append(EVENT.validate_python(data))  # raises on a field the SDK's type lacks or rejects
                name = None
            else:
                assert line == "", line
    return events


def check_well_formed(events: list[Any]) -> Response:
    """Assert the stream's grammar and return its last response: sequence numbers 0, 1, ...;
    `response.created` and `response.in_progress` first and one terminal event last (after an `error`
    event when it is `response.failed`, which may leave an item open); items opened
    (`output_item.added`) and closed (`output_item.done`) one at a time in output order, every event
    between them about that item, in its type's order (`SHAPES`), its deltas after its part opens and
    before its text is done; the deltas joined equal the `.done` text, which is the closed item's;
    the closed items are the terminal response's output."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:2]
    assert kinds[-1] in STATUS and not set(kinds[:-1]) & set(STATUS), kinds
    final = events[-1].response
    assert final.status == STATUS[kinds[-1]] and final.id == events[0].response.id == events[1].response.id
    body = events[2:-1]
    if final.status == "failed":  # an error mid-stream: an `error` event, then response.failed, and no more
        assert kinds[-2] == "error" and "error" not in kinds[:-2], kinds
        body = events[2:-2]
    closed: list[Any] = []
    added, inner = None, []
    for e in body:
        if e.type == "response.output_item.added":
            assert added is None and e.output_index == len(closed), "an item opened before the last one closed"
            added, inner = e, []
        elif e.type == "response.output_item.done":
            assert added is not None and e.output_index == len(closed), "an item closed that was not open"
            closed.append(_checked_item(added, inner, e.item))
            added = None
        else:
            assert added is not None, f"{e.type} outside any item"
            inner.append(e)
    assert added is None or final.status == "failed", "an item was never closed"
    assert [i.model_dump() for i in closed] == [o.model_dump() for o in final.output[:len(closed)]]
    assert len(final.output) == len(closed) + (added is not None), "the response's items are not the stream's"
    return final


def _checked_item(added: Any, inner: list[Any], item: Any) -> Any:
    """One item's events (between its added and done) against its type's shape; returns the item."""
    assert added.item.id == item.id and added.item.type == item.type and added.item.status == "in_progress"
    assert all(e.output_index == added.output_index and e.item_id == item.id for e in inner), "another item's event"
    shape, delta = SHAPES[item.type]
    kinds = [e.type for e in inner]
    if item.type == "reasoning" and not kinds:
        assert item.summary == []  # no summary asked: the reasoning streams no text
        return item
    assert [k for k in kinds if k != delta] == list(shape), kinds
    done = kinds.index(shape[-2] if len(shape) == 3 else shape[0])
    first = 1 if len(shape) == 3 else 0
    assert all(first <= i < done for i, k in enumerate(kinds) if k == delta), "a delta outside its part"
    text = "".join(e.delta for e in inner if e.type == delta)
    finished = inner[done]
    whole = finished.arguments if item.type == "function_call" else finished.text
    assert whole == text == _text(item), "the deltas, the .done text and the item disagree"
    if item.type == "function_call":
        assert finished.name == item.name
    return item


def _text(item: Any) -> str:
    """A closed item's whole text: a message's, a call's arguments, a reasoning's summary."""
    if item.type == "message":
        (part,) = item.content
        return part.text
    if item.type == "function_call":
        return item.arguments
    (part,) = item.summary
    return part.text
