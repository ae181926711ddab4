"""The node's event log numbers events in arrival order, keeps the recent ones for late readers,
writes JSONL when asked, and never lets a slow reader hold the node back."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from talaria.contracts.events import Event, EventKind
from talaria.node.event_log import SUBSCRIBER_QUEUE, EventLog


def ev(i: int) -> Event:
    return Event(float(i), "cold-0", EventKind.SWITCH, {"to_model": f"m{i}"})


def test_numbering_ring_and_since(tmp_path):
    log = EventLog(capacity=3, path=tmp_path / "events.jsonl")
    log.append([ev(1), ev(2)])
    log.append([ev(3), ev(4)])
    assert [e.seq for e in log.since(0)] == [2, 3, 4]  # the ring keeps the newest three
    assert [e.data["to_model"] for e in log.since(3)] == ["m4"]
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(d["seq"], d["kind"], d["to_model"]) for d in lines] == [(i, "switch", f"m{i}") for i in range(1, 5)]
    assert lines[0]["t"] == 1.0 and lines[0]["instance"] == "cold-0"


def test_follow_replays_then_streams_live_without_gaps_or_repeats():
    async def scenario():
        log = EventLog()
        log.append([ev(1), ev(2)])
        got = []

        async def reader():
            async for e in log.follow(since=1):
                got.append(e.seq)
                if e.seq == 4:
                    return
        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader subscribes and replays
        log.append([ev(3), ev(4)])
        await asyncio.wait_for(task, 5)
        return got
    assert asyncio.run(scenario()) == [2, 3, 4]


def test_a_slow_reader_loses_its_oldest_events_and_never_blocks_the_node():
    async def scenario():
        log = EventLog(capacity=10)
        stream = log.follow()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # subscribed, waiting for the first live event
        log.append([ev(i) for i in range(SUBSCRIBER_QUEUE + 5)])  # returns at once: no reader blocks it
        head = await first
        rest = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        return head.seq, [e.seq for e in rest]
    head, rest = asyncio.run(scenario())
    assert head == 6 and rest == [7, 8, 9]  # the 5 oldest were dropped for this reader


def test_data_never_shadows_the_envelope():
    log = EventLog()
    log.append([Event(2.5, "hot-0", EventKind.KV_CHECKPOINT, {"seq": 99, "kind": "x", "pages_saved": 3})])
    line = json.loads(log.since(0)[0].to_json())
    assert (line["seq"], line["kind"], line["t"], line["pages_saved"]) == (1, "kv_checkpoint", 2.5, 3)


def test_a_full_disk_turns_the_file_off_once_and_the_log_goes_on(caplog):
    log = EventLog(capacity=10, path=Path("/dev/full"))  # every write fails with ENOSPC, as on a full disk
    with caplog.at_level(logging.ERROR, logger="talaria.node"):
        log.append([ev(1)])
        log.append([ev(2), ev(3)])
    assert [e.seq for e in log.since(0)] == [1, 2, 3]  # numbered and kept all the same
    failures = [r for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(failures) == 1 and "No space left" in failures[0].getMessage()
    log.close()


def test_a_tap_sees_every_event_numbered_and_one_that_fails_costs_the_log_nothing(caplog):
    log = EventLog(capacity=10)
    seen = []

    def broken(e: Event) -> None:
        raise RuntimeError("a bug in a counter")
    log.tap(broken)
    log.tap(seen.append)
    with caplog.at_level(logging.ERROR, logger="talaria.node"):
        log.append([ev(1), ev(2)])
    assert [(e.seq, e.data["to_model"]) for e in seen] == [(1, "m1"), (2, "m2")]
    assert [e.seq for e in log.since(0)] == [1, 2]
    assert "a tap failed on a switch event" in caplog.text
