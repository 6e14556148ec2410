"""The engine's loop, and the app's handle on it.

EngineLoop owns the engine: between steps it applies the app's commands (plain tuples, so they can cross a
pipe), steps while there is work and emits events. The engine is not thread-safe, so every engine call
happens there. The app holds an EngineClient: `pagechat run` uses EngineProcess (engine_process.py: the
engine in its own process, on every core); ThreadedEngine runs the loop on a thread of the app's own
process, which tests and the screenshot script use to reach the engine directly. Either way the UI drains
`events` on a timer, so rendering never sits inside the engine's step.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.memory import EngineMemory, Readings, read_memory
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport

Command = tuple  # (name, *args): see EngineLoop._run_command; None closes the loop
NOTHING = ...  # a port's take(): no command waiting
MEMORY_EVERY_S = 1.0  # memory readings while the engine works


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


@dataclass(frozen=True, slots=True)
class SpeculationSet:
    """Speculation as the engine has it after a set_speculation command."""

    enabled: bool
    num_draft: int


@dataclass(frozen=True, slots=True)
class MemoryRead:
    """The engine's process or device memory, read where the engine runs (at start, when it goes idle, ~1/s)."""

    readings: Readings


@dataclass(frozen=True, slots=True)
class Synced:
    """Every command up to the sync command `n` has been applied (consumed by EngineClient.sync)."""

    n: int


Event = (
    StepReport
    | Started
    | FirstToken
    | Finished
    | Refused
    | ParamsApplied
    | BlocksChanged
    | SpeculationSet
    | MemoryRead
)


