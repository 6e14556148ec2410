"""ExportScreen: write the chat to a path the user types (when autosave fails, or any time)."""

from __future__ import annotations

from pathlib import Path

from pagechat.tui.history import ChatRecord, export_chat
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static


class ExportScreen(ModalScreen[Path | None]):
    """Ask for a path and write the chat there: JSON, or Markdown for a .md name. A path that
    cannot be written says why and stays open for another; Esc cancels."""

    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    #export-box {
        width: 90%; max-width: 100; height: auto; padding: 1 2;
        border: round $accent; background: $surface;
    }
    #export-why { color: $error; }
    #export-error { color: $error; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", tooltip="close without writing")]

    def __init__(self, chat: ChatRecord, default: Path, why: str | None = None) -> None:
        """chat: what to write; default: the path offered; why: the autosave failure, if any."""
        super().__init__()
        self.chat, self.default, self.why = chat, default, why

    def compose(self) -> ComposeResult:
        with Vertical(id="export-box") as box:
            box.border_title = "export chat"
            box.border_subtitle = "Enter writes · Esc cancels"
            if self.why:
                yield Static(self.why, id="export-why", markup=False)
            yield Static("Write the chat to (a .md name writes Markdown, else JSON):")
            yield Input(str(self.default), id="export-path")
            yield Static("", id="export-error", markup=False)

    def on_mount(self) -> None:
        self.query_one("#export-path", Input).focus()

    @on(Input.Submitted, "#export-path")
    def _write(self, event: Input.Submitted) -> None:
        event.stop()
        target = event.value.strip() or str(self.default)
        try:
            path = export_chat(self.chat, Path(target))
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            why = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) else f"{target!r}: {e}"
            self.query_one("#export-error", Static).update(f"cannot write {why}; try another path")
            return
        self.dismiss(path)

    def action_cancel(self) -> None:
        self.dismiss(None)
