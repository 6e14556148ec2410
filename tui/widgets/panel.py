"""Panel: the bordered, titled box every inspector panel lives in."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Static


def short_bytes(n: float) -> str:
    """Bytes with a binary unit and 3 significant digits: 1536 -> '1.5 KiB', 2097152 -> '2 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    text = f"{n:.0f}" if unit == "B" or abs(n) >= 100 else f"{n:.3g}"
    return f"{text} {unit}"


def update_static(static: Static, text: Text | str) -> None:
    """Static.update, asking for a (whole-screen) layout pass only when the text's wrapped height changed.

    A layout reflows every widget on the screen; skipping it when the height is unchanged is what keeps
    a 20 Hz repaint cheap (and the engine thread, which shares the GIL, fast).
    """
    width = static.content_size.width
    if isinstance(text, Text) and width > 0:
        lines = len(text.wrap(static.app.console, width))
    else:
        lines = -1  # unknown: always lay out
    layout = lines < 0 or lines != getattr(static, "_lines", None)
    static._lines = lines
    static.update(text, layout=layout)


class Panel(Vertical):
    """A titled inspector panel; set_text repaints a child only when its text changed."""

    TITLE = ""
    KEY = ""  # the panel's tab id

    def on_mount(self) -> None:
        self.border_title = self.TITLE
        self.add_class("panel")

    def set_text(self, selector: str, text: Text | str) -> None:
        """Update the Static at selector unless it already shows this text."""
        static = self.query_one(selector, Static)
        if getattr(static, "_shown", None) != text:
            static._shown = text
            update_static(static, text if isinstance(text, Text) else Text(text))
