"""EngineLoop: the engine's own thread. The UI sends commands through a queue and reads events from a deque.

The engine is not thread-safe, so every engine call happens on this one thread, between steps. The
producer side costs almost nothing per token (a deque append): the UI drains the deque on a timer at
~20 Hz, so rendering never sits inside the timed decode loop (see notes/textual.md: call_from_thread
blocks ~230 µs per call; a deque drained by a timer costs the producer ~0).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagechat.core.blocks import BlockSnapshot
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport


@dataclass(frozen=True, slots=True)
class Started:
    """A reply's request was admitted to the engine's queue."""

    ticket: int  # the UI's id for the reply
    request_id: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request produced its first token; ttft_s is the engine's arrival-to-first-token time."""

    request_id: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The request finished (stop, length, abort or error), with the engine's own timestamps."""

    request_id: int
    reason: str | None
    error: str | None
    output_tokens: int
    cached_tokens: int
    ttft_s: float | None
    total_s: float


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused a command; message is its one-line reason."""

    ticket: int | None
    message: str


@dataclass(frozen=True, slots=True)
class BlocksChanged:
    """The pool changed outside a step (an abort freed blocks): the BlockManager's new snapshot."""

    snapshot: BlockSnapshot


@dataclass(frozen=True, slots=True)
class ParamsApplied:
    """New sampling settings are in force for the active request from its next token."""

    request_id: int | None
    params: SamplingParams
    at_token: int  # output tokens the request had when the settings changed


Event = StepReport | Started | FirstToken | Finished | Refused | ParamsApplied | BlocksChanged


