"""EngineLoop: the one place that calls the engine once a front-end is up (the app's engine
thread or process, the server's engine thread).

Between steps it applies the front-end's commands; it steps while there is work and waits for a
command when there is none. It tells the front-end, through its port, each step's report, each
request's start, each sequence's first token and end, the pool changing between steps, and memory
readings; and it releases each request from the engine once all its sequences have ended and been
told, so nothing per request outlives it. The engine is not thread-safe: every call happens here.
Front-ends adapt it by subclassing: `handle` their commands, `tick` their own timed work.
"""

from __future__ import annotations

import time
from typing import Protocol

from pagechat.core.engine import Engine
from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.memory import read_memory
from pagechat.core.params import SamplingParams
from pagechat.core.wire import MEMORY_EVERY_S

NOTHING = ...  # a port's take(): no command waiting


class Port(Protocol):
    """How the loop reaches its front-end: a queue on a thread, a pipe to the app's process, the
    server's event loop."""

    def take(self, block: bool):
        """The next command; NOTHING when none waits and block is False, None when the front-end
        is gone (the loop ends)."""

    def emit(self, event) -> None:
        """Hand an event over (the port may batch it)."""

    def flush(self, idle: bool) -> None:
        """Called once a turn; idle: the engine has no work."""


class EngineLoop:
    """Applies commands between steps, steps while there is work, waits for commands otherwise."""

    memory = True  # send memory readings (a subclass may read them only while someone looks)

    def __init__(self, engine: Engine, port: Port) -> None:
        self.engine, self.port = engine, port
        self.paused = False  # hold the steps (the app's pause); commands still apply
        self._told_first: set[int] = set()  # sequences whose first token was told
        self._ended: set[int] = set()  # requests with a sequence that ended, not yet released
        self._snapshot = engine.block_map.snapshot()  # the last block map the port was sent
        self._read_at = 0.0

    # -- what a front-end adapts -----------------------------------------------------------------
    def handle(self, cmd) -> bool:
        """Apply one of the front-end's commands; False when it closes the loop."""
        raise NotImplementedError

    def tick(self) -> float | None:
        """The front-end's own timed work, once a turn; seconds until it has more (None: none)."""
        return None

    def closing(self) -> None:
        """The front-end is gone or closed the loop: what it leaves running is aborted."""

    # -- the loop --------------------------------------------------------------------------------
    @property
    def working(self) -> bool:
        return self.engine.has_unfinished() and not self.paused

    def run(self) -> None:
        """Until the port says the front-end is gone."""
        was_working = True
        while True:
            wait = self.tick()
            working = self.working
            self._read_memory(went_idle=was_working and not working)
            was_working = working
            self.port.flush(not working)
            if not self._apply_commands(block=not working and wait is None):
                self.closing()
                self.port.flush(True)
                return
            if not working and wait is not None:  # nothing to step until the front-end's next
                time.sleep(min(0.05, wait))
            self._tell_blocks()
            if self.working:
                self.step()

    def _apply_commands(self, block: bool) -> bool:
        """Apply every waiting command (wait for one if `block`); False once the loop must end."""
        cmd = self.port.take(block)
        while cmd is not NOTHING:
            if cmd is None or not self.handle(cmd):
                return False
            cmd = self.port.take(False)
        return True

    def _read_memory(self, went_idle: bool) -> None:
        now = time.perf_counter()
        due = went_idle or self.working and now - self._read_at >= MEMORY_EVERY_S
        if due and self.memory:
            self._read_at = now
            self.port.emit(MemoryRead(read_memory(self.engine.device)))

    def _tell_blocks(self) -> None:
        """Commands freed or took blocks (an abort): the port sees the new map now."""
        snap = self.engine.block_map.snapshot()
        if snap is not self._snapshot:
            self._snapshot = snap
            self.port.emit(BlocksChanged(snap, self.engine.sequences()))

    def step(self) -> None:
        """One engine step, told: the report, then each sequence's first token and end."""
        # A failure inside a step's work fails the requests it ran (Engine.step); one outside it
        # leaves the engine in no known state, so it ends the loop (the front-end says so).
        report = self.engine.step()
        self._snapshot = report.blocks
        self.port.emit(report)
        requests = self.engine.requests
        for out in report.outputs:
            seq = requests[out.request_id]
            if out.token_ids and seq.seq_id not in self._told_first:
                self._told_first.add(seq.seq_id)
                self.port.emit(FirstToken.of(seq))
            if out.finished:
                self._tell_end(seq)
        self._release_ended()

    # -- requests --------------------------------------------------------------------------------
    def add(
        self,
        ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        ticket: int | None = None,
        label: str = "chat",
        ref: str = "",
        dropped: int = 0,
    ) -> int:
        """Queue a request (told as Started); its id. Raises PagechatError for a bad one."""
        rid = self.engine.requests.add(ids, params, priority)
        self.port.emit(Started(ticket, rid, len(ids), label, dropped, ref))
        return rid

    def abort(self, seq_ids, samples: bool = True) -> None:
        """Abort these sequences, keeping what they generated (each one that was running is told
        as Finished); samples: a request's forked samples too. One released is left as it is."""
        requests = self.engine.requests
        for sid in seq_ids:
            seq = requests.get(sid)
            if seq is None:
                continue
            forks = map(requests.get, seq.children) if samples else ()
            for s in [x for x in (seq, *forks) if not x.finished]:
                requests.abort(s.seq_id)
                self._tell_end(s)
        self._release_ended()

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation's token ids through the model's chat template (Requests.encode_chat)."""
        return self.engine.requests.encode_chat(messages)

    def done(self, rid: int) -> bool:
        """A request and every sample forked from it have finished (a released one had)."""
        return rid not in self.engine.requests or self.engine.requests.done(rid)

    def update(self, rid: int, params: SamplingParams) -> tuple[SamplingParams, int]:
        """Change a running request's sampling for all its samples (see Requests.update_params)."""
        return self.engine.requests.update_params(rid, params)

    def _tell_end(self, seq) -> None:
        self.port.emit(Finished.of(seq))
        self._ended.add(self.engine.requests.root(seq).seq_id)

    def _release_ended(self) -> None:
        """Forget every request whose sequences have all ended and been told (the front-end
        holds the records it was sent): a long sitting keeps nothing in the engine per request."""
        for root in [r for r in self._ended if self.done(r)]:
            released = self.engine.requests.release(root)
            self._told_first.difference_update((root, *released.children))
            self._ended.discard(root)
