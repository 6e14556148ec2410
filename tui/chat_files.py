"""ChatFiles: the chat autosaved as it goes, and exported when the user asks."""

from __future__ import annotations

from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.tui.export_screen import ExportScreen
from pagechat.tui.history import ChatStore, export_markdown
from textual.app import App


class ChatFiles:
    """Where the chat is written, and what the user is told when it cannot be."""

    def __init__(self, app: App, store: ChatStore, save_path: Path | None, autosave: bool) -> None:
        """app: the PagechatApp whose chat this writes; save_path: a file instead of the store."""
        self.app = app
        self.store = store
        self.save_path = save_path
        self.autosave = autosave

    def save(self) -> None:
        """Autosave the chat (finished messages); a crash loses at most the reply in flight. A
        failing save is said as it is, once, with the way to export the chat."""
        session = self.app.session
        if not self.autosave or not session.messages:
            return
        note = session.save(self.store, self.save_path)
        if note is not None:
            self.app.notify(
                note.text, title="autosave", severity=note.severity, timeout=30, markup=False
            )

    def export_markdown(self) -> None:
        """Write the chat as Markdown."""
        try:
            path = export_markdown(self.app.session.to_record())
        except PagechatError as e:
            self.app.notify(str(e), severity="error")
            return
        self.app.notify(f"exported to {path}", title="export", timeout=6)

    def export_to(self) -> None:
        """Write the chat to a path the user types (the way out when autosave fails)."""
        chat = self.app.session.to_record()
        default = Path.cwd() / f"pagechat-{chat.id}.json"
        why = self.app.session.save_error

        def done(path: Path | None) -> None:
            if path is not None:
                self.app.notify(f"chat written to {path}", title="export", timeout=6, markup=False)

        self.app.push_screen(ExportScreen(chat, default, why), done)