class EngineLoop:
    """Owns the engine thread: drains commands between steps, steps while there is work, sleeps otherwise."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.events: deque[Event] = deque()
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagechat-engine", daemon=True)
        self._paused = False
        self._closed = False
        self.active: int | None = None  # the request of the reply in flight
        self._first_seen: set[int] = set()
        self.idle = threading.Event()  # set while the engine has no work (tests wait on it)
        self._snapshot = engine.blocks.snapshot()  # the last block snapshot the UI was sent
        self._held: Callable[[], None] | None = None  # a send held back until release()

    # -- UI side: every method only queues a command ---------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Abort what runs and stop the thread."""
        if not self._closed:
            self._closed = True
            self._put(self._abort_active)
            self._put(None)
            self._thread.join(timeout)

    def _put(self, cmd: Callable[[], None] | None) -> None:
        """Queue a command; a held send goes first, so the engine sees commands in the order the UI gave them."""
        self.release()
        self._commands.put(cmd)

    def send(self, ticket: int, messages: list[dict], params: SamplingParams, hold: bool = False) -> None:
        """Start a reply to the conversation `messages` (chat template applied on the engine thread).

        hold: keep the command until release() (or the next command): the app draws the new turn first, so
        that its layout (tens of ms of Python holding the GIL) does not run while the engine decodes.
        """
        params = replace(params)
        cmd = lambda: self._send(ticket, messages, params)  # noqa: E731
        if hold:
            self.release()
            self._held = cmd
        else:
            self._put(cmd)

    def release(self) -> None:
        """Queue the held send, if any."""
        cmd, self._held = self._held, None
        if cmd is not None:
            self._commands.put(cmd)

    def update_params(self, params: SamplingParams) -> None:
        """Apply new settings to the reply in flight from its next token."""
        self._put(lambda: self._update(replace(params)))

    def stop(self) -> None:
        """Abort the reply in flight, keeping what it generated."""
        self._put(self._abort_active)

    def pause(self) -> None:
        """Stop stepping after the current step (commands are still applied); for tests and benchmarks."""
        self._put(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._put(lambda: setattr(self, "_paused", False))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def sync(self, timeout: float = 2.0) -> bool:
        """Block until the engine thread has applied every command queued so far (False on timeout)."""
        if not self.is_alive():
            return False
        done = threading.Event()
        self._put(done.set)
        return done.wait(timeout)

    def advance(self, steps: int) -> None:
        """Run exactly `steps` engine steps now, paused or not (deterministic screenshots and tests)."""
        def run() -> None:
            for _ in range(steps):
                if self.engine.has_unfinished():
                    self._step()
        self._put(run)

    def call(self, fn: Callable[[Engine], None]) -> None:
        """Run fn(engine) on the engine thread between steps."""
        self._put(lambda: fn(self.engine))

    # -- engine thread ----------------------------------------------------------------------------
    def _send(self, ticket: int, messages: list[dict], params: SamplingParams) -> None:
        try:
            ids = self.engine.encode_chat(messages)
        except PagechatError as e:
            self.events.append(Refused(ticket, str(e)))
            return
        self._start(ticket, ids, params)

    def _start(self, ticket: int, ids: list[int], params: SamplingParams) -> None:
        self._abort_active()  # one reply at a time: a new prompt replaces the one in flight
        try:
            rid = self.engine.add_request(ids, params)
        except PagechatError as e:
            self.events.append(Refused(ticket, str(e)))
            return
        self.active = rid
        self.events.append(Started(ticket, rid, len(ids)))

    def _update(self, params: SamplingParams) -> None:
        rid, at = self.active, 0
        if rid is not None:
            seq = self.engine.requests[rid]
            if not seq.finished:
                # keep the request's own limits that the controls do not own
                params.stop, params.ignore_eos = seq.params.stop, seq.params.ignore_eos
                self.engine.update_params(rid, params)
                at = seq.num_output_tokens
            else:
                params.validate()
        else:
            params.validate()
        self.events.append(ParamsApplied(rid, params, at))

    def _abort_active(self) -> None:
        rid = self.active
        if rid is not None and not self.engine.requests[rid].finished:
            self.engine.abort(rid)
            self._finish(rid)

    def _finish(self, rid: int) -> None:
        seq = self.engine.requests[rid]
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        total = (seq.finish_time or time.perf_counter()) - seq.arrival
        self.events.append(Finished(rid, seq.finish_reason, seq.error, seq.num_output_tokens, seq.num_cached_tokens,
                                    ttft, total))
        if rid == self.active:
            self.active = None

    def _run_command(self, cmd: Callable[[], None]) -> None:
        try:
            cmd()
        except PagechatError as e:
            self.events.append(Refused(None, str(e)))
        except Exception as e:  # noqa: BLE001 - the app must stay up; show the engine's failure as a message
            self.events.append(Refused(None, f"engine error: {type(e).__name__}: {e}"))

    def _run(self) -> None:
        while True:
            working = self.engine.has_unfinished() and not self._paused
            if working:
                self.idle.clear()
            else:
                self.idle.set()
            try:
                cmd = self._commands.get(block=not working)
            except queue.Empty:
                cmd = ...
            while cmd is not ...:
                if cmd is None:
                    return
                self._run_command(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = ...
            snap = self.engine.blocks.snapshot()
            if snap is not self._snapshot:  # commands freed or took blocks: let the UI see it now
                self._snapshot = snap
                self.events.append(BlocksChanged(snap))
            if self.engine.has_unfinished() and not self._paused:
                self._step()

    def _step(self) -> None:
        try:
            report = self.engine.step()
        except Exception as e:  # noqa: BLE001 - shown as a message; the app stays up
            self.events.append(Refused(None, f"engine step failed: {type(e).__name__}: {e}"))
            self._abort_active()
            return
        self.events.append(report)
        self._snapshot = report.blocks
        for out in report.outputs:
            rid = out.request_id
            if out.token_ids and rid not in self._first_seen:
                self._first_seen.add(rid)
                seq = self.engine.requests[rid]
                self.events.append(FirstToken(rid, seq.first_token_time - seq.arrival))
            if out.finished:
                self._finish(rid)
