"""Rank 0's memory decisions for each step: the ops every rank performs beside the forward.

It turns the bookkeeping (HostKVRegistry, Stager, BumpLayout, the active model's PageManager)
into MemoryOps and SwitchPlans: host saves to start and, once rank 0's copies are done, to agree on
across TP ranks; restores to run before the forward; the next staging chunk; pages to poison.
No tensors: the simulator can drive it with the same decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from talaria.contracts.kv_layout import KVLayout
from talaria.contracts.step_plan import MemoryOps, SaveOp, SwitchPlan
from talaria.contracts.vocabulary import SwitchPath
from talaria.instance.batcher import Batcher
from talaria.memory.bump_layout import BumpLayout, Region
from talaria.memory.host_kv_registry import (
    HostKVRegistry,
    Kind,
    RankReport,
    agreed_pages,
)
from talaria.memory.page_manager import PageManager
from talaria.memory.stager import GatherPlan, StagedChunk, Stager

SLACK_EVERY_S = 2.0  # staging slack is recomputed this often for telemetry (it scans the KV tail's pages)


class CopyEvents(Protocol):
    """Rank 0's copy engine as the planner sees it: have a ticket's D2H saves or the staging copy in
    flight finished, and block until they have. The substrate answers from its CUDA events (or
    copy-thread futures on CPU), the simulator from virtual time, tests by hand."""

    def save_done(self, ticket: int) -> bool: ...

    def wait_save(self, ticket: int) -> None: ...

    def staging_done(self) -> bool: ...

    def wait_staging(self) -> None: ...


def full_h2d(weight_bytes: int) -> GatherPlan:
    """Open a model entirely from its host image (nothing staged)."""
    image = Region(0, weight_bytes)
    return GatherPlan((), ((image, image),), SwitchPath.H2D_ONLY, 0, 0, weight_bytes)


class MemoryPlanner:
    def __init__(self, layout: BumpLayout, weight_bytes: dict[str, int], page_size: int,
                 host: HostKVRegistry | None, stager: Stager | None, poison: bool, copies: CopyEvents,
                 layouts: dict[str, KVLayout]) -> None:
        """`layouts`: each model's cache layout (its pool's state slots and resume rule)."""
        self.layout = layout
        self.layouts = layouts
        self.weight_bytes = weight_bytes
        self.page_size = page_size
        self.host = host
        self.stager = stager
        self.poison = poison
        self.copies = copies
        self._pending: dict[int, tuple[SaveOp, Batcher]] = {}  # tickets copying, not yet agreed
        self._writing: StagedChunk | None = None
        self._poison: list[int] = []
        self._pool: PageManager | None = None
        self._finished: set[int] = set()  # sequences done on rank 0 whose ledgers may still be needed
        self._slack, self._slack_at = 0, float("-inf")  # staging slack, and when it was computed
        self._no_chunk_at: tuple | None = None  # (pool version, target) when next_chunk last found nothing

    @property
    def busy(self) -> bool:
        """Host saves are waiting for their agreement (and their device pages stay pinned)."""
        return bool(self._pending)

    def finished(self, seq_id: int) -> None:
        """A sequence left the instance: every rank may forget it once its saves are agreed."""
        self._finished.add(seq_id)

    def _forget(self) -> tuple[int, ...]:
        busy = {save.seq_id for save, _ in self._pending.values()}
        done = tuple(s for s in self._finished if s not in busy)
        self._finished.difference_update(done)
        return done

    def new_pool(self, model: str) -> PageManager:
        """A fresh device KV pool (and state slots) for the model being opened, wired to staging and poison."""
        plan = self.layout.plan(model)
        blocked = self.stager.blocked_pages if self.stager is not None else None
        self._pool = PageManager(plan.num_pages, self.page_size, blocked, self._allocated,
                                 self.layouts[model], plan.num_state_slots)
        return self._pool

    def _allocated(self, pages: list[int]) -> None:
        if self.stager is not None:
            self.stager.on_allocate(pages)  # a staged chunk under these pages is dirty now
        if self.poison:
            self._poison += pages  # evicted or dirtied bytes turn NaN before anyone reads them

    def _clean_free(self, pages: range) -> bool:
        """Staging may write pages only if they are free and cache no prefix."""
        return self._pool.all_clean(pages)

    def ops(self, batcher: Batcher, idle: bool = False) -> MemoryOps:
        """The memory ops for the next step; `idle`: the step computes nothing (no chunk planned)."""
        if idle and self._pending and not any(map(self.copies.save_done, self._pending)):
            self.copies.wait_save(next(iter(self._pending)))  # only host copies can make progress: wait
        staged = False
        if self._writing is not None and self.copies.staging_done():
            self.stager.written(self._writing)
            self._writing, staged = None, True
        agree = tuple((t, save.seq_id) for t, (save, _) in self._pending.items() if self.copies.save_done(t))
        saves = self._take_saves(batcher)
        stage = None
        key = (id(self._pool), self._pool.version, self.stager.target_model) \
            if self.stager is not None and self._pool is not None else None
        if self.stager is not None and self._writing is None and self.stager.target_model is not None \
                and key != self._no_chunk_at:  # nothing changed since no chunk could be staged: skip the scan
            self._writing = self.stager.next_chunk(self._clean_free)
            self._no_chunk_at = key if self._writing is None else None
            if self._writing is not None:
                c = self._writing
                stage = (self.stager.target_model, c.src.start, c.src.end, c.dst.start, c.dst.end)
        restores, batcher.restores = tuple(batcher.restores), []
        poison, self._poison = tuple(self._poison), []
        state_copies, state_zero, state_restores = batcher.states.drain()
        return MemoryOps(staged=staged, poison=poison, state_copies=state_copies, state_zero=state_zero,
                         state_restores=state_restores, restores=restores, saves=saves, agree=agree,
                         stage=stage, forget=self._forget())

    def _take_saves(self, batcher: Batcher) -> tuple[SaveOp, ...]:
        saves, batcher.saves = tuple(batcher.saves), []
        for s in saves:
            self._pending[s.ticket] = (s, batcher)
        return saves

    def agreed(self, agree: Sequence[tuple[int, int]], reports: Sequence[Sequence[RankReport]]) -> list[dict]:
        """Publish what every rank agrees on; `reports[r][i]` is rank r's report for agree[i].

        Returns one record per checkpoint for the event log: pages saved and pages published."""
        done = []
        for i, (ticket, seq_id) in enumerate(agree):
            _, batcher = self._pending.pop(ticket)
            ticket_obj = self.host.ticket(ticket)
            ranks = [r[i] for r in reports]
            agreed = agreed_pages(ranks, self.page_size)
            for e in ticket_obj.entries:  # and every rank must hold what the page is published as
                if e.page_index < agreed and any(len(r.chain) <= e.page_index or r.chain[e.page_index] != e.hash
                                                 for r in ranks):
                    agreed = e.page_index
                    break
            self.host.finish_save(ticket_obj, agreed)
            batcher.saved(ticket)
            pages = [e for e in ticket_obj.entries if e.kind is Kind.PAGE]
            record = {"model": ticket_obj.model, "seq_id": seq_id, "pages_saved": len(pages),
                      "pages_published": sum(1 for e in pages if e.page_index < agreed)}
            if len(pages) < len(ticket_obj.entries):  # a state snapshot rode with the pages
                record["states_published"] = sum(1 for e in ticket_obj.entries
                                                 if e.kind is Kind.STATE and e.page_index < agreed)
            done.append(record)
        return done

    def switch_plan(self, to_model: str, outgoing: Batcher | None) -> SwitchPlan:
        """Open `to_model`: the outgoing model's saves start and every pending save is agreed first.
        Snapshots its last step published are taken before them (a save may read one)."""
        saves = self._take_saves(outgoing) if outgoing is not None else ()
        snapshots = outgoing.states.drain_for_switch() if outgoing is not None else ()
        agree = tuple((t, save.seq_id) for t, (save, _) in self._pending.items())
        if self._writing is not None:  # the chunk in flight finishes first and counts as staged
            self.copies.wait_staging()
            self.stager.written(self._writing)
            self._writing = None
        if self.stager is not None and self.stager.target_model == to_model:
            gather = self.stager.gather_plan(Region(0, self.weight_bytes[to_model]))
        else:
            gather = full_h2d(self.weight_bytes[to_model])
        return SwitchPlan(to_model, gather, MemoryOps(state_copies=snapshots, saves=saves, agree=agree))

    def switch_coverage(self, model: str) -> float:
        """How much of `model`'s weights a switch to it would find staged clean: the clean chunks and
        the chunk being written, which the switch waits for (0 when `model` is not being staged)."""
        if self.stager is None or self.stager.target_model != model:
            return 0.0
        return self.stager.coverage(self._writing)

    def switched(self, active: str, next_model: str | None) -> None:
        """After a switch: staging restarts towards the model expected next."""
        self._writing = None
        self.retarget(active, next_model)

    def retarget(self, active: str, next_model: str | None) -> None:
        """Stage `next_model`'s weights from now on (the chunk in flight, if any, finishes first)."""
        if self.stager is None:
            return
        if self._writing is not None:
            self.copies.wait_staging()
            self.stager.written(self._writing)
            self._writing = None
        self.stager.clear()
        if next_model is not None and next_model != active:
            self.stager.target(next_model, self.weight_bytes[next_model], self.layout.plan(active))

    def telemetry(self, now: float | None = None, slack: bool = True) -> dict:
        """Staging and HKVR state for the snapshot. Slack scans the staging chunks' pages, so it is
        recomputed at most every SLACK_EVERY_S of `now` (always when `now` is None), and neither
        computed nor reported with `slack` False (the simulator's heartbeats: its scan is the cost;
        the router then prices no staging shortfall)."""
        out: dict = {}
        if self.stager is not None:
            out.update(staged_model=self.stager.target_model, staging_coverage=self.stager.coverage())
            if slack:
                if now is None or now - self._slack_at >= SLACK_EVERY_S:
                    self._slack = self.stager.slack_bytes(self._clean_free) if self._pool else 0
                    self._slack_at = now if now is not None else self._slack_at
                out["staging_slack_bytes"] = self._slack
        if self.host is not None:
            st = self.host.stats()
            out.update(host_kv_slabs_used=st.used, host_kv_slabs_total=st.num_slabs, host_kv_hits=st.hits)
        return out
