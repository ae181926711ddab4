"""Per-sequence state moves of a stateful cache, as one batcher decides them between two steps.

A model whose cache keeps a per-sequence state (Gated DeltaNet's `conv` and `ssm`) resumes only from
a published snapshot (talaria/contracts/kv_layout.py). The batcher decides, between two steps, which
live state slot each admitted sequence takes and how it is filled — a device snapshot copied in, a
host state slab restored, or zeros — and which snapshots a finished chunk publishes. The next step
carries them (`MemoryOps.state_copies`, `state_zero`, `state_restores`, in that order) and this
object holds the pins that keep their sources in place until it has run. No tensors: ints only.
"""

from __future__ import annotations

from talaria.instance.sequence import Sequence
from talaria.memory.host_kv_registry import HostKVRegistry, Kind
from talaria.memory.page_manager import PageManager


def snapshot_at(pages: PageManager, host: HostKVRegistry | None, model: str, h: int) -> tuple[bool, int] | None:
    """Where the state snapshot after the page hashed `h` is: (True, a device slot) first, else
    (False, a host state slab); None when neither holds one."""
    slot = pages.snapshot(h)
    if slot is not None:
        return True, slot
    slab = host.state(model, h) if host is not None else None
    return (False, slab) if slab is not None else None


class StateOpsError(RuntimeError):
    """The state moves were asked for something their bookkeeping says cannot be (a bug, not input)."""


class StateOps:
    def __init__(self, model: str, host: HostKVRegistry | None) -> None:
        self.model = model
        self.host = host
        self.copies: list[tuple[int, int]] = []  # (slot, slot): snapshots taken, then snapshots loaded
        self.zero: list[int] = []  # live slots of sequences starting from their first token
        self.restores: list[tuple[int, int]] = []  # (host state slab, live slot)
        self._host_pins: list[int] = []  # host state slabs being restored
        self._device_pins: list[int] = []  # device snapshots being copied into live slots

    def take(self, pages: PageManager, seq: Sequence, resume_hash: int | None, from_host: bool = True) -> bool:
        """A live state slot for `seq`, loaded from the snapshot it resumes from (after the page
        hashed `resume_hash`; on the device, or on host when `from_host`), or zeroed when it starts
        from its first token; False (nothing changed) when every slot is live or being copied."""
        host = self.host if from_host else None
        where = snapshot_at(pages, host, self.model, resume_hash) if resume_hash is not None else None
        if resume_hash is not None and where is None:
            raise StateOpsError(f"model {self.model!r}: a sequence resumes after page {resume_hash:#x}, "
                                "which has no state snapshot")
        on_device = where is not None and where[0]
        if on_device:
            pages.pin_state(where[1])  # first: taking a slot must not evict the snapshot it loads
        if pages.states_free == 0:
            if on_device:
                pages.unpin_state(where[1])
            return False
        seq.state_slot = slot = pages.take_state()
        if where is None:
            self.zero.append(slot)
        elif on_device:
            self.copies.append((where[1], slot))
            self._device_pins.append(where[1])
        else:
            self.restores.append((where[1], slot))
            self.host.pin([where[1]], Kind.STATE)
            self._host_pins.append(where[1])
        return True

    def publish(self, pages: PageManager, seq: Sequence, h: int) -> None:
        """`seq`'s live state is at the end of the page hashed `h`: publish a snapshot of it (the
        copy rides the next step, before anything else can use either slot)."""
        slot = pages.publish_snapshot(h)
        if slot is not None:
            self.copies.append((seq.state_slot, slot))

    def drain(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
        """(copies, zero, restores) decided since the last drain, for the next step's MemoryOps."""
        out = (tuple(self.copies), tuple(self.zero), tuple(self.restores))
        self.copies, self.zero, self.restores = [], [], []
        return out

    def drain_for_switch(self) -> tuple[tuple[int, int], ...]:
        """The snapshot copies a switch away must run before its saves. No admission can be pending
        then (each step drains its own), and the pins of one would outlive the pool they are in."""
        copies, zero, restores = self.drain()
        if zero or restores or self._host_pins or self._device_pins:
            raise StateOpsError(f"model {self.model!r}: a switch away with admissions pending "
                                f"(zero {zero}, restores {restores})")
        return copies

    def step_done(self, pages: PageManager) -> None:
        """The step that carried the moves ran: the host slabs and snapshots they read may move again."""
        if self._host_pins:
            self.host.unpin(self._host_pins, Kind.STATE)
            self._host_pins = []
        for slot in self._device_pins:
            pages.unpin_state(slot)
        self._device_pins = []
