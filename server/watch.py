"""The server's watchers: each client of GET /pagechat/events gets the engine's records as the
app's own engine process sends them (core/wire.py): first the EngineInfo with the block map as
watchers hold it, then batches of StepReports and request events, each batch written as JSON once
for every watcher.

Nobody watching costs the engine's thread a few attribute reads a step. A watcher that falls
QUEUE_MAX batches behind is dropped (it may connect again), so a slow one never holds memory or
the engine back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.events import (
    BlocksChanged,
    EngineInfo,
    Finished,
    FirstToken,
    MemoryRead,
    Started,
)
from pagechat.core.memory import read_memory
from pagechat.core.report import StepReport
from pagechat.core.wire import BEAT_S, Outbox, dumps, pack

QUEUE_MAX = 256  # batches a watcher may be behind (at FLUSH_HZ, over ten seconds)
URGENT = (Started, FirstToken, Finished)  # due at once: a watcher shows them without delay


class Watchers:
    """The engine's thread emits and flushes; the event loop subscribes and reads."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info  # what never changes; its block map is replaced by the one watchers hold
        self.watched = False  # read by the engine's thread without the lock: at worst a batch late
        self._lock = threading.Lock()
        self._queues: list[asyncio.Queue] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox = Outbox(URGENT)
        self._sent: BlockSnapshot = info.blocks  # the block map every watcher holds
        self._latest: BlockSnapshot = info.blocks  # the engine's newest, watched or not

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # -- the engine's thread -----------------------------------------------------------------------
    def emit(self, ev) -> None:
        if isinstance(ev, StepReport):
            self._latest = ev.blocks
        elif isinstance(ev, BlocksChanged):
            self._latest = ev.snapshot
        if self.watched:
            self._outbox.add(ev)

    def flush(self, idle: bool) -> None:
        """Send the pending events when a batch is due (core/wire.py's Outbox), written once."""
        events = self._outbox.take(idle)
        if events is None:
            return
        with self._lock:  # a watcher joining now gets the block map this batch starts from
            batch, self._sent = pack(events, self._sent)
            targets = tuple(self._queues)
        if targets:
            self._post(self._send, targets, dumps(batch))

    def end(self) -> None:
        """The engine stopped: every watcher's stream ends (they see the server stop sending)."""
        with self._lock:
            targets = tuple(self._queues)
        self._post(self._send_end, targets)

    def _post(self, call, *args) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(call, *args)
            except RuntimeError:  # the event loop closed: the server is shutting down
                pass

    # -- the event loop ----------------------------------------------------------------------------
    def _send(self, targets: tuple[asyncio.Queue, ...], text: str) -> None:
        for q in targets:
            if q.qsize() < QUEUE_MAX:
                q.put_nowait(text)
            elif self._drop(q):  # what it has, then the end: no batch after a gap
                q.put_nowait(None)

    def _send_end(self, targets: tuple[asyncio.Queue, ...]) -> None:
        for q in targets:
            if self._drop(q):
                q.put_nowait(None)

    def _drop(self, q: asyncio.Queue) -> bool:
        """Forget a watcher's queue; False when it was gone already."""
        with self._lock:
            there = q in self._queues
            if there:
                self._queues.remove(q)
            self.watched = bool(self._queues)
        return there

    async def stream(self) -> AsyncIterator[str]:
        """One watcher's server-sent events: the EngineInfo, a memory reading, then a batch per
        message, and a comment line every BEAT_S without one (the watcher tells an idle server
        from a gone one)."""
        q: asyncio.Queue = asyncio.Queue()  # bounded by _send
        with self._lock:
            if not self._queues:  # nobody held a block map: watchers start from the newest
                self._sent = self._latest
            hello = replace(self.info, blocks=self._sent)
            self._queues.append(q)
            self.watched = True
        try:
            yield f"data: {dumps(hello)}\n\n"
            # the process's memory now: an idle engine reads none until it works again
            yield f"data: {dumps(([MemoryRead(read_memory(self.info.device))], None))}\n\n"
            while True:
                try:
                    text = await asyncio.wait_for(q.get(), BEAT_S)
                except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
                    yield ":\n\n"
                    continue
                if text is None:
                    return
                yield f"data: {text}\n\n"
        finally:
            self._drop(q)
