"""The supervisor's end of rank 0's pipe, used without ever blocking the event loop.

Both directions speak multiprocessing.Connection's framing, so rank 0 keeps a plain Connection:
a 4-byte big-endian length, then the pickled message; above 2 GiB, -1 there and then an 8-byte
length. Reads take what has arrived and cut whole messages from it; writes go out as far as the
socket takes them and queue the rest for the event loop to flush when it is writable. A rank 0
that stops reading (a long step, SIGSTOP) or stops halfway through a message stalls only its own
calls, never the gateway.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from collections import deque


class Pipe:
    """Our end of rank 0's pipe, used without ever blocking the event loop. Reads take what has
    arrived and cut whole messages from it by multiprocessing.Connection's framing (a 4-byte
    big-endian length; above 2 GiB, -1 there and then an 8-byte one); writes frame the same way,
    go out as far as the socket takes them and queue the rest until it is writable again."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self._buf = bytearray()
        self._out: deque[memoryview] = deque()

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[bytes] | None:
        """The messages completed by what has arrived; None once rank 0's end is closed."""
        try:
            chunk = self._sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not chunk:
            return None
        buf = self._buf
        buf += chunk
        frames = []
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!i", buf)
            start = 4
            if size == -1:
                if len(buf) < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, 4)
                start = 12
            if len(buf) < start + size:
                break
            frames.append(bytes(buf[start:start + size]))
            del buf[:start + size]
        return frames

    @property
    def pending(self) -> int:
        """Bytes queued for rank 0 and not yet taken by the socket."""
        return sum(len(m) for m in self._out)

    def queue(self, msg: object) -> bool:
        """Frame `msg` for rank 0 and send what the socket takes now; True if some stays queued
        (the caller then flushes when the socket is writable)."""
        payload = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
        n = len(payload)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        self._out.append(memoryview(header + payload))
        return self.flush()

    def flush(self) -> bool:
        """Send queued bytes until the socket would block; True while some are left. Raises
        OSError when rank 0's end is gone (the monitor reports the death)."""
        out = self._out
        while out:
            try:
                sent = self._sock.send(out[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            if sent < len(out[0]):
                out[0] = out[0][sent:]
            else:
                out.popleft()
        return False

    def close(self) -> None:
        self._out.clear()
        self._sock.close()
