"""The app's handle on the engine: EngineClient posts commands and collects the engine's events.

`pagechat run` uses EngineProcess (engine_process.py: the engine in its own process, on every
core); ThreadedEngine here runs the EngineLoop on a thread of the app's own process, which tests
and the screenshot script use to reach the engine directly. Either way the UI drains `events` on a
timer, so rendering never sits inside the engine's step.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

from pagechat.core.engine import Engine
from pagechat.core.engine_loop import NOTHING
from pagechat.core.errors import one_line
from pagechat.core.events import EngineInfo
from pagechat.core.params import SamplingParams
from pagechat.tui.engine_loop import AppLoop
from pagechat.tui.protocol import (
    Abort,
    Advance,
    Close,
    Command,
    Event,
    Pause,
    Resume,
    Send,
    SetSpeculation,
    StartLoad,
    Stop,
    StopLoad,
    Sync,
    Synced,
    UpdateParams,
)


class EngineClient:
    """The app's side: every method only posts a command; events arrive in `events`, in order."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.events: deque[Event] = deque()
        self._held: Send | None = None  # a send held back until release()
        self._closed = False
        self._sync_sent = self._sync_done = 0
        self._synced = threading.Condition()

    # -- what a transport provides -----------------------------------------------------------------
    def start(self) -> EngineClient:
        raise NotImplementedError

    def _post(self, cmd: Command) -> None:
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def _join(self, timeout: float) -> None:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the engine stopped (died, or stopped answering), in one line; None while it runs."""
        raise NotImplementedError

    def restarted(self) -> EngineClient:
        """A new engine on the same model and settings, loaded and not started yet (slow: call it
        off the UI thread); raises PagechatError when it cannot load."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Give up on an engine that stopped: end it without a word sent (it may not read)."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------
    def _deliver(self, ev) -> None:
        """Hand one event from the engine to the app (any thread)."""
        if isinstance(ev, Synced):
            with self._synced:
                self._sync_done = ev.n
                self._synced.notify_all()
        else:
            self.events.append(ev)

    def _put(self, cmd: Command) -> None:
        """Post a command; a held send goes first, so the engine sees commands in the order the UI
        gave them."""
        self.release()
        self._post(cmd)

    def close(self, timeout: float = 5.0) -> None:
        """Abort what runs and stop the engine's loop."""
        if not self._closed:
            self._closed = True
            self._put(Close())
            self._join(timeout)

    def send(
        self,
        ticket: int,
        messages: list[dict],
        params: SamplingParams,
        hold: bool = False,
        prefix: tuple[int, ...] = (),
        when_full: str = "drop",
        beside: bool = False,
    ) -> None:
        """Start a reply to the conversation `messages`.

        hold: keep the command until release() (or the next command): the app draws the new turn
        first, so that its layout (Python on the UI thread) does not run while the engine decodes.
        prefix: token ids the reply starts with (a branch: an earlier reply's first tokens, then
        another candidate).
        when_full: what a conversation too long for the context does (context.WHEN_FULL).
        beside: run beside the reply's answers in flight (a branch) instead of replacing them.
        """
        cmd = Send(ticket, messages, params, prefix, when_full, beside)
        if hold:
            self.release()
            self._held = cmd
        else:
            self._put(cmd)

    def release(self) -> None:
        """Post the held send, if any."""
        cmd, self._held = self._held, None
        if cmd is not None:
            self._post(cmd)

    def update_params(self, params: SamplingParams) -> None:
        """Apply new settings to the reply in flight from its next token."""
        self._put(UpdateParams(params))

    def stop(self) -> None:
        """Abort the reply in flight, keeping what it generated."""
        self._put(Stop())

    def abort(self, request_ids: list[int]) -> None:
        """Abort these requests (samples not kept); their blocks are freed at once."""
        self._put(Abort(tuple(request_ids)))

    def start_load(self, count: int, rate: float, max_tokens: int = 64) -> None:
        """Start background requests from the built-in prompts (answered by LoadSet events)."""
        self._put(StartLoad(count, rate, max_tokens))

    def stop_load(self) -> None:
        """Start no more background requests and abort those that run."""
        self._put(StopLoad())

    def pause(self) -> None:
        """Stop stepping after the current step (commands are still applied); for tests and
        screenshots."""
        self._put(Pause())

    def resume(self) -> None:
        self._put(Resume())

    def advance(self, steps: int) -> None:
        """Run exactly `steps` engine steps now, paused or not (deterministic screenshots and
        tests)."""
        self._put(Advance(steps))

    def set_speculation(self, enabled: bool, num_draft: int) -> None:
        """Switch speculation and set the draft length from the next step; answered by
        SpeculationSet."""
        self._put(SetSpeculation(enabled, num_draft))

    def sync(self, timeout: float = 2.0) -> bool:
        """Block until the engine has applied every command posted so far and its events are in
        `events`."""
        if not self.is_alive():
            return False
        self._sync_sent += 1
        n = self._sync_sent
        self._put(Sync(n))
        with self._synced:
            return self._synced.wait_for(lambda: self._sync_done >= n, timeout)


class ThreadedEngine(EngineClient):
    """The engine loop on a thread of this process: it shares the UI's GIL, and `engine` is
    reachable."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(EngineInfo.of(engine))
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagechat-engine", daemon=True)
        self._failure: str | None = None

    def _run(self) -> None:
        try:
            AppLoop(self.engine, self).run()
        except Exception as e:  # noqa: BLE001 - the app reads it through failure()
            self._failure = f"the engine failed: {one_line(e)}"

    def start(self) -> ThreadedEngine:
        self._thread.start()
        return self

    def _post(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def failure(self) -> str | None:
        return self._failure

    def restarted(self) -> ThreadedEngine:
        return ThreadedEngine(Engine(self.engine.model_dir, self.engine.config))

    def abandon(self) -> None:
        self._closed = True  # a thread cannot be killed; a failed loop has ended already

    # -- the loop's port (engine thread) -----------------------------------------------------------
    def take(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return NOTHING

    def emit(self, ev) -> None:
        self._deliver(ev)

    def flush(self, idle: bool) -> None:
        """Events are in `events` as soon as they are emitted."""
