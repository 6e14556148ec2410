"""The app's screens: the main screen (chat beside the inspector panels) and the help."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagechat.core.events import EngineInfo
from pagechat.core.memory import EngineMemory
from pagechat.core.params import SamplingParams
from pagechat.tui.session import ChatSession
from pagechat.tui.widgets.blocks import BlocksPanel
from pagechat.tui.widgets.chat import ChatColumn, ChatLog, PromptInput, ReplyView
from pagechat.tui.widgets.controls import ControlsPanel
from pagechat.tui.widgets.memory import MemoryPanel
from pagechat.tui.widgets.panel import Panel, Readout
from pagechat.tui.widgets.sampling import SamplingPanel
from pagechat.tui.widgets.scheduler import SchedulerPanel
from pagechat.tui.widgets.speculation import SpeculationPanel
from pagechat.tui.widgets.timing import TimingPanel
from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container, Horizontal, Vertical, VerticalScroll
from textual.geometry import Size
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Static, Tab, Tabs

PANELS = (
    ("blocks", "Blocks"),
    ("sampling", "Sampling"),
    ("timing", "Timing"),
    ("controls", "Controls"),
    ("memory", "Memory"),
    ("speculation", "Spec"),
    ("sched", "Scheduler"),
)
GRID_MIN = (150, 40)  # terminal size from which every panel is shown at once


class StatusBar(Readout):
    """One line: model, dtype and device, chat id, and what the engine is doing."""


def status_line(info: EngineInfo, session: ChatSession, colours: Mapping[str, str]) -> Text:
    """The status bar's text; colours: the theme's variables."""
    badge = f"bold {colours['pc-on-accent']} on {colours['pc-accent']}"
    t = Text().append(" pagechat ", badge)
    t.append(f" {info.model_name} ", "bold").append(f"{info.precision} on {info.device}", "dim")
    turns = sum(1 for m in session.messages if m.role == "user")
    t.append(f" │ chat {session.record.id} · {turns} turn{'s' * (turns != 1)}", "dim")
    t.append_text(context_meter(session, info.memory.max_model_len, colours))
    msg = session.streaming
    if msg is None:
        return t.append(" │ ", "dim").append("idle", "dim")
    t.append(" │ ", "dim").append("● generating", f"bold {colours['pc-good']}")
    t.append(f" {sum(len(a.tokens) for a in msg.samples) or len(msg.tokens)} tok", "dim")
    if msg.timing and msg.timing.decode_tok_s:
        t.append(f" · {msg.timing.decode_tok_s:.1f} tok/s", "dim")
    return t


def context_meter(session: ChatSession, context: int, colours: Mapping[str, str]) -> Text:
    """' · context 312/512' (warning colour past 80%), and how many messages are out of it."""
    used = session.context_used()
    if not used:
        return Text()
    style = colours["pc-warn"] if used > 0.8 * context else "dim"
    t = Text(" · ", "dim").append(f"context {used}/{context}", style)
    if session.context_from:
        t.append(f" ({session.context_from} earlier messages out)", "dim")
    return t


class MainScreen(Screen):
    """The chat column beside the inspector panels, between the status line and the footer.

    The panels are tabbed (one shown at a time: Screen class -tabs) or all in a grid (-grid). The
    screen routes its widgets' messages to the app's chat, settings, answers and load.
    """

    def __init__(
        self,
        system: str,
        memory: EngineMemory,
        params: SamplingParams,
        spec: tuple[bool, bool, int],
        layout: str = "auto",
    ) -> None:
        """system: the chat's system prompt; spec: (a proposer exists, speculation on, draft
        length); layout: auto (by the terminal's size), tabs or grid."""
        super().__init__()
        self.system, self.memory, self.params, self.spec = system, memory, params, spec
        self.layout_mode = layout
        self.active_panel = "blocks"
        self.term_size: Size | None = None

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Horizontal(id="main"):
            yield ChatColumn(self.system, id="chat")
            with Vertical(id="side"):
                yield Tabs(*(Tab(label, id=key) for key, label in PANELS), id="panel-tabs")
                with Container(id="panels"):
                    yield BlocksPanel(self.memory.block_bytes, id="blocks")
                    yield SchedulerPanel(id="sched")
                    yield SamplingPanel(id="sampling")
                    yield TimingPanel(id="timing")
                    yield ControlsPanel(self.params, self.spec, id="controls")
                    yield MemoryPanel(self.memory, id="memory")
                    yield SpeculationPanel(id="speculation")
        yield Footer()

    def on_mount(self) -> None:
        """The layout before the first one is computed: a panel first sized as one of seven
        stacked ones would draw the block map at a scale it does not keep."""
        self.set_layout(self.grid_layout(), self.active_panel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one("#prompt", PromptInput)

    @property
    def chat_log(self) -> ChatLog:
        return self.query_one(ChatLog)

    # -- layout ------------------------------------------------------------------------------------
    def grid_layout(self) -> bool:
        """Every panel at once: asked for, or in auto on a terminal of at least GRID_MIN."""
        if self.layout_mode != "auto":
            return self.layout_mode == "grid"
        size = self.term_size or self.app.size
        return size.width >= GRID_MIN[0] and size.height >= GRID_MIN[1]

    def apply_layout(self, size: Size | None = None) -> None:
        """Tabs on small terminals, a grid on big ones; size: the terminal's, from App.on_resize."""
        if size is not None:
            self.term_size = size
        grid = self.grid_layout()
        if not self.query("#panels"):
            return  # not composed yet
        self.set_layout(grid, self.active_panel)
        self.app.call_after_refresh(self.app.inspector.refresh, True)

    def set_layout(self, grid: bool, active: str) -> None:
        """Every panel at once in a grid, or tabs that show the `active` one."""
        self.set_class(grid, "-grid")
        self.set_class(not grid, "-tabs")
        self._mark_active(active)

    def show_panel(self, key: str) -> None:
        """Make `key` the active panel (the one the tabs show): tab selected, box lit, drawn."""
        self.active_panel = key
        tabs = self.query_one("#panel-tabs", Tabs)
        if tabs.active != key:
            tabs.active = key
        self._mark_active(key)
        self.app.call_after_refresh(self.app.inspector.refresh, True)

    def _mark_active(self, key: str) -> None:
        for k, _ in PANELS:
            self.query_one(f"#{k}", Panel).set_class(k == key, "-active")

    def shows(self, key: str) -> bool:
        """Whether panel `key` is on view, so worth drawing."""
        return self.grid_layout() or key == self.active_panel

    def next_panel(self) -> None:
        """The next panel in the tabs' order."""
        keys = [k for k, _ in PANELS]
        self.show_panel(keys[(keys.index(self.active_panel) + 1) % len(keys)])

    def toggle_layout(self) -> None:
        """Tabs if every panel is on view now, else every panel."""
        self.layout_mode = "tabs" if self.grid_layout() else "grid"
        self.apply_layout()

    def focus_controls(self) -> None:
        """The Controls panel on view, its first field focused."""
        self.show_panel("controls")
        self.query_one("#ctl-temperature", Input).focus()

    @on(Tabs.TabActivated, "#panel-tabs")
    def _tab(self, event: Tabs.TabActivated) -> None:
        """A tab clicked.

        Keys switch panels too, and each switch posts this event: one that arrives after a later
        switch (keys pressed in a burst) names a tab no longer active and is not a request.
        """
        if event.tab.id and event.tab.id == event.tabs.active != self.active_panel:
            self.show_panel(event.tab.id)

    # -- the widgets' messages, to the app's behaviour ---------------------------------------------
    @on(PromptInput.Submitted)
    def _send(self, event: PromptInput.Submitted) -> None:
        self.app.turns.send(event.text)

    @on(ReplyView.TokenSelected)
    def _token_selected(self, event: ReplyView.TokenSelected) -> None:
        """A token picked in a reply: the sampling panel shows its candidates."""
        inspector = self.app.inspector
        inspector.pinned = (event.message, event.index) if event.index >= 0 else None
        if not self.grid_layout() and self.active_panel != "sampling":
            self.show_panel("sampling")
        inspector.show_sampling()

    @on(ReplyView.BranchAsked)
    def _branch_asked(self, event: ReplyView.BranchAsked) -> None:
        self.app.answers.branch(event.message, event.index)

    @on(Input.Submitted, "#system-prompt")
    def _system_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.app.session.system = event.value
        self.app.files.save()
        self.app.notify("system prompt set (applies from the next message)", timeout=3)
        self.prompt.focus()

    @on(Input.Changed, "#system-prompt")
    def _system_changed(self, event: Input.Changed) -> None:
        self.app.session.system = event.value

    @on(ControlsPanel.Changed)
    def _controls_changed(self, event: ControlsPanel.Changed) -> None:
        self.app.settings.set_params(event.params, from_controls=True)

    @on(ControlsPanel.SpeculationChanged)
    def _speculation_changed(self, event: ControlsPanel.SpeculationChanged) -> None:
        self.app.settings.set_speculation(event.enabled, event.num_draft)

    @on(ControlsPanel.LoadChanged)
    def _load_changed(self, event: ControlsPanel.LoadChanged) -> None:
        self.app.load.set(event.on, event.count, event.rate)


KEY_NAMES = {
    "escape": "Esc",
    "question_mark": "?",
    "left": "←",
    "right": "→",
    "up": "↑",
    "down": "↓",
}


def key_label(key: str) -> str:
    """A key as the help shows it: ctrl+n -> Ctrl+N, escape -> Esc, f5 -> F5, h -> h."""
    *mods, name = key.split("+")
    if name in KEY_NAMES:
        name = KEY_NAMES[name]
    elif len(name) > 1:
        name = name.capitalize()
    elif mods:
        name = name.upper()
    return "+".join([*(m.capitalize() for m in mods), name])


def key_rows(bindings: Iterable[BindingType]) -> list[tuple[str, str]]:
    """(keys, what they do) of each binding that has a description, its tooltip if it has one;
    the keys of one action and description share a row."""
    rows: dict[tuple[str, str], list[str]] = {}
    for b in Binding.make_bindings(bindings):
        if b.description:
            keys = rows.setdefault((b.action, b.tooltip or b.description), [])
            keys.append(b.key_display or key_label(b.key))
    return [(" / ".join(keys), does) for (_, does), keys in rows.items()]


def keys_table(
    sections: Iterable[tuple[str, Iterable[BindingType]]], colours: Mapping[str, str]
) -> Table:
    """Every key of every (where, bindings) section; colours: the theme's variables."""
    header = f"bold {colours['pc-muted']}"
    table = Table(box=None, show_header=True, header_style=header, expand=True, pad_edge=False)
    table.add_column("key", style=f"bold {colours['pc-accent']}", no_wrap=True)
    table.add_column("does")
    table.add_column("where", style="dim", no_wrap=True)
    for where, bindings in sections:
        for keys, does in key_rows(bindings):
            table.add_row(keys, does, where)
    return table


class HelpScreen(ModalScreen[None]):
    """Every key of the app, read from the bindings; Esc, q or F1 closes it."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "dismiss", "Close")]

    def __init__(self, sections: Iterable[tuple[str, Iterable[BindingType]]]) -> None:
        """sections: (where the keys work, their bindings)."""
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "pagechat keys"
            box.border_subtitle = "Esc closes"
            yield Static(keys_table(self.sections, self.app.theme_variables))
            yield Static(
                Text.from_markup(
                    "\n[dim]Panels render the engine's own records: the block map is the "
                    "allocator's, the candidates are the sampler's record of each token, timings "
                    "are the StepReports'. Controls apply to the reply in flight from its next "
                    "token; the engine refuses invalid values with a reason.[/]"
                )
            )
