"""What one engine step computes: the contract between the scheduler (rank 0) and every runner.

Rank 0 builds a StepPlan and broadcasts it to the other ranks of the engine group; all ranks run
the same forward on their weight shards. Only ints cross this boundary, so it pickles small and the
scheduler stays free of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqChunk:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens whose KV this step computes (a prefill chunk, or 1 to decode)
    start_pos: int  # position of token_ids[0]; KV for [0, start_pos) is already in the pages
    page_table: tuple[int, ...]  # pages covering at least start_pos + len(token_ids) tokens
    sample: bool  # True when this chunk ends at the sequence's newest token: sample the next one
    # on admission after a prefix hit or host restore: the reused tokens [0, start_pos), so every
    # rank's ledger knows the whole prefix it holds (what it reports for the HKVR agreement)
    prefix: tuple[int, ...] = ()
    decode: bool = False  # one generated token fed back (a decode step), not a prompt chunk: how it is priced
    root: int = 0  # where its page-hash chain starts (page_manager.chain_root of its call's salt)
    state_slot: int = -1  # its live per-sequence state in the arena's state region (-1: the layout has none)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    model: str
    chunks: tuple[SeqChunk, ...]
    ops: MemoryOps | None = None  # data movement riding on this step (None: nothing to move)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class StopPlan:
    """Broadcast by rank 0 to end the worker loops cleanly."""


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Checkpoint a sequence's computed pages to host slabs (HKVR), beside serving."""

    ticket: int  # the registry ticket these copies fill
    seq_id: int  # whose KV: every rank reports its own committed prefix of it for the agreement
    copies: tuple[tuple[int, int], ...]  # (device page, host slab)
    states: tuple[tuple[int, int], ...] = ()  # (device state slot, host state slab): a snapshot saved too


@dataclass(frozen=True, slots=True)
class MemoryOps:
    """Data movement riding on a step, in the order every rank performs it."""

    staged: bool = False  # the previous staging copy finished on rank 0: finish it here too
    poison: tuple[int, ...] = ()  # pages freed, evicted or dirtied: NaN them (poison mode)
    # per-sequence states (stateful layouts), before the forward and before the page restores, in
    # this order: copies in list order (a live state into a snapshot slot after a page boundary, a
    # snapshot into the live slot of a sequence resuming from it), then zeroing (a sequence starting
    # from its first token), then host state restores
    state_copies: tuple[tuple[int, int], ...] = ()  # (source slot, destination slot)
    state_zero: tuple[int, ...] = ()  # live slots of sequences that start from the first token
    state_restores: tuple[tuple[int, int], ...] = ()  # (host state slab, device state slot)
    restores: tuple[tuple[int, int], ...] = ()  # (host slab, device page), before the forward
    saves: tuple[SaveOp, ...] = ()  # device -> host, asynchronous
    agree: tuple[tuple[int, int], ...] = ()  # (ticket, seq_id): copies done on rank 0; every rank reports
    stage: tuple[str, int, int, int, int] | None = None  # (model, src0, src1, dst0, dst1): image -> arena
    forget: tuple[int, ...] = ()  # sequences no rank needs to remember any more

    def __bool__(self) -> bool:
        return bool(self.staged or self.poison or self.restores or self.saves or self.agree or self.stage
                    or self.forget or self.state_copies or self.state_zero or self.state_restores)


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """Open another model in the arena (cold instances), after the given memory ops."""

    model: str
    gather: object  # talaria.memory.stager.GatherPlan: D2D for clean staged chunks, H2D for the rest
    ops: MemoryOps = MemoryOps()
