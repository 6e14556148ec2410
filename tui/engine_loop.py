"""EngineLoop: the one place that calls the engine once the app is up.

Between steps it applies the app's commands, steps while there is work and emits events; when
there is no work it waits for a command. The engine is not thread-safe, so every engine call
happens here, on the loop's thread or in the engine's process.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError, one_line
from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.memory import read_memory
from pagechat.core.wire import MEMORY_EVERY_S
from pagechat.tui.context import fit_turns, reply_room
from pagechat.tui.load import LoadPlan, load_params, load_prompt
from pagechat.tui.protocol import (
    Abort,
    Advance,
    Close,
    Command,
    LoadSet,
    ParamsApplied,
    Pause,
    Refused,
    Resume,
    Send,
    SetSpeculation,
    SpeculationSet,
    StartLoad,
    Stop,
    StopLoad,
    Sync,
    Synced,
    UpdateParams,
)

NOTHING = ...  # a port's take(): no command waiting


class Port(Protocol):
    """How the loop reaches the app: a queue on a thread, or a pipe to the app's process."""

    def take(self, block: bool) -> Command | None:
        """The next command; NOTHING when none waits and block is False, None when the app is
        gone."""

    def emit(self, event) -> None:
        """Hand an event over (the port may batch it)."""

    def flush(self, idle: bool) -> None:
        """Called once a turn; idle: the engine has no work."""


