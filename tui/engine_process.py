"""EngineProcess: the engine loop in a child process of its own, which `pagechat run` uses.

On a thread of the app's process the engine shares one GIL with the UI, and torch's thread pool
shares the cores with it: each parallel op waits for the worker the UI thread preempted. In its own
process the engine keeps every core and the UI costs it only the CPU the UI really uses.

Commands go down the pipe as they are posted. Events come up in batches: the child sends what it
has when an event the UI must show at once is pending (a reply started, its first token, its end, a
refusal, an answer to a command), when the engine goes idle, and otherwise at most FLUSH_HZ times a
second, so pickling costs the engine a few batches a second rather than a message per token. The
block map crosses as a delta: the BlockInfos that are not the ones last sent (the block map keeps
unchanged ones as the same objects; core/wire.py), applied to the UI's copy of the last snapshot.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.config import EngineConfig
from pagechat.core.engine_loop import NOTHING
from pagechat.core.errors import PagechatError, one_line
from pagechat.core.events import EngineInfo, Finished, FirstToken, Started
from pagechat.core.wire import BEAT_S, SILENT_S, Outbox, pack, unpack
from pagechat.tui.client import EngineClient
from pagechat.tui.engine_loop import AppLoop
from pagechat.tui.heap import settle_heap
from pagechat.tui.protocol import Command, LoadSet, ParamsApplied, Refused, SpeculationSet, Synced

URGENT = (Started, FirstToken, Finished, Refused, ParamsApplied, SpeculationSet, Synced, LoadSet)


class _PipePort:
    """The child's end: commands from the pipe, events batched into it."""

    def __init__(self, conn: Connection, snapshot: BlockSnapshot) -> None:
        self.conn, self.sent = conn, snapshot
        self.outbox = Outbox(URGENT)
        self.idle = True  # the engine had no work at the last flush
        self.lock = threading.Lock()  # the loop's batches and the heartbeat share the pipe
        self.said = time.monotonic()  # when anything last went up the pipe

    def send(self, batch) -> None:
        with self.lock:
            self.said = time.monotonic()
            try:
                self.conn.send(batch)
            except (EOFError, OSError):
                pass  # the app is gone; take() closes the loop

    def beat(self) -> None:
        """Forever, on a thread of its own: an empty batch when nothing else was sent for BEAT_S,
        so the app can tell a busy engine from one that stopped answering."""
        while True:
            time.sleep(BEAT_S / 2)
            if time.monotonic() - self.said >= BEAT_S:
                self.send(None)

    def take(self, block: bool):
        try:
            if block or self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):  # the app is gone: close the loop
            return None
        return NOTHING

    def emit(self, ev) -> None:
        self.outbox.add(ev)

    def flush(self, idle: bool) -> None:
        replied = idle and not self.idle
        self.idle = idle
        events = self.outbox.take(idle)
        if events is not None:
            batch, self.sent = pack(events, self.sent)
            self.send(batch)
        if replied:  # between replies, after the reply's last events went out
            settle_heap()


def serve(conn: Connection, model_dir: str, config: EngineConfig) -> None:
    """The child's body: load the engine, send its EngineInfo (or a one-line error), then run the
    loop."""
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl+C belongs to the app; it closes this process
    from pagechat.core.engine import Engine

    try:
        engine = Engine(Path(model_dir), config)
    except PagechatError as e:
        conn.send(str(e))
        return
    except Exception as e:  # noqa: BLE001 - reported by the app as a one-line error
        conn.send(f"loading {model_dir} failed: {type(e).__name__}: {e}")
        return
    info = EngineInfo.of(engine)
    settle_heap(True)
    conn.send(info)
    # Nothing may write to the terminal the app draws on: torch's or the tokenizer's warnings too.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    port = _PipePort(conn, info.blocks)
    threading.Thread(target=port.beat, name="pagechat-heartbeat", daemon=True).start()
    try:
        AppLoop(engine, port).run()
    except Exception as e:  # noqa: BLE001 - the last word to the app, which starts a new engine
        port.send(f"the engine failed: {one_line(e)}")
        sys.exit(1)


class EngineProcess(EngineClient):
    """The engine in a child process (spawned: no state of the app's process is inherited)."""

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        """Start the child and wait until the engine is loaded; a failure to load raises
        PagechatError."""
        self.model_dir, self.config = model_dir, config
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=serve, args=(child, str(model_dir), config), name="pagechat-engine", daemon=True
        )
        self._proc.start()
        child.close()
        try:
            first = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise PagechatError(
                f"the engine process exited while loading {model_dir} "
                f"(exit code {self._proc.exitcode})"
            ) from None
        except BaseException:  # Ctrl+C while loading
            self._proc.terminate()
            raise
        if isinstance(first, str):
            self._proc.join(5)
            raise PagechatError(first)
        super().__init__(first)
        self._snapshot = first.blocks
        self._heard = time.monotonic()  # when the child last sent anything
        self._last_word: str | None = None  # the child's own account of why it ended
        self._ended = False  # the pipe closed
        self._reader = threading.Thread(
            target=self._read, name="pagechat-engine-reader", daemon=True
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> EngineProcess:
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                self._ended = True
                return
            self._heard = time.monotonic()
            if batch is None or isinstance(batch, str):  # a heartbeat, or the child's last word
                self._last_word = batch or self._last_word
                continue
            events, self._snapshot = unpack(batch, self._snapshot)
            for ev in events:
                self._deliver(ev)

    def _post(self, cmd: Command) -> None:
        try:
            self._conn.send(cmd)
        except OSError:
            pass  # the reader reports the exit

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def failure(self) -> str | None:
        if self._closed:
            return None
        if self._ended or not self._proc.is_alive():
            self._proc.join(1)
            code = self._proc.exitcode
            return self._last_word or f"the engine process {self.pid} exited (exit code {code})"
        silent = time.monotonic() - self._heard
        if silent > SILENT_S:
            return f"the engine process {self.pid} stopped answering ({silent:.1f} s silent)"
        return None

    def restarted(self) -> EngineProcess:
        return EngineProcess(self.model_dir, self.config)

    def abandon(self) -> None:
        self._closed = True
        self._proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too; SIGTERM would wait
        self._proc.join(2)
        self._conn.close()

    def _join(self, timeout: float) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout)
        self._conn.close()