def settle_heap(full: bool = False) -> None:
    """Take what exists now out of the cyclic GC's reach (gc.freeze), so no full collection runs mid-reply.

    A full (generation 2) collection walks every tracked object, ~200 ms with torch, transformers and
    Textual loaded, and it runs in whichever thread allocates, the engine's too: a 200 ms step in the middle
    of a reply. Called between replies, in the app's process and in the engine's. `full` first unfreezes
    and collects everything, so the garbage of a cleared chat is freed rather than frozen; otherwise only
    the young generations are collected before freezing.
    """
    if full:
        gc.unfreeze()
        gc.collect()
    else:
        gc.collect(1)
    gc.freeze()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the app shows of the loaded engine before its first event."""

    model_dir: str
    precision: str
    device: torch.device
    graphs: bool  # decode steps replayed from traced graphs
    threads: int  # torch's CPU threads where the engine runs
    memory: EngineMemory
    blocks: BlockSnapshot  # the pool before any command
    proposer: str | None  # the speculation proposer's name, if one was loaded
    speculate: bool
    num_draft: int

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        proposer = engine.proposer.name if engine.proposer is not None else None
        return cls(
            str(engine.model_dir),
            engine.precision,
            engine.device,
            engine.graphs,
            torch.get_num_threads(),
            EngineMemory.of(engine),
            engine.block_map.snapshot(),
            proposer,
            engine.speculate,
            engine.num_draft,
        )

    @property
    def model_name(self) -> str:
        return Path(self.model_dir).name


class EngineLoop:
    """Applies commands between steps, steps while there is work, waits for commands otherwise.

    `port` connects it to the app: port.take(block) returns the next command (NOTHING when none waits and
    block is False), port.emit(event) hands an event over, port.flush(idle) is called once a turn.
    """

    def __init__(self, engine: Engine, port) -> None:
        self.engine, self.port = engine, port
        self.active: int | None = None  # the request of the reply in flight
        self._paused = False
        self._first_seen: set[int] = set()
        self._snapshot = engine.block_map.snapshot()  # the last block snapshot the app was sent
        self._read_at = 0.0

    def run(self) -> None:
        emit, was_working = self.port.emit, True
        while True:
            working = self.engine.has_unfinished() and not self._paused
            now = time.perf_counter()
            if was_working and not working or working and now - self._read_at >= MEMORY_EVERY_S:
                self._read_at = now
                emit(MemoryRead(read_memory(self.engine.device)))
            was_working = working
            self.port.flush(not working)
            cmd = self.port.take(not working)
            while cmd is not NOTHING:
                if cmd is None:
                    self._abort_active()
                    self.port.flush(True)
                    return
                self._run_command(cmd)
                cmd = self.port.take(False)
            snap = self.engine.block_map.snapshot()
            if snap is not self._snapshot:  # commands freed or took blocks: let the app see it now
                self._snapshot = snap
                emit(BlocksChanged(snap))
            if self.engine.has_unfinished() and not self._paused:
                self._step()

    def _run_command(self, cmd: Command) -> None:
        name, *args = cmd
        try:
            getattr(self, f"_cmd_{name}")(*args)
        except PagechatError as e:
            self.port.emit(Refused(None, str(e)))
        except Exception as e:  # noqa: BLE001 - the app must stay up; show the engine's failure as a message
            self.port.emit(Refused(None, f"engine error: {type(e).__name__}: {e}"))

    # -- commands -----------------------------------------------------------------------------------
    def _cmd_send(self, ticket: int, messages: list[dict], params: SamplingParams) -> None:
        try:
            ids = self.engine.encode_chat(messages)
        except PagechatError as e:
            self.port.emit(Refused(ticket, str(e)))
            return
        self._abort_active()  # one reply at a time: a new prompt replaces the one in flight
        try:
            rid = self.engine.add_request(ids, params)
        except PagechatError as e:
            self.port.emit(Refused(ticket, str(e)))
            return
        self.active = rid
        self.port.emit(Started(ticket, rid, len(ids)))

    def _cmd_update(self, params: SamplingParams) -> None:
        rid, at = self.active, 0
        if rid is not None and not self.engine.requests[rid].finished:
            seq = self.engine.requests[rid]
            # keep the request's own limits that the controls do not own
            own = seq.sampling.params
            params = replace(params, stop=own.stop, ignore_eos=own.ignore_eos)
            self.engine.update_params(rid, params)
            at = seq.num_output_tokens
        else:
            params.validate()
        self.port.emit(ParamsApplied(rid, params, at))

    def _cmd_stop(self) -> None:
        self._abort_active()

    def _cmd_pause(self) -> None:
        self._paused = True

    def _cmd_resume(self) -> None:
        self._paused = False

    def _cmd_advance(self, steps: int) -> None:
        for _ in range(steps):
            if self.engine.has_unfinished():
                self._step()

    def _cmd_speculation(self, enabled: bool, num_draft: int) -> None:
        self.engine.set_speculation(enabled, num_draft)
        self.port.emit(SpeculationSet(self.engine.speculate, self.engine.num_draft))

    def _cmd_sync(self, n: int) -> None:
        self.port.emit(Synced(n))

    # -- stepping -----------------------------------------------------------------------------------
    def _abort_active(self) -> None:
        rid = self.active
        if rid is not None and not self.engine.requests[rid].finished:
            self.engine.abort(rid)
            self._finish(rid)

    def _finish(self, rid: int) -> None:
        seq = self.engine.requests[rid]
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        total = (seq.finish_time or time.perf_counter()) - seq.arrival
        self.port.emit(
            Finished(
                rid,
                seq.finish_reason,
                seq.error,
                seq.num_output_tokens,
                seq.num_cached_tokens,
                ttft,
                total,
            )
        )
        if rid == self.active:
            self.active = None

    def _step(self) -> None:
        try:
            report = self.engine.step()
        except Exception as e:  # noqa: BLE001 - shown as a message; the app stays up
            self.port.emit(Refused(None, f"engine step failed: {type(e).__name__}: {e}"))
            self._abort_active()
            return
        self.port.emit(report)
        self._snapshot = report.blocks
        for out in report.outputs:
            rid = out.request_id
            if out.token_ids and rid not in self._first_seen:
                self._first_seen.add(rid)
                seq = self.engine.requests[rid]
                self.port.emit(FirstToken(rid, seq.first_token_time - seq.arrival))
            if out.finished:
                self._finish(rid)


class EngineClient:
    """The app's side: every method only posts a command; events arrive in `events`, in order."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.events: deque[Event] = deque()
        self._held: Command | None = None  # a send held back until release()
        self._closed = False
        self._sync_sent = self._sync_done = 0
        self._synced = threading.Condition()

    # -- what a transport provides ------------------------------------------------------------------
    def start(self) -> EngineClient:
        raise NotImplementedError

    def _post(self, cmd: Command | None) -> None:
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def _join(self, timeout: float) -> None:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------------
    def _deliver(self, ev) -> None:
        """Hand one event from the engine to the app (any thread)."""
        if isinstance(ev, Synced):
            with self._synced:
                self._sync_done = ev.n
                self._synced.notify_all()
        else:
            self.events.append(ev)

    def _put(self, cmd: Command | None) -> None:
        """Post a command; a held send goes first, so the engine sees commands in the order the UI gave them."""
        self.release()
        self._post(cmd)

    def close(self, timeout: float = 5.0) -> None:
        """Abort what runs and stop the engine's loop."""
        if not self._closed:
            self._closed = True
            self._put(None)
            self._join(timeout)

    def send(
        self, ticket: int, messages: list[dict], params: SamplingParams, hold: bool = False
    ) -> None:
        """Start a reply to the conversation `messages` (chat template applied where the engine runs).

        hold: keep the command until release() (or the next command): the app draws the new turn first, so
        that its layout (tens of ms of Python) does not run while the engine decodes.
        """
        cmd = ("send", ticket, messages, replace(params))
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
        self._put(("update", replace(params)))

    def stop(self) -> None:
        """Abort the reply in flight, keeping what it generated."""
        self._put(("stop",))

    def pause(self) -> None:
        """Stop stepping after the current step (commands are still applied); for tests and screenshots."""
        self._put(("pause",))

    def resume(self) -> None:
        self._put(("resume",))

    def advance(self, steps: int) -> None:
        """Run exactly `steps` engine steps now, paused or not (deterministic screenshots and tests)."""
        self._put(("advance", steps))

    def set_speculation(self, enabled: bool, num_draft: int) -> None:
        """Switch speculation and set the draft length from the next step; answered by SpeculationSet."""
        self._put(("speculation", enabled, num_draft))

    def sync(self, timeout: float = 2.0) -> bool:
        """Block until the engine has applied every command posted so far and its events are in `events`."""
        if not self.is_alive():
            return False
        self._sync_sent += 1
        n = self._sync_sent
        self._put(("sync", n))
        with self._synced:
            return self._synced.wait_for(lambda: self._sync_done >= n, timeout)


class ThreadedEngine(EngineClient):
    """The engine loop on a thread of this process: it shares the UI's GIL, and `engine` is reachable."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(EngineInfo.of(engine))
        self.engine = engine
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=EngineLoop(engine, self).run, name="pagechat-engine", daemon=True
        )

    def start(self) -> ThreadedEngine:
        self._thread.start()
        return self

    def _post(self, cmd: Command | None) -> None:
        self._commands.put(cmd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # -- the loop's port (engine thread) ------------------------------------------------------------
    def take(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return NOTHING

    def emit(self, ev) -> None:
        self._deliver(ev)

    def flush(self, idle: bool) -> None:
        """Events are in `events` as soon as they are emitted."""
