"""The app's engine loop: core's EngineLoop with the app's commands: a reply fitted to the
context (core's loop tells it), sampling changes while it streams, stop, pause and single steps,
speculation settings, and background load at a steady rate.
"""

from __future__ import annotations

import time

from pagechat.core.engine_loop import EngineLoop
from pagechat.core.errors import PagechatError, one_line
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


class AppLoop(EngineLoop):
    """The engine loop as the app drives it."""

    def __init__(self, engine, port) -> None:
        super().__init__(engine, port)
        self.reply: list[int] = []  # the reply in flight's requests (its branches), newest last
        self.load: LoadPlan | None = None  # background requests still to start
        self.load_ids: list[int] = []  # background requests started and not stopped
        self._load_tokens = 0
        self._handlers = {
            Send: self._send,
            UpdateParams: self._update,
            Stop: lambda _: self._abort_reply(),
            Abort: lambda cmd: self.abort(cmd.request_ids, samples=False),
            Pause: lambda _: setattr(self, "paused", True),
            Resume: lambda _: setattr(self, "paused", False),
            Advance: self._advance,
            SetSpeculation: self._set_speculation,
            Sync: lambda cmd: self.port.emit(Synced(cmd.n)),
            StartLoad: self._start_load,
            StopLoad: lambda _: self._stop_load(),
        }

    def handle(self, cmd: Command) -> bool:
        if isinstance(cmd, Close):
            return False
        try:
            self._handlers[type(cmd)](cmd)
        except Exception as e:  # noqa: BLE001 - the app must stay up; show the failure as a message
            self.port.emit(Refused(None, one_line(e)))
        return True

    def tick(self) -> float | None:
        """Start the background requests that are due; seconds until the next one."""
        plan = self.load
        if plan is None:
            return None
        now = time.perf_counter()
        due = plan.due(now)
        if due:
            self.load_ids = [i for i in self.load_ids if not self.done(i)]
            for k in due:
                ids = self.encode_chat(load_prompt(k))
                # behind the chat: admitted after it and preempted before it
                params = load_params(k, self._load_tokens)
                self.load_ids.append(self.add(ids, params, 1, label=f"load {k + 1}"))
            self.port.emit(LoadSet(plan.left))
            if not plan.left:
                self.load = None
                return None
        return plan.wait(now)

    def closing(self) -> None:
        self._abort_reply()
        self._stop_load()

    # -- commands --------------------------------------------------------------------------------
    def _send(self, cmd: Send) -> None:
        """Start a reply; any failure to start it refuses its ticket, so the reply ends."""
        context = self.engine.max_model_len
        room = reply_room(cmd.params.max_tokens, context) + len(cmd.prefix)
        try:
            ids, dropped = fit_turns(cmd.messages, self.encode_chat, context, room, cmd.when_full)
            ids += cmd.prefix
            if not cmd.beside:  # one reply at a time: a new prompt replaces the one in flight
                self._abort_reply()
            rid = self.add(ids, cmd.params, ticket=cmd.ticket, dropped=dropped)
        except Exception as e:  # noqa: BLE001 - said in the reply, whatever raised
            self.port.emit(Refused(cmd.ticket, one_line(e)))
            return
        self.reply = [r for r in self.reply if not self.done(r)] + [rid]

    @property
    def active(self) -> int | None:
        """The newest request of the reply in flight that is still running."""
        self.reply = [r for r in self.reply if not self.done(r)]
        return self.reply[-1] if self.reply else None

    def _update(self, cmd: UpdateParams) -> None:
        rid, at, params = self.active, 0, cmd.params
        if rid is not None:
            params, at = self.update(rid, params)
        else:
            params.validate()
        self.port.emit(ParamsApplied(rid, params, at))

    def _abort_reply(self) -> None:
        """Abort the reply in flight: its requests (branches too) and their samples."""
        self.abort(self.reply)
        self.reply = []

    def _start_load(self, cmd: StartLoad) -> None:
        """Start `count` background requests at `rate` a second (any earlier load stops)."""
        if cmd.count < 1 or not cmd.rate > 0:
            raise PagechatError(f"load needs at least 1 request at a rate > 0, got {cmd}")
        self._stop_load()
        self.load = LoadPlan(cmd.count, cmd.rate, time.perf_counter())
        self._load_tokens = cmd.max_tokens
        self.port.emit(LoadSet(cmd.count))

    def _stop_load(self) -> None:
        """Start no more background requests and abort the ones that run."""
        was = self.load is not None or self.load_ids
        self.load = None
        self.abort(self.load_ids)
        self.load_ids = []
        if was:
            self.port.emit(LoadSet(0))

    def _advance(self, cmd: Advance) -> None:
        for _ in range(cmd.steps):
            if self.engine.has_unfinished():
                self.step()

    def _set_speculation(self, cmd: SetSpeculation) -> None:
        self.engine.set_speculation(cmd.enabled, cmd.num_draft)
        self.port.emit(SpeculationSet(self.engine.speculate, self.engine.num_draft))
