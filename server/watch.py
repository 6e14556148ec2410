"""The server's watchers: each client of GET /pagechat/events gets the engine's records as the
app's own engine process sends them (core/wire.py): first the EngineInfo with the block map as
watchers hold it, then batches of StepReports and request events, each batch written as JSON once
for every watcher.

Nobody watching costs the engine's thread one attribute read a step. A watcher that falls
QUEUE_MAX batches behind is dropped (it may connect again), so a slow one never holds memory or
the engine back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.events import (
    BlocksChanged,
    EngineInfo,
    Finished,
    FirstToken,
    Started,
)
from pagechat.core.report import StepReport
from pagechat.core.wire import BEAT_S, FLUSH_HZ, dumps, pack

QUEUE_MAX = 256  # batches a watcher may be behind (at FLUSH_HZ, over ten seconds)
URGENT = (Started, FirstToken, Finished)  # sent at once: a watcher shows them without delay


class Watchers:
    """The engine's thread emits and flushes; the event loop subscribes and reads."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info  # what never changes; its block map is replaced by the one watchers hold
        self.watched = False  # read by the engine's thread without the lock: at worst a batch late
        self._lock = threading.Lock()
        self._queues: list[asyncio.Queue] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list = []
        self._urgent = False
        self._last = 0.0
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
            self._pending.append(ev)
            self._urgent = self._urgent or isinstance(ev, URGENT)

    def flush(self, idle: bool) -> None:
        """Send what is pending when something urgent is in it, the engine went idle, or a
        1/FLUSH_HZ has passed since the last batch."""
        now = time.perf_counter()
        if not self._pending or not (idle or self._urgent or now - self._last >= 1 / FLUSH_HZ):
            return
        with self._lock:
            batch, self._sent = pack(self._pending, self._sent)
            targets = tuple(self._queues)
            text = dumps(batch) if targets else None
        self._pending, self._urgent, self._last = [], False, now
        if text is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._send, targets, text)
            except RuntimeError:  # the event loop closed: the server is shutting down
                pass

    # -- the event loop ----------------------------------------------------------------------------
    def _send(self, targets: tuple[asyncio.Queue, ...], text: str) -> None:
        for q in targets:
            if q.qsize() < QUEUE_MAX:
                q.put_nowait(text)
            elif self._drop(q):  # what it has, then the end: no batch after a gap
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
        """One watcher's server-sent events: the EngineInfo, then a batch per message, and a
        comment line every BEAT_S without one (the watcher tells an idle server from a gone one)."""
        q: asyncio.Queue = asyncio.Queue()  # bounded by _send
        with self._lock:
            if not self._queues:  # nobody held a block map: watchers start from the newest
                self._sent = self._latest
            hello = dumps(replace(self.info, blocks=self._sent))
            self._queues.append(q)
            self.watched = True
        try:
            yield f"data: {hello}\n\n"
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
