"""The engine's own thread: it alone touches the Engine. It takes submissions and aborts from a
thread-safe inbox, steps while there is work, and hands each step's deltas to the event loop in
one call (loop.call_soon_threadsafe), so HTTP handlers never wait on a step.

State per request lives here only while the request runs: a Route per sequence (a choice) and a
_Pending per submission, both dropped when it finishes or is aborted."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace

from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.memory import read_memory
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport, TokenOutput
from pagechat.core.sampler import SampleRecord
from pagechat.core.sequence import Sequence, Status
from pagechat.core.wire import MEMORY_EVERY_S
from pagechat.server.logprobs import token_logprob
from pagechat.server.messages import ChoiceDelta, ChoiceUsage, Submission
from pagechat.server.metrics import ServerMetrics
from pagechat.server.watch import Watchers

log = logging.getLogger("pagechat.server")


@dataclass(slots=True, eq=False)
class _Abort:
    sub: Submission


@dataclass(slots=True, eq=False)
class _Pending:
    """A submission whose choices are not all finished."""

    sub: Submission
    open: int  # choices not finished yet
    seq_ids: list[int]  # its sequences: the prompt's, then each forked sample's as it appears
    scheduled: bool = False  # its prompt was first scheduled (queue time observed)


@dataclass(slots=True, eq=False)
class _Route:
    """Where one sequence's outputs go: its submission and choice index."""

    pending: _Pending
    index: int
    root: bool  # the submission's own sequence (not a forked sample)
    last_output: float | None = None


_STOP = object()
WATCHED_CANDIDATES = SamplingParams().num_candidates  # as many as the app's own requests record


