"""PagechatApp: chat with a local model while inspector panels render the engine's records."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pagechat.core.errors import PagechatError, one_line
from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport
from pagechat.tui.client import EngineClient
from pagechat.tui.export_screen import ExportScreen
from pagechat.tui.heap import settle_heap
from pagechat.tui.history import ChatRecord, ChatStore, export_markdown
from pagechat.tui.protocol import LoadSet, Refused, SpeculationSet
from pagechat.tui.screens import PANELS, HelpScreen, MainScreen, StatusBar, status_line
from pagechat.tui.session import ChatSession, Message, ReplyToken, engine_facts
from pagechat.tui.widgets.blocks import BlocksPanel
from pagechat.tui.widgets.chat import PromptInput, ReplyView
from pagechat.tui.widgets.controls import ControlsPanel
from pagechat.tui.widgets.memory import MemoryPanel
from pagechat.tui.widgets.sampling import SamplingPanel, token_label
from pagechat.tui.widgets.scheduler import SchedulerLog, SchedulerPanel
from pagechat.tui.widgets.speculation import SpeculationPanel
from pagechat.tui.widgets.timing import TimingPanel
from rich.text import Text
from textual import events, on
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.screen import Screen
from textual.theme import BUILTIN_THEMES
from textual.widget import AwaitMount
from textual.widgets import Input, Tabs

# The app's own colours, as theme variables ($pc-... in the .tcss; app.theme_variables in code).
PALETTE = {
    "pc-accent": "#5fafff",  # the badge, keys, the cursor, decode steps, weights, kept candidates
    "pc-on-accent": "#1c1c1c",  # text on the accent
    "pc-good": "#87d787",  # generating, chosen and kept candidates, accepted drafts, KV in use
    "pc-bad": "#ff8787",  # errors, refusals, cut candidates, rejected drafts
    "pc-warn": "#ffaf5f",  # a stopped reply, speculation off, prefill steps
    "pc-note": "#ffd75f",  # bonus tokens, a folded block map
    "pc-other": "#d787ff",  # mixed steps, memory nobody accounts for
    "pc-cached": "#00af87",  # prefix-cached blocks
    "pc-muted": "#8a8a8a",  # table headers, cut candidates
    "pc-faint": "#585858",  # free blocks, the bars of cut candidates
    "pc-glyph": "#d0d0d0",  # the block legend's marks
    "pc-unowned": "#ffffff",  # a used block that no sequence owns
    "pc-kv-free": "#2e5e2e",  # KV pool allocated but not in use
    "pc-mem-free": "#3a3a3a",  # free memory
    "pc-token-even": "#262b33",  # alternate token backgrounds make token boundaries visible
    "pc-token-odd": "#1d2129",
    "pc-cyan": "#5fd7d7",  # two more hues, so that eight sequences' blocks differ
    "pc-lavender": "#afafff",
    # eight more, so that sixteen sequences' blocks differ
    "pc-seq-8": "#ff5faf",
    "pc-seq-9": "#87ffaf",
    "pc-seq-10": "#d7af5f",
    "pc-seq-11": "#5f87ff",
    "pc-seq-12": "#ff875f",
    "pc-seq-13": "#afd75f",
    "pc-seq-14": "#af5fd7",
    "pc-seq-15": "#5fafaf",
}
# Textual's dark theme with the palette: any other theme gets the palette as its defaults
THEME = replace(BUILTIN_THEMES["textual-dark"], name="pagechat", variables=PALETTE)
GRID_MIN = (150, 40)  # terminal size from which every panel is shown at once
MAX_ANSWERS = 8  # samples, beams or branches of one turn
MAX_BRANCHES = 4  # branches of a turn running at once
FPS = 20  # the UI renders the latest report at most this often
UI_CPU_BUDGET = 0.03  # while decoding, the UI thread's share of one core (see within_budget)
MAX_FRAME_GAP = 0.5  # ...but draw at least twice a second
WATCH_S = 0.25  # how often the app checks that the engine still runs and answers


class PagechatApp(App[None]):
    """The chat screen with KV blocks, timing, sampling, speculation, memory and controls panels."""

    CSS_PATH = "app.tcss"
    TITLE = "pagechat"
    # priority: the prompt (a TextArea) binds F6/F7 itself; Esc and F1 stay normal so that the
    # help screen gets them. The help screen lists these, so each says what it does in its tooltip.
    BINDINGS = [
        Binding(
            "escape",
            "stop",
            "Stop",
            tooltip="stop the reply (keeps the partial text); else back to the prompt",
        ),
        Binding(
            "ctrl+n",
            "new_chat",
            "New chat",
            priority=True,
            tooltip="new chat (frees its KV blocks; prefix-cached blocks stay cached)",
        ),
        Binding(
            "ctrl+s", "export", "Export .md", priority=True, tooltip="export this chat as Markdown"
        ),
        Binding(
            "ctrl+o",
            "export_to",
            "Export to…",
            show=False,
            priority=True,
            tooltip="write the chat to a path you type (JSON, or Markdown for .md)",
        ),
        Binding(
            "ctrl+r",
            "inspect",
            "Tokens",
            priority=True,
            tooltip="inspect the last reply's tokens; retry it if it failed",
        ),
        Binding("f1", "help", "Help", tooltip="this help"),
        Binding("question_mark", "help", "Help", show=False, tooltip="this help"),
        Binding(
            "f2",
            "next_panel",
            "Panel",
            priority=True,
            tooltip="next inspector panel (tabbed layout)",
        ),
        Binding(
            "f3",
            "toggle_layout",
            "Layout",
            show=False,
            priority=True,
            tooltip="switch layout: tabs / all panels",
        ),
        Binding(
            "f4",
            "focus_controls",
            "Controls",
            show=False,
            priority=True,
            tooltip="focus the controls",
        ),
        Binding(
            "f5",
            "nudge('temperature', -0.1)",
            "T−",
            show=False,
            priority=True,
            tooltip="temperature −0.1",
        ),
        Binding(
            "f6",
            "nudge('temperature', 0.1)",
            "T+",
            show=False,
            priority=True,
            tooltip="temperature +0.1",
        ),
        Binding(
            "f7",
            "nudge('top_p', -0.05)",
            "top-p−",
            show=False,
            priority=True,
            tooltip="top-p −0.05",
        ),
        Binding(
            "f8", "nudge('top_p', 0.05)", "top-p+", show=False, priority=True, tooltip="top-p +0.05"
        ),
        Binding(
            "f9",
            "cycle_answers('n')",
            "Samples",
            show=False,
            priority=True,
            tooltip="answers per prompt: 1, 2, 4 or 8 samples decoded together",
        ),
        Binding(
            "f10",
            "cycle_answers('beam_width')",
            "Beams",
            show=False,
            priority=True,
            tooltip="beam search: off, 2, 4 or 8 beams",
        ),
        Binding(
            "ctrl+l",
            "toggle_load",
            "Load",
            priority=True,
            tooltip="background load: start requests from built-in prompts (Controls: how many, "
            "how fast), or stop them",
        ),
        Binding(
            "alt+left",
            "show_answer(-1)",
            "Prev answer",
            show=False,
            priority=True,
            tooltip="show the previous answer (samples or beams of the last reply)",
        ),
        Binding(
            "alt+right",
            "show_answer(1)",
            "Next answer",
            show=False,
            priority=True,
            tooltip="show the next answer",
        ),
        Binding(
            "ctrl+t",
            "keep_answer",
            "Keep answer",
            show=False,
            priority=True,
            tooltip="keep the answer shown: the chat goes on from it, the others' blocks are freed",
        ),
        # declared here (as App would add it) so that the help lists it
        Binding(
            App.COMMAND_PALETTE_BINDING,
            "command_palette",
            "palette",
            show=False,
            priority=True,
            tooltip="command palette (every action)",
        ),
    ]

    def __init__(
        self,
        loop: EngineClient,
        *,
        chat: ChatRecord | None = None,
        params: SamplingParams | None = None,
        store: ChatStore | None = None,
        save_path: Path | None = None,
        frozen: bool = False,
        layout: str = "auto",
        autosave: bool = True,
        facts: dict | None = None,
        notices: tuple[str, ...] = (),
        when_full: str = "drop",
    ) -> None:
        """`loop`: the engine's client, not started yet (the app starts and closes it); `facts`:
        engine_facts() each reply records; `notices`: warnings shown once the app is up;
        `when_full`: a chat too long for the context drops its oldest turns, or refuses."""
        super().__init__()
        self.register_theme(THEME)
        self.theme = THEME.name
        self.loop, info = loop, loop.info
        base = params or SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512)
        facts = facts or engine_facts(info)
        self.session = ChatSession(chat or ChatRecord(model=info.model_dir), base, facts)
        self.notices = notices
        self.store = store or ChatStore()
        self.save_path = save_path
        self.autosave = autosave
        # hide numbers that vary between runs (snapshot tests); every widget reads it from here
        self.frozen = frozen
        self.layout_mode = layout  # auto | tabs | grid
        self.session.blocks = info.blocks
        self.memory = info.memory
        self.speculation = (
            info.speculate,
            info.num_draft,
        )  # as the engine has it (SpeculationSet events)
        self.readings = None  # the engine's latest MemoryRead
        self.sched = SchedulerLog()  # the scheduler's records, engine-wide (not per chat)
        self.load_left = 0  # background requests still to start (LoadSet)
        self.pinned: tuple[Message, int] | None = (
            None  # selected reply token shown in the sampling panel
        )
        self.active_panel = "blocks"
        self.term_size: Size | None = None
        # the chat and its panels, reached through this whatever screen is on top (the help, say)
        self.main = MainScreen(self.session.system, self.memory, base, self.spec_controls())
        self._dirty: dict[int, Message] = {}  # messages changed since the last draw
        self._render_due = False
        self._time_mark, self._cpu_mark = time.perf_counter(), time.thread_time()
        self.restarting = False  # the engine stopped; a new one is loading
        self.when_full = when_full

    # -- layout ------------------------------------------------------------------------------------
    def get_theme_variable_defaults(self) -> dict[str, str]:
        return PALETTE

    def get_default_screen(self) -> MainScreen:
        return self.main

    async def on_mount(self) -> None:
        """Fill the main screen and start the engine's loop."""
        await AwaitMount(self.main, [self.main])  # the screen composes in its own task
        log = self.main.chat_log
        for m in self.session.messages:
            log.add(m)
        self.loop.start()
        self.apply_layout()
        self.set_timer(1 / FPS, self._tick)
        self.set_interval(1.0, self.refresh_memory)
        self.set_interval(WATCH_S, self.watch_engine)
        self.main.prompt.focus()
        self.refresh_panels(everything=True)
        self.call_after_refresh(settle_heap, True)
        for text in self.notices:
            self.notify(text, title="warning", severity="warning", timeout=15, markup=False)

    def on_unmount(self) -> None:
        self.loop.close()
        self.save()

    def on_resize(self, event: events.Resize) -> None:
        self.term_size = event.size  # App.size is updated only after this handler runs
        self.apply_layout()

    def grid_layout(self) -> bool:
        if self.layout_mode != "auto":
            return self.layout_mode == "grid"
        size = self.term_size or self.size
        return size.width >= GRID_MIN[0] and size.height >= GRID_MIN[1]

    def apply_layout(self) -> None:
        """Tabs (one panel at a time) on small terminals, every panel in a grid on big ones."""
        grid = self.grid_layout()
        if not self.main.query("#panels"):
            return  # not composed yet
        self.main.set_layout(grid, self.active_panel)
        self.call_after_refresh(self.refresh_panels, True)

    def show_panel(self, key: str) -> None:
        """Make `key` the active panel (the visible one in the tabbed layout)."""
        self.active_panel = key
        self.main.show_panel(key)
        self.call_after_refresh(self.refresh_panels, True)

    @on(Tabs.TabActivated, "#panel-tabs")
    def _tab(self, event: Tabs.TabActivated) -> None:
        """A tab clicked.

        Keys switch panels too, and each switch posts this event: one that arrives after a later
        switch (keys pressed in a burst) names a tab no longer active and is not a request.
        """
        if event.tab.id and event.tab.id == event.tabs.active != self.active_panel:
            self.show_panel(event.tab.id)

    def visible(self, key: str) -> bool:
        return self.grid_layout() or key == self.active_panel

    # -- the render loop ---------------------------------------------------------------------------
    def pump(self, force: bool = False) -> None:
        """Drain the engine's events into the session, then render if the CPU budget allows."""
        events = self.loop.events
        if not self.is_running or not self.main.is_attached:
            return
        finished, first, quiet = (
            False,
            False,
            not events,
        )  # quiet: the engine produced nothing since the last tick
        while events:
            ev = events.popleft()
            if isinstance(ev, MemoryRead):
                self.readings = ev.readings
                continue
            if isinstance(ev, SpeculationSet):
                self.speculation = (ev.enabled, ev.num_draft)
            self.note_scheduler(ev)
            msg = self.session.apply(ev)
            if msg is not None:
                self._dirty[id(msg)] = msg
            if isinstance(ev, Refused):
                self.notify(ev.message, title="refused", severity="error", timeout=8)
            # background requests are drawn at the frame rate: no save or draw now for them
            finished |= isinstance(ev, Refused) or isinstance(ev, Finished) and msg is not None
            first |= isinstance(ev, FirstToken) and msg is not None
            self._render_due = True
        if self.session.context_from != self.main.chat_log.context_from:  # oldest turns dropped
            self.main.chat_log.mark_context(self.session.messages, self.session.context_from)
        if finished:
            self.save()
            settle_heap()
            self.main.prompt.cursor_blink = self.session.streaming is None
        if not self._render_due or not (
            force or finished or first or quiet or self.within_budget()
        ):
            return
        self._render_due = False
        self._time_mark, self._cpu_mark = time.perf_counter(), time.thread_time()
        log = self.main.chat_log
        for msg in self._dirty.values():
            log.update(msg)
        self._dirty.clear()
        self.refresh_panels()

    def note_scheduler(self, ev) -> None:
        """Fold the scheduler's records of an event into the scheduler panel's log."""
        if isinstance(ev, StepReport):
            self.sched.apply(ev)
        elif isinstance(ev, BlocksChanged):
            self.sched.apply_seqs(ev.seqs)
        elif isinstance(ev, Started):
            self.sched.label(ev.request_id, ev.label)
        elif isinstance(ev, LoadSet):
            self.load_left = ev.left

    def _tick(self) -> None:
        """Pump, then sleep until the next frame; while decoding, for the last frame's CPU cost
        over the budget.

        Waking the UI thread takes a core from the engine's thread pool (and, with a ThreadedEngine,
        the GIL) even when nothing is drawn, so a frame that cannot be afforded is not woken up for
        either.
        """
        self.pump()
        delay = 1 / FPS
        streaming = self.session.streaming
        if streaming is not None and (
            streaming.tokens or any(a.tokens for a in streaming.samples)
        ):  # until its first token is drawn, a reply is polled at FPS
            used = time.thread_time() - self._cpu_mark
            delay = min(
                MAX_FRAME_GAP,
                max(delay, used / UI_CPU_BUDGET - (time.perf_counter() - self._time_mark)),
            )
        self.set_timer(delay, self._tick)

    @property
    def render_pending(self) -> bool:
        """Engine events received but not yet drawn (tests wait for this to clear)."""
        return bool(self.loop.events) or self._render_due

    def within_budget(self) -> bool:
        """While a reply streams, draw only if the UI thread used at most UI_CPU_BUDGET of the
        time since the last draw.

        Rendering takes CPU from the engine: it preempts one of the engine's torch threads (each
        parallel op waits for the slowest), and with a ThreadedEngine it also holds the GIL the
        engine needs between torch calls. Capping the UI's share of CPU caps what it can take from
        decoding, whatever a frame costs here.
        """
        if self.session.streaming is None:
            return True
        elapsed = time.perf_counter() - self._time_mark
        return (
            elapsed > MAX_FRAME_GAP
            or time.thread_time() - self._cpu_mark <= UI_CPU_BUDGET * elapsed
        )

    def refresh_panels(self, everything: bool = False) -> None:
        """Render the visible panels from the session's latest report."""
        s = self.session
        status = status_line(self.loop.info, s, self.frozen, self.theme_variables)
        status.append_text(self.load_status())
        loading = bool(self.load_left or self.load_running())
        if self.main.query_one(ControlsPanel).load_on != loading:  # it ran out, or was stopped
            self.main.query_one(ControlsPanel).show_load(loading)
        self.main.query_one(StatusBar).show(status, layout=False)  # always one line
        snap = s.blocks
        if snap is not None and self.visible("blocks"):
            names = {s.seq_id: self.sched.what(s) for s in self.sched.live}
            self.main.query_one(BlocksPanel).show(snap, names)
        if self.visible("sampling"):
            self.show_sampling()
        if self.visible("timing"):
            self.main.query_one(TimingPanel).show(s)
        if self.visible("speculation"):
            on, why, k = self.spec_state()
            self.main.query_one(SpeculationPanel).show(on, why, s.speculation(), s.drafts, k)
        if self.visible("sched"):
            self.main.query_one(SchedulerPanel).show(self.sched)
        if self.visible("memory"):
            if everything:
                self.refresh_memory()
            else:
                self.main.query_one(MemoryPanel).show(s.blocks)

    def spec_controls(self) -> tuple[bool, bool, int]:
        """(a proposer exists, speculation on, draft length) as the engine has them."""
        return self.loop.info.proposer is not None, *self.speculation

    def spec_state(self) -> tuple[bool, str, int]:
        """(on, why, draft length) for the speculation panel, read from the engine's settings."""
        available, on, k = self.spec_controls()
        if not available:
            return False, "no proposer: start with --draft DIR or --ngram", k
        why = f"{self.loop.info.proposer} proposer · draft length {k}"
        return on, why + ("" if on else " · switched off in Controls"), k

    def refresh_memory(self) -> None:
        """Every second (an interval that can fire while the app closes: query, never query_one)."""
        if self.visible("memory"):
            for panel in self.main.query(MemoryPanel):
                panel.show(self.session.blocks, self.readings)

    def show_sampling(self) -> None:
        panel = self.main.query_one(SamplingPanel)
        if self.pinned is not None:
            msg, i = self.pinned
            if 0 <= i < len(msg.tokens):
                tok = msg.tokens[i]
                panel.show(
                    tok.record,
                    f"selected token {i + 1}/{len(msg.tokens)} '{token_label(tok.text)}'",
                    self.session.params,
                )
                return
        rec, label = self.session.latest_sample, "newest token"
        other = self.session.latest_any
        if self.session.streaming is None and other is not None and other is not rec:
            # between replies: whatever else the engine samples (load, a server's other clients)
            rec, label = other, f"newest token of {self.sched.name(other.seq_id)}"
        panel.show(rec, label if rec else "", self.session.params)

    # -- chat actions ------------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    def send(self, event: PromptInput.Submitted) -> None:
        """Send the prompt as the next user turn."""
        text = event.text.strip()
        if not text:
            return
        if not self.can_start():
            return
        last = self.answers_reply()
        if last is not None and last.picked is None:  # the chat goes on from the answer shown
            self.keep_answer(last)
        reply = self.session.add_user(text)
        log = self.main.chat_log
        self.main.prompt.clear()
        self.start_reply(reply, [log.add(self.session.messages[-2]), log.add(reply)])

    def can_start(self) -> bool:
        """Whether a reply can start now; if not, says why (what the user typed stays)."""
        if self.restarting:
            self.notify("the engine is restarting: send again in a moment", severity="warning")
        elif self.session.streaming is not None:
            self.notify("a reply is still streaming: Esc stops it", severity="warning")
        return not self.restarting and self.session.streaming is None

    def start_reply(self, reply: Message, mounts: list[AwaitMount]) -> None:
        """Ask the engine for `reply`, the conversation's new last message, once it is drawn."""
        self.main.prompt.cursor_blink = False  # each blink repaints: none while the engine decodes
        self.pinned = None
        conversation, params = self.session.conversation(), self.session.params
        self.loop.send(reply.ticket, conversation, params, hold=True, when_full=self.when_full)
        self.save()
        self.refresh_panels()
        self.run_worker(self._release_when_drawn(mounts), group="send")

    def retry(self) -> bool:
        """Ask a failed last reply again, in its place; False when the last reply did not fail."""
        if self.session.last_failed() is None:
            return False
        if self.can_start():
            reply, failed = self.session.retry()
            self.start_reply(reply, [self.main.chat_log.remount(reply, instead_of=failed)])
            self.notify("asking again", timeout=2)
        return True

    async def _release_when_drawn(self, mounts: list[AwaitMount]) -> None:
        """Let the engine start the reply once the new turn is mounted, laid out and in view.

        That is Python on the UI thread; run while the engine decodes, it would take a core from
        the engine's first decode steps (and, with a ThreadedEngine, the GIL). Run first, it delays
        the first token by less.
        """
        try:
            for mounted in mounts:
                await mounted
            await self.main.wait_for_refresh()  # the layout with the new widgets
            await self.main.wait_for_refresh()  # the scroll to them
        finally:
            self.loop.release()

    # -- the engine stopping -----------------------------------------------------------------------
    def watch_engine(self) -> None:
        """Every WATCH_S: when the engine died or stopped answering, fail the reply in flight
        (the chat and its finished replies stay), say so and start a new engine."""
        why = None if self.restarting else self.loop.failure()
        if why is None:
            return
        self.pump(force=True)  # what the engine said before it stopped
        self.restarting = True
        self.loop.abandon()
        reply = self.session.fail_streaming(f"the engine stopped: {why}")
        if reply is not None:
            self.main.chat_log.update(reply)
            self.save()
        self.main.prompt.cursor_blink = True
        self.notify(
            f"{why}. Starting a new engine; the chat is kept, Ctrl+R asks a failed reply again",
            title="engine",
            severity="error",
            timeout=10,
            markup=False,
        )
        self.run_worker(self._restart_engine, thread=True, group="restart", exit_on_error=False)

    def _restart_engine(self) -> None:
        """On a worker thread: load a new engine like the last one, then hand it to the app."""
        try:
            client = self.loop.restarted()
        except Exception as e:  # noqa: BLE001 - said in the app, which stays up with the chat
            self.call_from_thread(
                self.notify,
                f"no new engine: {one_line(e)}. Ctrl+O writes the chat out; quit and run again",
                title="engine",
                severity="error",
                timeout=30,
                markup=False,
            )
            return
        self.call_from_thread(self._adopt, client)

    def _adopt(self, client: EngineClient) -> None:
        """Run on the new engine: its pool, its scheduler (the old sequences are gone), the
        speculation the user had set."""
        self.loop, info = client, client.info
        self.session.blocks, self.memory = info.blocks, info.memory
        self.sched, self.load_left = SchedulerLog(), 0
        client.start()
        if (info.speculate, info.num_draft) != self.speculation:
            client.set_speculation(*self.speculation)
        self.restarting = False
        self.refresh_panels(everything=True)
        self.notify("a new engine is up", title="engine", timeout=4)

    # -- background load ---------------------------------------------------------------------------
    def load_running(self) -> int:
        """Background requests the scheduler holds now."""
        return sum(self.sched.what(s).startswith("load") for s in self.sched.live)

    def load_status(self) -> Text:
        """' │ load 5 running · 3 to come' while background requests run, else nothing."""
        running, left = self.load_running(), self.load_left
        if not running and not left:
            return Text()
        t = Text(" │ ", "dim").append(f"load {running} running", self.theme_variables["pc-warn"])
        return t.append(f" · {left} to come" if left else "", "dim")

    def action_toggle_load(self) -> None:
        """Ctrl+L: start background requests as the Controls say, or stop them."""
        controls = self.main.query_one(ControlsPanel)
        if self.load_left or self.load_running():
            self.set_load(False, 0, 0.0)
            return
        values = controls.load_values()
        if values is not None:
            self.set_load(True, *values)

    @on(ControlsPanel.LoadChanged)
    def _load_changed(self, event: ControlsPanel.LoadChanged) -> None:
        self.set_load(event.on, event.count, event.rate)

    def set_load(self, on: bool, count: int, rate: float) -> None:
        """Start `count` background requests at `rate` a second, or stop them."""
        self.load_left = count  # until the engine says how many are left
        if on:
            self.loop.start_load(count, rate)
            message = f"background load: {count} requests at {rate:g} a second (Ctrl+L stops)"
        else:
            self.loop.stop_load()
            message = "background load stopped; its requests are aborted"
        self.main.query_one(ControlsPanel).show_load(on)
        self.notify(message, title="load", timeout=3)

    # -- several answers to a prompt --------------------------------------------------------------
    def answers_reply(self) -> Message | None:
        """The last reply, if it has several answers (samples or beams)."""
        last = next((m for m in reversed(self.session.messages) if m.role == "assistant"), None)
        return last if last is not None and last.samples else None

    def action_cycle_answers(self, name: str) -> None:
        """F9 / F10: the next number of samples (or beams) for the next prompt: 1, 2, 4, 8."""
        p = self.session.params
        value = {1: 2, 2: 4, 4: 8}.get(getattr(p, name), 1)
        other = "beam_width" if name == "n" else "n"  # one or the other: the engine's rule
        self.set_params(replace(p, **{name: value, other: 1}))

    def action_show_answer(self, delta: int) -> None:
        """Alt+←/→: show another answer of the last reply."""
        m = self.answers_reply()
        if m is None or m.picked is not None:
            self.notify("no answers to choose from: F9 asks for several", severity="warning")
            return
        self.main.chat_log.views[id(m)].show((m.shown + delta) % len(m.samples))

    def action_keep_answer(self) -> None:
        """Ctrl+T: keep the answer shown; the others are aborted and their blocks freed."""
        m = self.answers_reply()
        if m is None or m.picked is not None:
            self.notify("no answers to choose from: F9 asks for several", severity="warning")
            return
        if m.beams and m.streaming:
            self.notify(
                "the beam search runs: its hypotheses come when it ends", severity="warning"
            )
            return
        self.keep_answer(m)
        self.notify(f"kept answer {m.picked + 1} of {len(m.samples)}", timeout=3)

    @on(ReplyView.BranchAsked)
    def _branch_asked(self, event: ReplyView.BranchAsked) -> None:
        self.branch(event.message, event.index)

    def branch(self, source: Message, index: int) -> None:
        """Another answer to the last turn with the settings now: `source`'s tokens before
        `index`, then the best candidate not chosen there, then what the model makes of it; or,
        with index -1, the turn asked again. Up to MAX_BRANCHES run at once, beside each other."""
        reply = self.session.messages[-1] if self.session.messages else None
        if reply is None or (source is not reply and source not in reply.samples):
            self.notify("a branch starts in the last reply", severity="warning")
            return
        why = self.no_branch(reply)
        if why:
            self.notify(why, severity="warning")
            return
        given, what = [], "the turn asked again"
        if index >= 0:
            picked = source.tokens[index]
            rec = picked.record
            alt = next((c for c in rec.candidates if not c.chosen), None) if rec else None
            if alt is None:
                self.notify("no other candidate recorded for this token", severity="warning")
                return
            given = [*source.tokens[:index], ReplyToken(alt.token_id, alt.text, None)]
            what = (
                f"branch at token {index + 1}: '{token_label(alt.text)}' instead of "
                f"'{token_label(picked.text)}'"
            )
        plain = not reply.samples
        at = index if index >= 0 else None
        params = replace(self.session.params, n=1, beam_width=1)  # one answer per branch
        answer, conversation, prefix = self.session.branch(source, given, at, params)
        if plain:  # the reply becomes its first answer, beside the branch
            self.main.chat_log.remount(reply)
        else:
            self.main.chat_log.views[id(reply)].add_answer(answer)
        self.pinned = None
        self.main.prompt.focus()
        self.loop.send(answer.ticket, conversation, params, prefix=prefix, beside=True)
        self.notify(what, timeout=4)

    def no_branch(self, reply: Message) -> str | None:
        """Why the last reply can take no branch now, if it cannot."""
        running = [a for a in reply.samples if a.streaming]
        if reply.streaming and not all(a.ticket is not None for a in running):
            return "a reply is still streaming: Esc stops it"  # not its branches alone
        if len(running) >= MAX_BRANCHES:
            return f"at most {MAX_BRANCHES} branches run at once"
        if len(reply.samples) >= MAX_ANSWERS:
            return f"at most {MAX_ANSWERS} answers to a turn"
        return None

    def keep_answer(self, m: Message) -> None:
        others = m.pick(m.shown)
        if others:
            self.loop.abort(others)
        self.main.chat_log.update(m)
        self.save()

    def action_stop(self) -> None:
        """Esc: stop the reply in flight; else unpin the selected token, back to the prompt."""
        if self.session.streaming is not None:
            self.loop.stop()
            return
        if self.pinned is not None:
            self.pinned = None
            self.show_sampling()
        self.main.prompt.focus()

    def action_new_chat(self) -> None:
        """Ctrl+N: abort the reply, save this chat, start an empty one (same system, settings)."""
        self.loop.stop()
        self.pump_now()
        self.save()
        old = self.session
        if old.save_error and not old.saved and old.rescued is None:  # nowhere but in memory
            self.notify("export this chat first (Ctrl+O): it could not be saved", severity="error")
            return
        self.session = old.next_chat(self.loop.info.model_dir)
        self.pinned = None
        self.main.chat_log.clear()
        self.main.prompt.focus()
        self.refresh_panels(everything=True)
        self.call_after_refresh(settle_heap, True)
        self.notify(f"new chat {self.session.record.id}", timeout=3)

    def pump_now(self, timeout: float = 2.0) -> None:
        """Wait briefly for the engine to apply the commands posted so far; drain its events."""
        self.loop.sync(timeout)
        self.pump(force=True)

    def action_export(self) -> None:
        """Ctrl+S: write the chat as Markdown."""
        try:
            path = export_markdown(self.session.to_record())
        except PagechatError as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"exported to {path}", title="export", timeout=6)

    def action_export_to(self) -> None:
        """Ctrl+O: write the chat to a path the user types (the way out when autosave fails)."""
        chat = self.session.to_record()
        default = Path.cwd() / f"pagechat-{chat.id}.json"
        why = self.session.save_error

        def done(path: Path | None) -> None:
            if path is not None:
                self.notify(f"chat written to {path}", title="export", timeout=6, markup=False)

        self.push_screen(ExportScreen(chat, default, why), done)

    def action_inspect(self) -> None:
        """Ctrl+R: retry the last reply if it failed; else focus it to pick its tokens."""
        if self.retry():
            return
        reply = self.main.chat_log.last_reply()
        if reply is None:
            self.notify("no reply yet", severity="warning")
            return
        reply.focus()
        reply.scroll_visible()

    @on(ReplyView.TokenSelected)
    def _token_selected(self, event: ReplyView.TokenSelected) -> None:
        self.pinned = (event.message, event.index) if event.index >= 0 else None
        if not self.grid_layout() and self.active_panel != "sampling":
            self.show_panel("sampling")
        self.show_sampling()

    def save(self) -> None:
        """Autosave the chat (finished messages); a crash loses at most the reply in flight. A
        failing save is said as it is, once, with the way to export the chat."""
        if not self.autosave or not self.session.messages:
            return
        note = self.session.save(self.store, self.save_path)
        if note is not None:
            self.notify(
                note.text, title="autosave", severity=note.severity, timeout=30, markup=False
            )

    @on(Input.Submitted, "#system-prompt")
    def _system_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.session.system = event.value
        self.save()
        self.notify("system prompt set (applies from the next message)", timeout=3)
        self.main.prompt.focus()

    @on(Input.Changed, "#system-prompt")
    def _system_changed(self, event: Input.Changed) -> None:
        self.session.system = event.value

    # -- controls ----------------------------------------------------------------------------------
    @on(ControlsPanel.Changed)
    def _controls_changed(self, event: ControlsPanel.Changed) -> None:
        self.set_params(event.params, from_controls=True)

    @on(ControlsPanel.SpeculationChanged)
    def _speculation_changed(self, event: ControlsPanel.SpeculationChanged) -> None:
        enabled, k = event.enabled, event.num_draft
        self.loop.set_speculation(enabled, k)
        self.pump_now(timeout=1.0)
        self.notify(
            f"speculation {'on' if enabled else 'off'} · draft length {k} (from the next step)",
            title="settings",
            timeout=2,
        )

    def set_params(self, params: SamplingParams, from_controls: bool = False) -> None:
        """New settings for the next request and, from its next token, for the reply in flight."""
        self.session.params = params
        self.loop.update_params(params)
        if not from_controls:
            self.main.query_one(ControlsPanel).set_params(params)
        self.show_sampling()
        self.notify(
            f"temperature {params.temperature:g} · top-p {params.top_p:g} · top-k {params.top_k} · "
            f"min-p {params.min_p:g}",
            title="settings",
            timeout=2,
        )

    def action_nudge(self, name: str, delta: float) -> None:
        """F5-F8: step temperature or top-p, clamped to the range the engine accepts."""
        p = self.session.params
        if name == "temperature":
            value = round(min(5.0, max(0.0, p.temperature + delta)), 2)
        else:
            value = round(min(1.0, max(0.05, p.top_p + delta)), 2)
        self.set_params(replace(p, **{name: value}))

    # -- panels and help ---------------------------------------------------------------------------
    def action_next_panel(self) -> None:
        keys = [k for k, _ in PANELS]
        self.show_panel(keys[(keys.index(self.active_panel) + 1) % len(keys)])

    def action_toggle_layout(self) -> None:
        self.layout_mode = "tabs" if self.grid_layout() else "grid"
        self.apply_layout()

    def action_focus_controls(self) -> None:
        self.show_panel("controls")
        self.main.query_one("#ctl-temperature", Input).focus()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_sections()))

    def key_sections(self) -> list[tuple[str, list[BindingType]]]:
        """(where, bindings) for the help: the app's and its main screen's keys work anywhere."""
        return [
            ("anywhere", [*self.BINDINGS, *App.BINDINGS, *MainScreen.BINDINGS]),
            ("prompt", PromptInput.BINDINGS),
            ("reply", ReplyView.BINDINGS),
        ]

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Stop reply", "Stop generating, keep the partial reply (Esc)", self.action_stop
        )
        yield SystemCommand(
            "New chat", "Start a new chat; its KV blocks are freed (Ctrl+N)", self.action_new_chat
        )
        yield SystemCommand(
            "Export Markdown", "Write this chat as a Markdown file (Ctrl+S)", self.action_export
        )
        yield SystemCommand(
            "Export chat to…",
            "Write this chat to a path you type: JSON, or Markdown for .md (Ctrl+O)",
            self.action_export_to,
        )
        yield SystemCommand(
            "Inspect reply tokens", "Pick tokens of the last reply (Ctrl+R)", self.action_inspect
        )
        yield SystemCommand("Help: keys", "List every key (F1)", self.action_help)
        yield SystemCommand(
            "Switch layout", "Tabs or every panel at once (F3)", self.action_toggle_layout
        )
        yield SystemCommand(
            "Edit controls", "Focus the sampling controls (F4)", self.action_focus_controls
        )
        for key, label in PANELS:
            yield SystemCommand(
                f"Show {label} panel",
                f"Show the {label.lower()} panel",
                lambda k=key: self.show_panel(k),
            )
        for name, label, d in (("temperature", "Temperature", 0.1), ("top_p", "Top-p", 0.05)):
            yield SystemCommand(
                f"{label} up", f"{label} +{d:g}", lambda n=name, v=d: self.action_nudge(n, v)
            )
            yield SystemCommand(
                f"{label} down", f"{label} −{d:g}", lambda n=name, v=d: self.action_nudge(n, -v)
            )
