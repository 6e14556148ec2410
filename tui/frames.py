"""Frames: the engine's events drained on the UI thread and drawn, at most FPS a second."""

from __future__ import annotations

import time

from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.report import StepReport
from pagechat.tui.heap import settle_heap
from pagechat.tui.protocol import LoadSet, Refused, SpeculationSet
from pagechat.tui.session import Message
from textual.app import App

FPS = 20  # the UI renders the latest report at most this often
UI_CPU_BUDGET = 0.03  # while decoding, the UI thread's share of one core (see within_budget)
MAX_FRAME_GAP = 0.5  # ...but draw at least twice a second


class Frames:
    """Drains the engine's events each frame, drawing within a CPU budget so decoding keeps pace."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose session, scheduler log and screen the events update."""
        self.app = app
        self._dirty: dict[int, Message] = {}  # messages changed since the last draw
        self._render_due = False
        self._time_mark, self._cpu_mark = time.perf_counter(), time.thread_time()

    def pump(self, force: bool = False) -> None:
        """Drain the engine's events into the session, then render if the CPU budget allows."""
        app = self.app
        events = app.loop.events
        if not app.is_running or not app.main.is_attached:
            return
        quiet = not events  # the engine produced nothing since the last tick
        finished, first = False, False
        while events:
            ev = events.popleft()
            if isinstance(ev, MemoryRead):
                app.readings = ev.readings
                continue
            if isinstance(ev, SpeculationSet):
                app.speculation = (ev.enabled, ev.num_draft)
            self.note_scheduler(ev)
            msg = app.session.apply(ev)
            if msg is not None:
                self._dirty[id(msg)] = msg
            if isinstance(ev, Refused):
                app.notify(ev.message, title="refused", severity="error", timeout=8)
            # background requests are drawn at the frame rate: no save or draw now for them
            finished |= isinstance(ev, Refused) or isinstance(ev, Finished) and msg is not None
            first |= isinstance(ev, FirstToken) and msg is not None
            self._render_due = True
        if app.session.context_from != app.main.chat_log.context_from:  # oldest turns dropped
            app.main.chat_log.mark_context(app.session.messages, app.session.context_from)
        if finished:
            app.files.save()
            settle_heap()
            app.main.prompt.cursor_blink = app.session.streaming is None
        if not self._render_due or not (
            force or finished or first or quiet or self.within_budget()
        ):
            return
        self._render_due = False
        self._time_mark, self._cpu_mark = time.perf_counter(), time.thread_time()
        log = app.main.chat_log
        for msg in self._dirty.values():
            log.update(msg)
        self._dirty.clear()
        app.inspector.refresh()

    def note_scheduler(self, ev) -> None:
        """Fold the scheduler's records of an event into the scheduler panel's log."""
        if isinstance(ev, StepReport):
            self.app.sched.apply(ev)
        elif isinstance(ev, BlocksChanged):
            self.app.sched.apply_seqs(ev.seqs)
        elif isinstance(ev, Started):
            self.app.sched.label(ev.request_id, ev.label)
        elif isinstance(ev, LoadSet):
            self.app.load.left = ev.left

    def tick(self) -> None:
        """Pump, then sleep until the next frame; while decoding, for the last frame's CPU cost
        over the budget.

        Waking the UI thread takes a core from the engine's thread pool (and, with a ThreadedEngine,
        the GIL) even when nothing is drawn, so a frame that cannot be afforded is not woken up for
        either.
        """
        self.pump()
        delay = 1 / FPS
        streaming = self.app.session.streaming
        if streaming is not None and (
            streaming.tokens or any(a.tokens for a in streaming.samples)
        ):  # until its first token is drawn, a reply is polled at FPS
            used = time.thread_time() - self._cpu_mark
            delay = min(
                MAX_FRAME_GAP,
                max(delay, used / UI_CPU_BUDGET - (time.perf_counter() - self._time_mark)),
            )
        self.app.set_timer(delay, self.tick)

    @property
    def render_pending(self) -> bool:
        """Engine events received but not yet drawn (tests wait for this to clear)."""
        return bool(self.app.loop.events) or self._render_due

    def within_budget(self) -> bool:
        """While a reply streams, draw only if the UI thread used at most UI_CPU_BUDGET of the
        time since the last draw.

        Rendering takes CPU from the engine: it preempts one of the engine's torch threads (each
        parallel op waits for the slowest), and with a ThreadedEngine it also holds the GIL the
        engine needs between torch calls. Capping the UI's share of CPU caps what it can take from
        decoding, whatever a frame costs here.
        """
        if self.app.session.streaming is None:
            return True
        elapsed = time.perf_counter() - self._time_mark
        return (
            elapsed > MAX_FRAME_GAP
            or time.thread_time() - self._cpu_mark <= UI_CPU_BUDGET * elapsed
        )

    def pump_now(self, timeout: float = 2.0) -> None:
        """Wait briefly for the engine to apply the commands posted so far; drain its events."""
        self.app.loop.sync(timeout)
        self.pump(force=True)
