"""Continuous batching for one model: decode first, then chunked prefill, preemption on KV pressure.

Each step the batcher spends a token budget: one token for every decoding sequence (they are
protected: prefill never delays them), then chunks of prompts still prefilling, then newly admitted
prompts — so a long prompt advances chunk by chunk between decode steps instead of blocking them.
When the KV pool cannot grow a decoding sequence, the newest running sequence is preempted: its
pages are released (their published prefix stays cached) and it is recomputed later from its
prompt plus the tokens it had generated, which greedy decoding reproduces exactly.
"""

from __future__ import annotations

from collections import deque

from talaria.contracts.call import FinishReason
from talaria.contracts.step_plan import SaveOp, SeqChunk, StepPlan
from talaria.instance.sequence import SeqStatus, Sequence
from talaria.memory.host_kv_registry import HostKVRegistry
from talaria.memory.page_manager import PageManager


class Batcher:
    def __init__(self, model: str, pages: PageManager | None, max_batch_tokens: int, max_running: int,
                 max_context: int, eos_token_ids: tuple[int, ...], host: HostKVRegistry | None = None) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.model_context = max_context
        self.host = host  # HKVR: finished and preempted KV is saved to host, admissions restore from it
        self.saves: list[SaveOp] = []  # host checkpoints decided since the last step
        self.restores: list[tuple[int, int]] = []  # (slab, page) restores decided since the last step
        self.pinned_pages: dict[int, list[int]] = {}  # ticket -> device pages its D2H copy reads
        self._restoring: list[int] = []  # host slabs pinned by restores in the current step
        self.restored: list[tuple[Sequence, int]] = []  # (sequence, tokens) restored, for the event log
        self.restored_tokens = 0
        self.pages = pages
        if pages is not None:
            self.resume(pages)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is preempted first
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.lost_tokens = 0  # KV pages computed, lost on preemption (no room on host, or evicted) and recomputed
        self._hashes: dict[int, list[int]] = {}  # seq_id -> cumulative hashes of its full pages

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def resume(self, pages: PageManager) -> None:
        """The model is active with this (fresh) device KV pool."""
        self.pages = pages
        # a sequence may grow until its KV fills the whole pool (others preempted), then it must stop
        self.max_context = min(self.model_context, pages.num_pages * pages.page_size + 1)

    def suspend(self) -> None:
        """The model leaves the device: every running sequence is preempted (its KV saved to host)."""
        for seq in reversed(self.running):
            self._preempt(seq)

    def add(self, seq: Sequence) -> None:
        if self.pages.pages_for(len(seq.token_ids) + 1) > self.pages.num_pages:
            seq.finish = FinishReason.ERROR  # can never fit: fail now rather than wait forever
            seq.status = SeqStatus.FINISHED
            return
        self.waiting.append(seq)

    # ---- planning --------------------------------------------------------------------------

    def plan(self, now: float) -> StepPlan | None:
        """Plain continuous batching (hot instances): decodes, then prefill chunks, then admissions."""
        budget = self.max_batch_tokens
        chunks = self.decode_chunks(budget)
        budget -= len(chunks)
        prefill = self.prefill_chunks([s for s in self.running if s.is_prefilling], budget)
        chunks += prefill
        budget -= sum(len(c.token_ids) for c in prefill)
        while budget > 0 and self.waiting:
            seq = self.waiting[0]
            if not self.admit(seq, now):
                break  # FIFO: a prompt that does not fit yet holds the queue
            chunks.append(self.chunk(seq, budget, admitted=True))
            budget -= len(chunks[-1].token_ids)
        return StepPlan(self.model, tuple(chunks)) if chunks else None

    @property
    def decoding(self) -> list[Sequence]:
        """Running sequences whose prompt is done: one token each per decode step."""
        return [s for s in self.running if not s.is_prefilling]

    def decode_chunks(self, budget: int) -> list[SeqChunk]:
        """One token for every decoding sequence (up to `budget`), preempting the newest on KV pressure."""
        chunks: list[SeqChunk] = []
        planned: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling or len(chunks) == budget:
                continue
            if not self._reserve_slot(seq, planned):
                continue
            chunks.append(self.chunk(seq, 1, decode=True))
            planned.add(seq.seq_id)
        return chunks

    def prefill_chunks(self, seqs: list[Sequence], budget: int) -> list[SeqChunk]:
        """The next prompt chunk of each running, still-prefilling sequence in `seqs`, within `budget` tokens."""
        chunks = []
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING and seq.is_prefilling:
                chunks.append(self.chunk(seq, budget))
                budget -= len(chunks[-1].token_ids)
        return chunks

    def chunk(self, seq: Sequence, budget: int, admitted: bool = False, decode: bool = False) -> SeqChunk:
        """The next `budget` (at most) uncomputed tokens of `seq`; `admitted`: its first chunk since
        admission; `decode`: the generated token fed back (priced as a decode step, not a prefill)."""
        start = seq.num_computed
        n = min(seq.num_uncomputed, budget)
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start:start + n]), start,
                        tuple(seq.page_table), start + n == len(seq.token_ids),
                        tuple(seq.token_ids[:start]) if admitted else (), decode, seq.root)

    def reusable(self, seq: Sequence) -> tuple[int, int]:
        """(device pages, host pages) of `seq`'s prompt prefix this instance holds: no side effects."""
        usable = self._usable(seq)
        on_device = len(self.pages.match_prefix(usable))
        on_host = len(self.host.peek(self.model, usable)) if self.host is not None else 0
        return on_device, max(0, on_host - on_device)

    def _reserve_slot(self, seq: Sequence, planned: set[int]) -> bool:
        """Make room for one more token of a decoding sequence, preempting if needed."""
        if len(seq.token_ids) <= len(seq.page_table) * self.pages.page_size:
            return True
        if self.pages.num_free == 0:
            victims = [s for s in self.running if s.seq_id not in planned and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq or self.pages.num_free == 0:
                # the victim's pages are pinned while its KV goes to host: wait for them, one step,
                # rather than preempting every other sequence too
                return False
        seq.page_table += self.pages.allocate(1)
        return True

    def _usable(self, seq: Sequence) -> list[int]:
        # keep at least one token to compute: the step must produce logits for the next token
        return self._hash_chain(seq)[: (len(seq.token_ids) - 1) // self.pages.page_size]

    def admit(self, seq: Sequence, now: float) -> bool:
        """Take a waiting sequence into the running set: prefix hits, host restores, fresh pages.

        False (and nothing changes) when the pool cannot hold its prompt yet or max_running is reached."""
        if len(self.running) >= self.max_running:
            return False
        usable = self._usable(seq)
        cached = self.pages.match_prefix(usable)
        newly_referenced = sum(1 for p in cached if self.pages.is_free(p))
        need = self.pages.pages_for(len(seq.token_ids)) - len(cached)
        if need + newly_referenced > self.pages.num_free:
            return False
        self.pages.acquire(cached)
        fresh = self.pages.allocate(need)
        slabs = self.host.match(self.model, usable)[len(cached):] if self.host is not None else []
        for i, (slab, page) in enumerate(zip(slabs, fresh)):  # the host holds more of the prefix
            self.restores.append((slab, page))
            self.pages.publish(page, usable[len(cached) + i])
        if slabs:
            self.host.pin(slabs)
            self._restoring += slabs
            self.restored.append((seq, len(slabs) * self.pages.page_size))
        seq.page_table = cached + fresh
        seq.num_computed = (len(cached) + len(slabs)) * self.pages.page_size
        lost = (seq.computed_high // self.pages.page_size) * self.pages.page_size - seq.num_computed
        if lost > 0:  # whole pages it had computed before are neither on device nor on host now
            seq.lost_tokens += lost
            self.lost_tokens += lost
        self.restored_tokens += len(slabs) * self.pages.page_size  # every restore, readmissions too
        if not seq.admitted_once:  # a call's usage counts what its prompt was served from
            seq.num_cached = seq.num_computed
            self.prefix_hit_tokens += seq.num_computed
            seq.num_restored = len(slabs) * self.pages.page_size
            seq.admitted_once = True
        if seq.first_scheduled is None:
            seq.first_scheduled = now
        seq.status = SeqStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        """Return a sequence's pages; with HKVR, first checkpoint its computed full pages to host."""
        full = seq.num_computed // self.pages.page_size
        if self.host is not None and full:
            ticket = self.host.begin_save(self.model, self._hash_chain(seq)[:full])
            if ticket is not None:
                copies = tuple((seq.page_table[e.page_index], e.slab) for e in ticket.entries)
                self.pages.pin([p for p, _ in copies])  # invariant: not reused until the D2H is done
                self.pinned_pages[ticket.ticket_id] = [p for p, _ in copies]
                self.saves.append(SaveOp(ticket.ticket_id, seq.seq_id, copies))
        self.pages.release(seq.page_table)

    def step_done(self) -> None:
        """The step that carried this batcher's restores ran: the host slabs may move again."""
        if self._restoring:
            self.host.unpin(self._restoring)
            self._restoring = []

    def _preempt(self, seq: Sequence) -> None:
        seq.computed_high = max(seq.computed_high, seq.num_computed)
        self._release(seq)
        seq.page_table = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _hash_chain(self, seq: Sequence) -> list[int]:
        return self.pages.extend_chain(self._hashes.setdefault(seq.seq_id, []), seq.token_ids, seq.root)

    # ---- results ---------------------------------------------------------------------------

    def commit(self, plan: StepPlan, sampled: dict[int, int], seqs: dict[int, Sequence]) -> list[Sequence]:
        """Advance sequences by a finished step; returns the ones with news for the gateway."""
        touched = []
        ps = self.pages.page_size
        for chunk in plan.chunks:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # cancelled while the step ran
            seq.num_computed += len(chunk.token_ids)
            if seq.num_computed // ps > 0:
                chain = self._hash_chain(seq)
                for i in range(chunk.start_pos // ps, min(seq.num_computed // ps, len(chain))):
                    self.pages.publish(seq.page_table[i], chain[i])
            if chunk.sample:
                token = sampled[seq.seq_id]
                seq.token_ids.append(token)
                seq.finish = self._finish_reason(seq, token)
                touched.append(seq)
                if seq.finish is not None:
                    self.remove(seq)
        return touched

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sp = seq.sampling
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return FinishReason.STOP
        if seq.num_generated >= sp.max_tokens or len(seq.token_ids) >= self.max_context:
            return FinishReason.LENGTH
        return None

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and release its pages (they stay cached)."""
        if seq.status is SeqStatus.RUNNING:
            seq.page_hashes = tuple(self._hash_chain(seq)[: seq.num_computed // self.pages.page_size])
            self._release(seq)
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.page_table = []
        seq.status = SeqStatus.FINISHED
        self._hashes.pop(seq.seq_id, None)