class EngineLoop:
    """Applies commands between steps, steps while there is work, waits for commands otherwise."""

    def __init__(self, engine: Engine, port: Port) -> None:
        self.engine, self.port = engine, port
        self.active: int | None = None  # the newest request of the reply in flight
        self.beside: list[int] = []  # the reply's other requests still running (its branches)
        self._paused = False
        self._first_seen: set[int] = set()
        self._ended: set[int] = set()  # requests with a sequence that ended, not yet released
        self._snapshot = engine.block_map.snapshot()  # the last block snapshot the app was sent
        self._read_at = 0.0
        self.load: LoadPlan | None = None  # background requests still to start
        self.load_ids: list[int] = []  # background requests started and not stopped
        self._load_tokens = 0
        self._handlers = {
            Send: self._send,
            UpdateParams: self._update,
            Stop: lambda _: self._abort_active(),
            Abort: lambda cmd: self._abort(cmd.request_ids),
            Pause: lambda _: self._set_paused(True),
            Resume: lambda _: self._set_paused(False),
            Advance: self._advance,
            SetSpeculation: self._set_speculation,
            Sync: lambda cmd: self.port.emit(Synced(cmd.n)),
            StartLoad: self._start_load,
            StopLoad: lambda _: self._stop_load(),
        }

    def run(self) -> None:
        """Until a Close command (or the app going away)."""
        was_working = True
        while True:
            self._feed_load()
            working = self.engine.has_unfinished() and not self._paused
            self._read_memory(was_working and not working, working)
            was_working = working
            self.port.flush(not working)
            if not self._apply_commands(block=not working and self.load is None):
                return
            if not working and self.load is not None:  # nothing to step until the next is due
                time.sleep(min(0.05, self.load.wait(time.perf_counter())))
            snap = self.engine.block_map.snapshot()
            if snap is not self._snapshot:  # commands freed or took blocks: let the app see it now
                self._snapshot = snap
                self.port.emit(BlocksChanged(snap, self.engine.sequences()))
            if self.engine.has_unfinished() and not self._paused:
                self._step()

    def _read_memory(self, went_idle: bool, working: bool) -> None:
        now = time.perf_counter()
        if went_idle or working and now - self._read_at >= MEMORY_EVERY_S:
            self._read_at = now
            self.port.emit(MemoryRead(read_memory(self.engine.device)))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every waiting command (wait for one if `block`); False once the loop must end."""
        cmd = self.port.take(block)
        while cmd is not NOTHING:
            if cmd is None or isinstance(cmd, Close):
                self._abort_active()
                self._stop_load()
                self.port.flush(True)
                return False
            self._run_command(cmd)
            cmd = self.port.take(False)
        return True

    def _run_command(self, cmd: Command) -> None:
        try:
            self._handlers[type(cmd)](cmd)
        except Exception as e:  # noqa: BLE001 - the app must stay up; show the failure as a message
            self.port.emit(Refused(None, one_line(e)))

    # -- commands ----------------------------------------------------------------------------------
    def _send(self, cmd: Send) -> None:
        """Start a reply; any failure to start it refuses its ticket, so the reply ends."""
        context = self.engine.max_model_len
        room = reply_room(cmd.params.max_tokens, context) + len(cmd.prefix)
        try:
            ids, dropped = fit_turns(
                cmd.messages, self.engine.encode_chat, context, room, cmd.when_full
            )
            ids += cmd.prefix
            if not cmd.beside:  # one reply at a time: a new prompt replaces the one in flight
                self._abort_active()
            rid = self.engine.add_request(ids, cmd.params)
        except Exception as e:  # noqa: BLE001 - said in the reply, whatever raised
            self.port.emit(Refused(cmd.ticket, one_line(e)))
            return
        if cmd.beside and self.active is not None:
            self.beside.append(self.active)
        self.active = rid
        self.port.emit(Started(cmd.ticket, rid, len(ids), dropped=dropped))

    def _update(self, cmd: UpdateParams) -> None:
        rid, at, params = self.active, 0, cmd.params
        if rid is not None and not self._done(rid):
            seq = self.engine.requests[rid]
            # keep what the request was started as (its answers, its limits), which no later
            # setting can change
            own = seq.sampling.params
            params = replace(
                params,
                stop=own.stop,
                ignore_eos=own.ignore_eos,
                n=own.n,
                beam_width=own.beam_width,
                length_penalty=own.length_penalty,
                early_stopping=own.early_stopping,
            )
            for j, i in enumerate([rid, *seq.children]):  # every sample, each on its own seed
                if not self.engine.requests[i].finished:
                    seed = None if params.seed is None else params.seed + j
                    self.engine.update_params(i, replace(params, seed=seed))
            at = seq.num_output_tokens
        else:
            params.validate()
        self.port.emit(ParamsApplied(rid, params, at))

    def _start_load(self, cmd: StartLoad) -> None:
        """Start `count` background requests at `rate` a second (any earlier load stops)."""
        if cmd.count < 1 or not cmd.rate > 0:
            raise PagechatError(f"load needs at least 1 request at a rate > 0, got {cmd}")
        self._stop_load()
        self.load = LoadPlan(cmd.count, cmd.rate, time.perf_counter())
        self._load_tokens = cmd.max_tokens
        self.port.emit(LoadSet(cmd.count))

    def _feed_load(self) -> None:
        """Queue the background requests that are due, each named for the app."""
        plan = self.load
        if plan is None:
            return
        due = plan.due(time.perf_counter())
        if not due:
            return
        self.load_ids = [i for i in self.load_ids if not self._done(i)]
        for k in due:
            ids = self.engine.encode_chat(load_prompt(k))
            # behind the chat: admitted after it and preempted before it
            rid = self.engine.add_request(ids, load_params(k, self._load_tokens), priority=1)
            self.load_ids.append(rid)
            self.port.emit(Started(None, rid, len(ids), f"load {k + 1}"))
        self.port.emit(LoadSet(plan.left))
        if not plan.left:
            self.load = None

    def _stop_load(self) -> None:
        """Start no more background requests and abort the ones that run."""
        was = self.load is not None or self.load_ids
        self.load = None
        self._abort(self.load_ids)
        self.load_ids = []
        if was:
            self.port.emit(LoadSet(0))

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused

    def _advance(self, cmd: Advance) -> None:
        for _ in range(cmd.steps):
            if self.engine.has_unfinished():
                self._step()

    def _set_speculation(self, cmd: SetSpeculation) -> None:
        self.engine.set_speculation(cmd.enabled, cmd.num_draft)
        self.port.emit(SpeculationSet(self.engine.speculate, self.engine.num_draft))

    # -- stepping ----------------------------------------------------------------------------------
    def _abort_active(self) -> None:
        """Abort the reply in flight: its requests (branches too) and the samples forked from
        them."""
        for rid in [*self.beside, *([] if self.active is None else [self.active])]:
            self._abort((rid, *self.engine.requests[rid].children))

    def _abort(self, request_ids) -> None:
        """Abort these requests (samples included), keeping what they generated; one already
        finished (and released) is left as it is."""
        for rid in request_ids:
            seq = self.engine.requests.get(rid)
            if seq is not None and not seq.finished:
                self.engine.abort(rid)
                self._finish(rid)
        self._release_ended()

    def _done(self, rid: int) -> bool:
        """A request and every sample forked from it have finished (a released one had)."""
        seq = self.engine.requests.get(rid)
        return seq is None or (
            seq.finished and all(self.engine.requests[c].finished for c in seq.children)
        )

    def _finish(self, rid: int) -> None:
        seq = self.engine.requests[rid]
        self.port.emit(Finished.of(seq))
        self.beside = [r for r in self.beside if not self._done(r)]
        if self.active is not None and self._done(self.active):
            self.active = self.beside.pop() if self.beside else None
        self._ended.add(rid if seq.parent is None else seq.parent)

    def _release_ended(self) -> None:
        """Forget every request whose sequences have all ended and been told to the app (it holds
        the records it was sent), so a long sitting keeps nothing in the engine per reply."""
        for root in [r for r in self._ended if self._done(r)]:
            released = self.engine.release(root)
            self._first_seen.difference_update((root, *released.children))
            self._ended.discard(root)

    def _step(self) -> None:
        # A failure inside a step's work fails the requests it ran (Engine.step); one outside it
        # leaves the engine in no known state, so it ends the loop and the app starts a new engine.
        report = self.engine.step()
        self.port.emit(report)
        self._snapshot = report.blocks
        for out in report.outputs:
            rid = out.request_id
            if out.token_ids and rid not in self._first_seen:
                self._first_seen.add(rid)
                self.port.emit(FirstToken.of(self.engine.requests[rid]))
            if out.finished:
                self._finish(rid)
        self._release_ended()
