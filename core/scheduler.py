"""Continuous batching under a per-step token budget, with chunked prefill and preemption by
recompute or by swapping to a host pool."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagechat.core.blocks import BlockManager
from pagechat.core.sequence import Sequence, Status
from pagechat.core.swap import HostBlocks


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + count) of its token_ids."""

    seq: Sequence
    start: int
    count: int
    draft: list[int] = field(
        default_factory=list
    )  # speculative tokens fed after the chunk (not in token_ids)
    lookahead: int = 0  # extra slots reserved for drafted tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick a token."""
        return self.start + self.count == len(self.seq.token_ids)


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """One sequence's KV to copy: out (device block, host block) or in (host block, device
    block)."""

    seq: Sequence
    direction: str  # "out" | "in"
    pairs: list[tuple[int, int]]


@dataclass(slots=True)
class Batch:
    """What one engine step runs, and what the scheduler did to make room for it."""

    items: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block pairs
    preempted: list[Sequence] = field(default_factory=list)
    swaps: list[SwapPlan] = field(default_factory=list)  # copies out before any copy in
    failed: list[Sequence] = field(default_factory=list)  # can never fit the pool; error set
    prefix_hit_tokens: int = 0  # prompt tokens that admissions found in the prefix cache


class Scheduler:
    """Admits waiting sequences and advances running ones, oldest first, within the step's
    limits."""

    def __init__(
        self,
        blocks: BlockManager,
        max_batch_tokens: int,
        max_seqs: int,
        host: HostBlocks | None = None,
    ) -> None:
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.host = host  # preempt by swapping into this host pool; None: by recompute
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # oldest first, resumed before any admission
        # Grouped sequences freed while they had nothing to compute, to let others in: out of every
        # queue until their group gives them their next token (resume).
        self.idle: list[Sequence] = []
        self.ended: list[Sequence] = []  # finished since take_ended()

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue seq behind the waiting sequences of its priority and the more urgent ones; front:
        before those of its own priority (a preempted sequence goes first again)."""
        at = next(
            (
                i
                for i, s in enumerate(self.waiting)
                if s.priority > seq.priority or front and s.priority == seq.priority
            ),
            len(self.waiting),
        )
        self.waiting.insert(at, seq)

    def run(self, seq: Sequence) -> None:
        """Take a fork into the running batch: it holds its parent's blocks (shared) already."""
        self.running.append(seq)

    def take_ended(self) -> list[Sequence]:
        """The sequences finished since the last call."""
        ended, self.ended = self.ended, []
        return ended

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.idle)

    def schedule(self, lookahead: int = 0) -> Batch:
        """Pick this step's chunks: running sequences first (decodes, unfinished prefills), then new
        ones. lookahead > 0 (speculation) reserves that many extra slots for each decoding sequence,
        where blocks allow without preempting anyone."""
        batch, budget = Batch(), self.max_batch_tokens
        if self._yield_to_urgent(batch):  # admitted first, whatever else must wait
            budget = self._admit_waiting(batch, budget, most=1)
        urgent = len(batch.preempted)
        budget = self._continue_running(batch, budget, lookahead)
        # Resume or admit only when nothing had to be preempted: memory is tight otherwise.
        if len(batch.preempted) == urgent:
            budget = self._swap_in(batch, budget)
            if not self.swapped:
                self._admit_waiting(batch, budget)
        return batch

    def _yield_to_urgent(self, batch: Batch) -> bool:
        """Whether the first waiting sequence is more urgent than one running or swapped (the
        app's chat under its background load); if so, preempt the less urgent running ones,
        least urgent and newest first, until it fits."""
        head = self.waiting[0] if self.waiting else None
        if head is None or all(s.priority <= head.priority for s in self.running + [*self.swapped]):
            return False
        while not self.blocks.can_allocate(head.token_ids):
            lesser = [s for s in self.running if s.priority > head.priority]
            if not lesser:
                break
            self.preempt(max(reversed(lesser), key=lambda s: s.priority), batch)
        return True

    def _swap_in(self, batch: Batch, budget: int) -> int:
        """Resume swapped-out sequences, oldest first, while blocks and limits allow; the budget
        left."""
        while self.swapped and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_swap_in(len(seq.token_ids)):
                break
            self.swapped.popleft()
            table = self.blocks.swap_in(seq.seq_id, seq.num_computed)
            host = self.host.give_back(seq.seq_id)
            batch.swaps.append(SwapPlan(seq, "in", list(zip(host, table))))
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._make_room(seq, batch)  # cannot fail: room for all its tokens was checked
            count = min(len(seq.token_ids) - seq.num_computed, budget)
            batch.items.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count
        return budget

    def _continue_running(self, batch: Batch, budget: int, lookahead: int) -> int:
        """Schedule every running sequence the budget allows, the most urgent first, oldest first
        among equals: a victim (the least urgent, newest) is never one already scheduled."""
        admitted = {id(it.seq) for it in batch.items}  # this step's urgent admission
        for seq in sorted(self.running, key=lambda s: s.priority):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or seq.num_computed == len(seq.token_ids):
                continue  # preempted to make room for another; or grouped, awaiting its token
            if id(seq) in admitted:
                continue
            decoding = len(seq.token_ids) - seq.num_computed == 1
            # a grouped sequence's next token is its group's pick: nothing to draft
            extra = min(lookahead, budget - 1) if decoding and not seq.grouped else 0
            need = len(seq.token_ids) + extra - self.blocks.length(seq.seq_id)
            if extra and need > 0 and not self.blocks.can_append(seq.seq_id, need):
                extra = 0  # speculation never preempts anyone: decode this one plainly
            if not self._make_room(seq, batch, extra):
                continue  # seq itself was preempted or failed
            count = min(len(seq.token_ids) - seq.num_computed, budget)
            batch.items.append(ScheduledSeq(seq, seq.num_computed, count, lookahead=extra))
            budget -= count + extra
        return budget

    def _admit_waiting(self, batch: Batch, budget: int, most: int | None = None) -> int:
        """Admit waiting sequences (at most `most`), the most urgent first and oldest among
        equals, while the budget, max_seqs and free blocks allow; the budget left."""
        admitted = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            if most is not None and admitted >= most:
                break
            seq = self.waiting[0]
            if self.blocks.blocks_needed(len(seq.token_ids) + 1) > self.blocks.num_blocks:
                self.waiting.popleft()
                self._fail(
                    seq,
                    batch,
                    f"the request needs {len(seq.token_ids) + 1} tokens of KV but the whole pool "
                    f"holds {self.blocks.num_blocks * self.blocks.block_size}; raise --kv-blocks "
                    "or --kv-memory",
                )
                continue
            if not self.blocks.can_allocate(seq.token_ids):
                if self._free_idle(batch):
                    continue
                break
            self.waiting.popleft()
            hit = self.blocks.allocate(seq.seq_id, seq.token_ids)
            seq.num_computed, seq.status = hit, Status.RUNNING
            seq.num_cached_tokens += hit
            batch.prefix_hit_tokens += hit
            self.running.append(seq)
            count = min(len(seq.token_ids) - hit, budget)
            batch.items.append(ScheduledSeq(seq, hit, count))
            budget -= count
            admitted += 1
        return budget

    def _free_idle(self, batch: Batch) -> bool:
        """Free the newest running sequence that has nothing to compute (a grouped one whose
        logits wait for its group's pick), so a waiting one can come in: without this, a group
        holding the pool while its other members wait would wait for itself forever. False when
        there is none."""
        idle = [s for s in self.running if s.num_computed == len(s.token_ids)]
        if not idle:
            return False
        seq = idle[-1]
        self.running.remove(seq)
        self.blocks.free(seq.seq_id, seq.token_ids, seq.num_computed)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        self.idle.append(seq)
        return True

    def resume(self, seq: Sequence) -> None:
        """A grouped sequence got its next token: freed while idle, it waits, first in line, to be
        computed again (a running one simply runs on)."""
        if seq in self.idle:
            self.idle.remove(seq)
            self.add(seq, front=True)

    def _make_room(self, seq: Sequence, batch: Batch, extra: int = 0) -> bool:
        """Reserve slots for seq's new tokens (+ extra), preempting the newest sequences if blocks
        run out."""
        missing = len(seq.token_ids) + extra - self.blocks.length(seq.seq_id)
        if missing <= 0:
            return True
        while not self.blocks.can_append(seq.seq_id, missing):
            if self.running == [seq]:
                self._fail(
                    seq,
                    batch,
                    f"the KV pool ({self.blocks.num_blocks} blocks of {self.blocks.block_size} "
                    "tokens) is full with this request alone; raise --kv-blocks or --kv-memory",
                )
                return False
            victim = self._victim(seq, batch)
            self.preempt(victim, batch)
            if victim is seq:
                return False
        batch.copies += self.blocks.append(seq.seq_id, missing)
        return True

    def _victim(self, seq: Sequence, batch: Batch) -> Sequence:
        """Whom to preempt for seq: the least urgent running sequence, newest first, that this
        step has not scheduled yet (seq itself at worst)."""
        done = {id(it.seq) for it in batch.items}
        free_to_go = [s for s in self.running if id(s) not in done]
        return max(reversed(free_to_go), key=lambda s: s.priority)

    def preempt(self, seq: Sequence, batch: Batch) -> None:
        """Free seq's blocks: its KV goes to the host pool when swapping can hold it (resumed
        first), else it goes to the front of the queue and is recomputed when readmitted."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        if self._can_swap(seq):
            device = self.blocks.swap_out(seq.seq_id, seq.token_ids, seq.num_computed)
            host = self.host.take(seq.seq_id, len(device))
            batch.swaps.append(SwapPlan(seq, "out", list(zip(device, host))))
            seq.status = Status.SWAPPED
            self.swapped.appendleft(seq)
            return
        self.blocks.free(seq.seq_id, seq.token_ids, seq.num_computed)
        seq.status, seq.num_computed = Status.WAITING, 0
        self.add(seq, front=True)

    def _can_swap(self, seq: Sequence) -> bool:
        """Swapping is on, the host pool has room, and seq is not grouped (a group's members are
        picked together, so one is recomputed)."""
        return (
            self.host is not None
            and seq.num_computed > 0
            and not seq.grouped
            and self.host.num_free() >= self.blocks.blocks_needed(seq.num_computed)
        )

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and free its blocks without finishing it (a
        group's first member, once the others have forked from it)."""
        if seq in self.idle:
            self.idle.remove(seq)
            return
        self.running.remove(seq)
        self.blocks.free(seq.seq_id, seq.token_ids, seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id, seq.token_ids, seq.num_computed)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.host.give_back(seq.seq_id)
        elif seq in self.idle:
            self.idle.remove(seq)
        seq.status = Status.FINISHED
        self.ended.append(seq)

    def _fail(self, seq: Sequence, batch: Batch, message: str) -> None:
        self.finish(seq)
        seq.finish_reason, seq.error = "error", message
        batch.failed.append(seq)
