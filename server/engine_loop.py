"""The server's engine loop: core's EngineLoop on a thread of its own, with the server as its
port. Submissions and aborts come in through a thread-safe inbox; each step's outputs go out as
ChoiceDeltas, handed to the event loop in one call per turn (loop.call_soon_threadsafe), so HTTP
handlers never wait on a step; every event also goes to the watchers, and the metrics read it.

State per request lives here only while it runs: a _Route per sequence (a choice) and a _Pending
per submission, both dropped when it finishes or is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, replace

from pagechat.core.engine import Engine
from pagechat.core.engine_loop import NOTHING, EngineLoop
from pagechat.core.errors import PagechatError
from pagechat.core.events import BlocksChanged, Finished
from pagechat.core.params import SamplingParams
from pagechat.core.report import SeqRecord, StepReport, TokenOutput
from pagechat.core.sampler import SampleRecord
from pagechat.core.threads import EngineThread
from pagechat.server.kv_events import KVEventPublisher
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
    last: ChoiceDelta | None = None  # its final output, until the engine's Finished completes it


_STOP = object()
WATCHED_CANDIDATES = SamplingParams().num_candidates  # as many as the app's own requests record


class ServerLoop(EngineLoop):
    """Runs one Engine on a background thread for the server's event loop."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        watchers: Watchers,
        kv_events: KVEventPublisher | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        """thread: the one the engine was loaded on, where its loop must run too (EngineThread);
        None: a thread of its own."""
        super().__init__(engine, self)
        self.metrics, self.watchers, self.kv_events = metrics, watchers, kv_events
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}  # root request id -> its submission
        self._routes: dict[int, _Route] = {}  # sequence id -> where its outputs go
        self._out: dict[int, tuple[Submission, list[ChoiceDelta]]] = {}  # to deliver this turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread
        self._running: Future | None = None  # the loop, while it runs on the thread
        self.error: str | None = None  # why the thread stopped, if it failed

    # -- the event loop's side -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = self._thread or EngineThread()
        self._running = self._thread.submit(self._run)

    def stop(self) -> None:
        if self._running is not None:
            self._inbox.put(_STOP)
            self._running.result()
            self._running = None
            self._thread.close()
            self._thread = None
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def submit(self, sub: Submission) -> None:
        self._inbox.put(sub)

    def cancel(self, sub: Submission) -> None:
        """Abort a submission (its client went away)."""
        self._inbox.put(_Abort(sub))

    @property
    def num_active(self) -> int:
        """Sequences and submissions the loop still routes (0 once every request has ended)."""
        return len(self._routes) + len(self._pending)

    # -- the engine's thread: the loop's port ----------------------------------------------------
    @property
    def memory(self) -> bool:
        return self.watchers.watched  # readings only for those who look

    def _run(self) -> None:
        try:
            self.run()
        except Exception as e:  # a bug, not bad input: fail what runs, report it, stop
            log.exception("the engine loop failed")
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(self.error)
            self.watchers.end()

    def take(self, block: bool):
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return NOTHING
        return None if item is _STOP else item

    def handle(self, cmd) -> bool:
        if isinstance(cmd, _Abort):
            self._drop(cmd.sub)
            if cmd.sub.request_id is not None:
                self.abort([cmd.sub.request_id])
        else:
            self._add(cmd)
        return True

    def emit(self, ev) -> None:
        self.watchers.emit(ev)  # watched or not: a watcher joining later starts from its map
        if isinstance(ev, StepReport):
            if self.kv_events is not None:  # the prefix cache's changes, as vLLM publishes them
                self.kv_events.publish(ev.block_events, self.engine.config.block_size)
            self.metrics.observe_step(ev)
            self._observe_load(ev.seqs, ev.blocks.num_used)
            now = time.perf_counter()
            self._observe_scheduled(ev.seqs, now - ev.elapsed_s)
            self._route(ev, now)
        elif isinstance(ev, BlocksChanged):
            self._observe_load(ev.seqs, ev.snapshot.num_used)
        elif isinstance(ev, Finished) and ev.request_id in self._routes:
            self._end(ev)

    def flush(self, idle: bool) -> None:
        self._deliver(list(self._out.values()))
        self._out.clear()
        self.watchers.flush(idle)

    # -- submissions -----------------------------------------------------------------------------
    def _add(self, sub: Submission) -> None:
        if self.watchers.watched and sub.params.num_candidates < WATCHED_CANDIDATES:
            # watchers see the candidates of every request (the app's sampling panel)
            sub.params = replace(sub.params, num_candidates=WATCHED_CANDIDATES)
        try:
            sub.request_id = self.add(sub.prompt_ids, sub.params, label=sub.label, ref=sub.ref)
        except PagechatError as e:
            self._deliver([(sub, [self._error_delta(sub, str(e))])])
            return
        pending = _Pending(sub, sub.params.n, [sub.request_id])
        self._pending[sub.request_id] = pending
        self._routes[sub.request_id] = _Route(pending, sub.first_index, root=True)

    def _drop(self, sub: Submission) -> None:
        """Route nothing more of a submission (aborted, or failed as a whole)."""
        pending = self._pending.pop(sub.request_id, None) if sub.request_id is not None else None
        if pending is None:
            return  # never added, or already finished
        now = time.perf_counter()
        for seq_id in pending.seq_ids:
            if self._routes.pop(seq_id, None) is not None:
                self.metrics.observe_finished("abort", now - sub.arrival)

    def _observe_load(self, seqs: tuple[SeqRecord, ...], used_blocks: int) -> None:
        states = defaultdict(int)
        for rec in seqs:
            states[rec.state] += 1
        waiting = states["waiting"] + states["preempted"]
        self.metrics.observe_load(states["running"], waiting, states["swapped"], used_blocks)

    def _observe_scheduled(self, seqs: tuple[SeqRecord, ...], started: float) -> None:
        """Queue time of each submission whose prompt the step (begun at started) scheduled."""
        for rec in seqs:
            pending = self._pending.get(rec.seq_id)
            if pending and not pending.scheduled and (rec.state != "waiting" or rec.computed):
                pending.scheduled = True
                self.metrics.observe_scheduled(max(started - pending.sub.arrival, 0.0))

    # -- outputs ---------------------------------------------------------------------------------
    def _route(self, report: StepReport, now: float) -> None:
        """The step's outputs as deltas, grouped by submission; a final one waits for Finished."""
        records: dict[int, list[SampleRecord]] = defaultdict(list)
        for record in report.samples:
            records[record.seq_id].append(record)
        forks = {rec.seq_id: rec for rec in report.seqs if rec.role == "sample" and rec.index}
        for out in report.outputs:
            route = self._routes.get(out.request_id) or self._fork_route(forks.get(out.request_id))
            if route is None:
                continue  # aborted meanwhile
            delta = self._delta(route, out, records[out.request_id], now)
            if out.finished:
                route.last = delta
            else:
                self._put(route.pending.sub, delta)

    def _fork_route(self, rec: SeqRecord | None) -> _Route | None:
        """The route of a sample forked from a submission's prompt (n > 1), made at its first
        output: choice index = the submission's first + its sample number."""
        pending = self._pending.get(rec.request_id) if rec is not None else None
        if pending is None:
            return None
        pending.seq_ids.append(rec.seq_id)
        route = _Route(pending, pending.sub.first_index + rec.index, False)
        self._routes[rec.seq_id] = route
        return route

    def _delta(
        self, route: _Route, out: TokenOutput, records: list[SampleRecord], now: float
    ) -> ChoiceDelta:
        """One output as a delta; observes its latencies."""
        sub = route.pending.sub
        logprobs = ()
        if sub.logprobs is not None:
            taken = [records.pop(0) for _ in out.token_ids if records]
            logprobs = tuple(lp for r in taken if (lp := token_logprob(r, sub.logprobs)))
        if out.token_ids:
            self._observe_output(route, now)
        return ChoiceDelta(route.index, out.text_delta, logprobs, tokens=len(out.token_ids))

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

    def _end(self, ev: Finished) -> None:
        """A choice finished: its last delta goes out with its usage; its route is forgotten, and
        its submission once every choice is done. An error ends the whole submission (the handler
        answers it with that error; the others are aborted next turn)."""
        route = self._routes.pop(ev.request_id)
        pending, sub = route.pending, route.pending.sub
        pending.open -= 1
        last = route.last or ChoiceDelta(route.index, "")
        prompt = len(sub.prompt_ids) if route.root else 0
        usage = ChoiceUsage(prompt, min(ev.cached_tokens, prompt), ev.output_tokens)
        reason = ev.reason or "stop"
        self._put(
            sub, replace(last, finish_reason=reason, error=ev.error, usage=usage, fault=ev.fault)
        )
        if reason == "error":
            self._drop(sub)
            self._inbox.put(_Abort(sub))
        elif pending.open == 0:
            del self._pending[sub.request_id]
        self.metrics.observe_finished(reason, time.perf_counter() - sub.arrival)

    def _put(self, sub: Submission, delta: ChoiceDelta) -> None:
        self._out.setdefault(id(sub), (sub, []))[1].append(delta)

    @staticmethod
    def _error_delta(sub: Submission, message: str) -> ChoiceDelta:
        """The end of a submission that failed as a whole."""
        return ChoiceDelta(sub.first_index, "", (), "error", message, ChoiceUsage(0, 0, 0))

    def _fail_all(self, message: str) -> None:
        failed = [(p.sub, [self._error_delta(p.sub, message)]) for p in self._pending.values()]
        self._deliver([*self._out.values(), *failed])
        self._out.clear()
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