class EngineLoop:
    """Runs one Engine on a background thread for the server's event loop."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, watchers: Watchers) -> None:
        self.engine, self.metrics, self.watchers = engine, metrics, watchers
        self._read_at = 0.0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}  # root request id -> its submission
        self._routes: dict[int, _Route] = {}  # sequence id -> where its outputs go
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the thread stopped, if it failed

    # -- the event loop's side -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="pagechat-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, sub: Submission) -> None:
        self._inbox.put(sub)

    def abort(self, sub: Submission) -> None:
        self._inbox.put(_Abort(sub))

    @property
    def num_active(self) -> int:
        """Sequences and submissions the loop still routes (0 once every request has ended)."""
        return len(self._routes) + len(self._pending)

    # -- the engine's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            working = False
            while True:
                idle = not self.engine.has_unfinished()
                self._watched(went_idle=working and idle)
                working = not idle
                if not self._take(block=idle):
                    return
                if self.engine.has_unfinished():
                    self._step()
        except Exception as e:  # a bug, not bad input: fail what runs, report it, stop
            log.exception("the engine loop failed")
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(self.error)
            self.watchers.end()

    def _take(self, block: bool) -> bool:
        """Apply what the inbox holds (waiting for one item when idle); False on stop. Aborts
        free blocks at once, so the gauges are refreshed after them."""
        aborted = False
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                break
            block = False
            if item is _STOP:
                return False
            if isinstance(item, _Abort):
                aborted = self._abort(item.sub) or aborted
            else:
                self._add(item)
        if aborted:
            snapshot = self.engine.block_map.snapshot()
            self._observe_load(snapshot.num_used)
            # watched or not: a watcher joining later starts from this block map
            self.watchers.emit(BlocksChanged(snapshot, self.engine.sequences()))
        return True

    def _watched(self, went_idle: bool) -> None:
        """Once a turn: a memory reading for watchers now and then, and their pending batch."""
        watchers = self.watchers
        now = time.perf_counter()
        if watchers.watched and (went_idle or now - self._read_at >= MEMORY_EVERY_S):
            self._read_at = now
            watchers.emit(MemoryRead(read_memory(self.engine.device)))
        watchers.flush(idle=not self.engine.has_unfinished())

    def _add(self, sub: Submission) -> None:
        if self.watchers.watched and sub.params.num_candidates < WATCHED_CANDIDATES:
            # watchers see the candidates of every request (the app's sampling panel)
            sub.params = replace(sub.params, num_candidates=WATCHED_CANDIDATES)
        try:
            sub.request_id = self.engine.add_request(sub.prompt_ids, sub.params)
        except PagechatError as e:
            self._deliver([(sub, [self._error_delta(sub, str(e))])])
            return
        pending = _Pending(sub, sub.params.n, [sub.request_id])
        self._pending[sub.request_id] = pending
        if self.watchers.watched:
            ids = len(sub.prompt_ids)
            self.watchers.emit(Started(None, sub.request_id, ids, sub.label, ref=sub.ref))
        self._routes[sub.request_id] = _Route(pending, sub.first_index, root=True)

    def _abort(self, sub: Submission) -> bool:
        """Abort a submission's sequences (its forked samples too); their blocks are freed now.
        False when there was nothing to abort."""
        pending = self._pending.pop(sub.request_id, None) if sub.request_id is not None else None
        if pending is None:
            return False  # never added, or already finished
        now = time.perf_counter()
        for seq_id in pending.seq_ids:
            route = self._routes.pop(seq_id, None)
            if route is not None and seq_id in self.engine.requests:
                self._end_seq(seq_id)
                self.metrics.observe_finished("abort", now - sub.arrival)
        for child in self.engine.requests[sub.request_id].children:
            self._end_seq(child)  # forked in a step whose outputs reached no route yet
        self.engine.release(sub.request_id)
        return True

    def _end_seq(self, seq_id: int) -> None:
        """Abort one sequence (nothing happens to one that finished), telling watchers."""
        seq = self.engine.requests[seq_id]
        if not seq.finished:
            self.engine.abort(seq_id)
            if self.watchers.watched:
                self.watchers.emit(Finished.of(seq))

    def _step(self) -> None:
        started = time.perf_counter()
        report = self.engine.step()
        now = time.perf_counter()
        self._observe_scheduled(started)
        self.metrics.observe_step(report)
        self._observe_load(report.blocks.num_used)
        self._tell_watchers(report)
        self._deliver(self._route(report, now))

    def _tell_watchers(self, report: StepReport) -> None:
        """The step's report, and each sequence's first token and end, before routing releases
        finished requests."""
        watchers = self.watchers
        watchers.emit(report)
        if not watchers.watched:
            return
        for out in report.outputs:
            seq = self.engine.requests[out.request_id]
            if out.token_ids and seq.num_output_tokens == len(out.token_ids):
                watchers.emit(FirstToken.of(seq))
            if out.finished:
                watchers.emit(Finished.of(seq))

    def _observe_load(self, used_blocks: int) -> None:
        sched = self.engine.scheduler
        swapped = len(getattr(sched, "swapped", ()))  # a scheduler that preempts by swapping
        self.metrics.observe_load(len(sched.running), len(sched.waiting), swapped, used_blocks)

    def _observe_scheduled(self, started: float) -> None:
        for request_id, pending in self._pending.items():
            seq = self.engine.requests[request_id]
            if not pending.scheduled and (seq.status is not Status.WAITING or seq.num_computed):
                pending.scheduled = True
                self.metrics.observe_scheduled(max(started - pending.sub.arrival, 0.0))

    def _route(self, report: StepReport, now: float) -> list[tuple[Submission, list]]:
        """The step's outputs as deltas, grouped by submission."""
        records: dict[int, list[SampleRecord]] = defaultdict(list)
        for record in report.samples:
            records[record.seq_id].append(record)
        batches: dict[int, tuple[Submission, list[ChoiceDelta]]] = {}
        for out in report.outputs:
            route = self._routes.get(out.request_id) or self._fork_route(out.request_id)
            if route is None:
                continue  # aborted meanwhile
            delta = self._delta(route, out, records[out.request_id], now)
            sub = route.pending.sub
            batches.setdefault(id(sub), (sub, []))[1].append(delta)
        return list(batches.values())

    def _fork_route(self, seq_id: int) -> _Route | None:
        """The route of a sample forked from a submission's prompt (n > 1), made at its first
        output: choice index = the submission's first + 1 + its place among the forks."""
        seq = self.engine.requests.get(seq_id)
        pending = self._pending.get(seq.parent) if seq and seq.parent is not None else None
        if pending is None:
            return None
        place = self.engine.requests[seq.parent].children.index(seq_id)
        pending.seq_ids.append(seq_id)
        route = self._routes[seq_id] = _Route(pending, pending.sub.first_index + 1 + place, False)
        return route

    def _delta(
        self, route: _Route, out: TokenOutput, records: list[SampleRecord], now: float
    ) -> ChoiceDelta:
        """One output as a delta; observes its latencies and, at the end, drops its route."""
        sub = route.pending.sub
        logprobs = ()
        if sub.logprobs is not None:
            taken = [records.pop(0) for _ in out.token_ids if records]
            logprobs = tuple(lp for r in taken if (lp := token_logprob(r, sub.logprobs)))
        if out.token_ids:
            self._observe_output(route, now)
        if not out.finished:
            return ChoiceDelta(route.index, out.text_delta, logprobs, tokens=len(out.token_ids))
        seq = self.engine.requests[out.request_id]
        self._end(route, out.request_id, seq, now)
        return ChoiceDelta(
            route.index,
            out.text_delta,
            logprobs,
            out.finish_reason or "stop",
            out.error,
            self._usage(route, seq),
            seq.fault,
        )

    def _observe_output(self, route: _Route, now: float) -> None:
        """TTFT at a choice's first output, else the gap since its last step's (tokens a step
        verifies together count once, as vLLM counts iterations)."""
        if route.last_output == now:
            return
        if route.last_output is None:
            prompt = len(route.pending.sub.prompt_ids) if route.root else 0
            self.metrics.observe_first_token(now - route.pending.sub.arrival, prompt)
        else:
            self.metrics.observe_token_gap(now - route.last_output)
        route.last_output = now

    def _end(self, route: _Route, seq_id: int, seq: Sequence, now: float) -> None:
        """A choice finished: forget its route, and its submission once every choice is done. An
        error ends the whole submission (the handler answers it with that error)."""
        del self._routes[seq_id]
        pending = route.pending
        pending.open -= 1
        if seq.finish_reason == "error":
            self._abort(pending.sub)
        elif pending.open == 0:
            del self._pending[pending.sub.request_id]
            self.engine.release(pending.sub.request_id)
        self.metrics.observe_finished(seq.finish_reason or "stop", now - pending.sub.arrival)

    @staticmethod
    def _usage(route: _Route, seq: Sequence) -> ChoiceUsage:
        if not route.root:
            return ChoiceUsage(0, 0, seq.num_output_tokens)
        prompt = seq.num_prompt_tokens
        return ChoiceUsage(prompt, min(seq.num_cached_tokens, prompt), seq.num_output_tokens)

    @staticmethod
    def _error_delta(sub: Submission, message: str) -> ChoiceDelta:
        """The end of a submission that failed as a whole."""
        return ChoiceDelta(sub.first_index, "", (), "error", message, ChoiceUsage(0, 0, 0))

    def _fail_all(self, message: str) -> None:
        failed = [(p.sub, [self._error_delta(p.sub, message)]) for p in self._pending.values()]
        self._deliver(failed)
        self._pending.clear()
        self._routes.clear()

    def _deliver(self, batches: list[tuple[Submission, list]]) -> None:
        """Hand deltas to the event loop in one call; each submission's list lands on its queue."""
        if not batches or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, batches)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def _put_all(batches: list[tuple[Submission, list]]) -> None:
    for sub, deltas in batches:
        sub.deltas.put_nowait(deltas)
