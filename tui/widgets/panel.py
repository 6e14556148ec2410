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
    """Static.update, asking for a (whole-screen) layout pass only when the Static's height must change.

    A layout reflows every widget on the screen; skipping it when the height stays is what keeps a 20 Hz
    repaint cheap (and out of the engine's way). The height a text needs is its wrapped line count, or the
    Static's min-height in cells when that is more (no vertical padding here).
    """
    width, height = static.content_size
    if isinstance(text, Text) and width > 0:
        floor = static.styles.min_height
        lines = max(
            len(text.wrap(static.app.console, width)),
            int(floor.value) if floor and floor.is_cells else 0,
        )
        layout = lines != height
    else:
        layout = True  # not laid out yet, or markup: the height is unknown
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
