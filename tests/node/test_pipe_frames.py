"""The supervisor reads rank 0's pipe without blocking: whole messages, in order, whatever sizes
and however the bytes arrive, and nothing from a message whose tail has not arrived yet."""

import multiprocessing as mp
import pickle
import socket
import struct

import pytest

from talaria.node.engine_group import _Frames


def test_messages_of_any_size_arrive_whole_and_in_order():
    ours, theirs = mp.Pipe()
    frames = _Frames(ours.fileno())
    sent = [[1, "a"], b"x" * 100_000, {"k": list(range(5000))}]  # 100 KB: header and body written apart
    for obj in sent:
        theirs.send(obj)
    got = []
    for _ in range(100):  # a local socket has every byte once send returns; a few reads at most
        got += [pickle.loads(b) for b in frames.read()]
        if len(got) >= len(sent):
            break
    assert got == sent
    assert frames.read() == []  # nothing more, and no wait for it
    theirs.close()
    assert frames.read() is None  # rank 0's end closed
    frames.close()
    ours.close()


PAYLOAD = pickle.dumps("the whole message")
SHORT = struct.pack("!i", len(PAYLOAD)) + PAYLOAD
LONG = struct.pack("!i", -1) + struct.pack("!Q", len(PAYLOAD)) + PAYLOAD  # the framing above 2 GiB
STREAM = SHORT + LONG


@pytest.mark.parametrize("cut", [2, len(SHORT) - 1, len(SHORT), len(SHORT) + 7, len(STREAM) - 1])
def test_a_message_is_delivered_once_its_last_byte_is_in(cut):
    ours, theirs = socket.socketpair()
    frames = _Frames(ours.fileno())
    theirs.sendall(STREAM[:cut])
    first = frames.read()
    theirs.sendall(STREAM[cut:])
    rest = frames.read()
    assert len(first) == (cut >= len(SHORT))
    assert [pickle.loads(b) for b in first + rest] == ["the whole message"] * 2
    for s in (frames, ours, theirs):
        s.close()
