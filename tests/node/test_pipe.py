"""The supervisor uses rank 0's pipe without ever blocking. Reads: whole messages, in order, whatever
sizes and however the bytes arrive, and nothing from a message whose tail has not arrived yet.
Writes: queued when rank 0 is not reading, never waiting for it, and read back by rank 0's
multiprocessing Connection whole and in order once it does."""

import multiprocessing as mp
import pickle
import socket
import struct

import pytest

from talaria.node.pipe import Pipe


def test_messages_of_any_size_arrive_whole_and_in_order():
    ours, theirs = mp.Pipe()
    pipe = Pipe(ours.fileno())
    sent = [[1, "a"], b"x" * 100_000, {"k": list(range(5000))}]  # 100 KB: header and body written apart
    for obj in sent:
        theirs.send(obj)
    got = []
    for _ in range(100):  # a local socket has every byte once send returns; a few reads at most
        got += [pickle.loads(b) for b in pipe.read()]
        if len(got) >= len(sent):
            break
    assert got == sent
    assert pipe.read() == []  # nothing more, and no wait for it
    theirs.close()
    assert pipe.read() is None  # rank 0's end closed
    pipe.close()
    ours.close()


PAYLOAD = pickle.dumps("the whole message")
SHORT = struct.pack("!i", len(PAYLOAD)) + PAYLOAD
LONG = struct.pack("!i", -1) + struct.pack("!Q", len(PAYLOAD)) + PAYLOAD  # the framing above 2 GiB
STREAM = SHORT + LONG


@pytest.mark.parametrize("cut", [2, len(SHORT) - 1, len(SHORT), len(SHORT) + 7, len(STREAM) - 1])
def test_a_message_is_delivered_once_its_last_byte_is_in(cut):
    ours, theirs = socket.socketpair()
    pipe = Pipe(ours.fileno())
    theirs.sendall(STREAM[:cut])
    first = pipe.read()
    theirs.sendall(STREAM[cut:])
    rest = pipe.read()
    assert len(first) == (cut >= len(SHORT))
    assert [pickle.loads(b) for b in first + rest] == ["the whole message"] * 2
    for s in (pipe, ours, theirs):
        s.close()


def test_writes_never_block_and_arrive_whole_in_order_once_rank_0_reads():
    ours, theirs = mp.Pipe()
    pipe = Pipe(ours.fileno())
    sent = [("call", i, list(range(2000))) for i in range(200)]  # ~1 MB: far beyond the socket's buffer
    backed_up = [pipe.queue(m) for m in sent]  # rank 0 reads nothing meanwhile: a blocking send would hang
    assert backed_up[-1] and pipe.pending > 0
    got = []
    while len(got) < len(sent):
        pipe.flush()
        while theirs.poll(0):
            got.append(theirs.recv())
    assert got == sent and not pipe.flush() and pipe.pending == 0
    pipe.close()
    ours.close()
    theirs.close()
