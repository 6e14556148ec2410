"""PagechatApp: chat with a local model while inspector panels render the engine's records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pagechat.core.params import SamplingParams
from pagechat.tui.answers import Answers
from pagechat.tui.chat_files import ChatFiles
from pagechat.tui.client import EngineClient
from pagechat.tui.frames import FPS, Frames
from pagechat.tui.heap import settle_heap
from pagechat.tui.history import ChatRecord, ChatStore
from pagechat.tui.inspector import Inspector
from pagechat.tui.load_switch import LoadSwitch
from pagechat.tui.screens import PANELS, HelpScreen, MainScreen
from pagechat.tui.session import ChatSession, engine_facts
from pagechat.tui.settings import Settings
from pagechat.tui.supervisor import WATCH_S, EngineSupervisor
from pagechat.tui.turns import Turns
from pagechat.tui.widgets.chat import PromptInput, ReplyView
from pagechat.tui.widgets.scheduler import SchedulerLog
from textual import events
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.theme import BUILTIN_THEMES
from textual.widget import AwaitMount

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
        self.session.blocks = info.blocks
        self.speculation = (info.speculate, info.num_draft)  # as the engine has it (SpeculationSet)
        self.readings = None  # the engine's latest MemoryRead
        self.sched = SchedulerLog()  # the scheduler's records, engine-wide (not per chat)
        # the app's behaviour, by concern; each reaches the records above through the app
        self.frames = Frames(self)
        self.inspector = Inspector(self)
        self.turns = Turns(self, when_full)
        self.settings = Settings(self)
        self.answers = Answers(self)
        self.load = LoadSwitch(self)
        self.supervisor = EngineSupervisor(self)
        self.files = ChatFiles(self, store or ChatStore(), save_path, autosave)
        # the chat and its panels, reached through this whatever screen is on top (the help, say)
        self.main = MainScreen(
            self.session.system, info.memory, base, self.inspector.spec_controls(), layout
        )

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
        self.main.apply_layout()
        self.set_timer(1 / FPS, self.frames.tick)
        self.set_interval(1.0, self.inspector.refresh_memory)
        self.set_interval(WATCH_S, self.supervisor.check)
        self.main.prompt.focus()
        self.inspector.refresh(everything=True)
        self.call_after_refresh(settle_heap, True)
        for text in self.notices:
            self.notify(text, title="warning", severity="warning", timeout=15, markup=False)

    def on_unmount(self) -> None:
        self.loop.close()
        self.files.save()

    def on_resize(self, event: events.Resize) -> None:
        """Here, not on the screen: the main screen lays out even under the help (App.size lags)."""
        self.main.apply_layout(event.size)

    # -- the keys: app-wide (they work over the help and export screens too) ----------------------
    def action_stop(self) -> None:
        """Esc: stop the reply in flight; else unpin the selected token, back to the prompt."""
        self.turns.stop()

    def action_new_chat(self) -> None:
        """Ctrl+N: abort the reply, save this chat, start an empty one (same system, settings)."""
        self.turns.new_chat()

    def action_export(self) -> None:
        """Ctrl+S: write the chat as Markdown."""
        self.files.export_markdown()

    def action_export_to(self) -> None:
        """Ctrl+O: write the chat to a path the user types (the way out when autosave fails)."""
        self.files.export_to()

    def action_inspect(self) -> None:
        """Ctrl+R: retry the last reply if it failed; else focus it to pick its tokens."""
        self.turns.inspect()

    def action_nudge(self, name: str, delta: float) -> None:
        """F5-F8: step temperature or top-p, clamped to the range the engine accepts."""
        self.settings.nudge(name, delta)

    def action_cycle_answers(self, name: str) -> None:
        """F9 / F10: the next number of samples (or beams) for the next prompt: 1, 2, 4, 8."""
        self.answers.cycle(name)

    def action_show_answer(self, delta: int) -> None:
        """Alt+←/→: show another answer of the last reply."""
        self.answers.show(delta)

    def action_keep_answer(self) -> None:
        """Ctrl+T: keep the answer shown; the others are aborted and their blocks freed."""
        self.answers.keep_shown()

    def action_toggle_load(self) -> None:
        """Ctrl+L: start background requests as the Controls say, or stop them."""
        self.load.toggle()

    def action_next_panel(self) -> None:
        """F2: the next inspector panel."""
        self.main.next_panel()

    def action_toggle_layout(self) -> None:
        """F3: tabs or every panel at once."""
        self.main.toggle_layout()

    def action_focus_controls(self) -> None:
        """F4: the Controls panel, its first field focused."""
        self.main.focus_controls()

    def action_help(self) -> None:
        """F1 / ?: every key, unless the help is up already."""
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
                lambda k=key: self.main.show_panel(k),
            )
        for name, label, d in (("temperature", "Temperature", 0.1), ("top_p", "Top-p", 0.05)):
            yield SystemCommand(
                f"{label} up", f"{label} +{d:g}", lambda n=name, v=d: self.action_nudge(n, v)
            )
            yield SystemCommand(
                f"{label} down", f"{label} −{d:g}", lambda n=name, v=d: self.action_nudge(n, -v)
            )
