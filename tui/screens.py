"""Modal screens: the help screen listing every key."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# (keys, what they do, where): the one list the help screen shows; app BINDINGS use the same keys.
KEYS: tuple[tuple[str, str, str], ...] = (
    ("Enter", "send the prompt", "prompt"),
    ("Shift+Enter / Alt+Enter / Ctrl+J", "new line in the prompt", "prompt"),
    ("Esc", "stop the reply (keeps the partial text); else back to the prompt", "anywhere"),
    ("Ctrl+N", "new chat (frees its KV blocks; prefix-cached blocks stay cached)", "anywhere"),
    ("Ctrl+S", "export this chat as Markdown", "anywhere"),
    ("Ctrl+R", "inspect the last reply's tokens", "anywhere"),
    ("←/→ h/l · Home/End", "pick a token of the focused reply (mouse: click it)", "reply"),
    ("↑/↓ k/j", "previous / next reply", "reply"),
    ("F5 / F6", "temperature −0.1 / +0.1", "anywhere"),
    ("F7 / F8", "top-p −0.05 / +0.05", "anywhere"),
    ("F2", "next inspector panel (tabbed layout)", "anywhere"),
    ("F3", "switch layout: tabs / all panels", "anywhere"),
    ("F4", "focus the controls", "anywhere"),
    ("Tab / Shift+Tab", "move focus", "anywhere"),
    ("Ctrl+P", "command palette (every action)", "anywhere"),
    ("F1 / ?", "this help", "anywhere"),
    ("Ctrl+Q", "quit", "anywhere"),
)


def keys_table() -> Table:
    table = Table(
        box=None, show_header=True, header_style="bold #8a8a8a", expand=True, pad_edge=False
    )
    table.add_column("key", style="bold #5fafff", no_wrap=True)
    table.add_column("does")
    table.add_column("where", style="dim", no_wrap=True)
    for keys, does, where in KEYS:
        table.add_row(keys, does, where)
    return table


class HelpScreen(ModalScreen[None]):
    """Every key of the app; Esc, q or F1 closes it."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "pagechat keys"
            box.border_subtitle = "Esc closes"
            yield Static(keys_table())
            yield Static(
                Text.from_markup(
                    "\n[dim]Panels render the engine's own records: the block map is the BlockManager's snapshot, the "
                    "candidates are the sampler's record of each token, timings are the StepReports'. Controls apply "
                    "to the reply in flight from its next token; the engine refuses invalid values with a reason.[/]"
                )
            )
