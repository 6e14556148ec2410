"""Panel: the bordered, titled box every inspector panel lives in."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Static


class Readout(Static):
    """A Static that remembers the text it shows and repaints only when given different text."""

    shown: Text | str | None = None  # the last text given to show()

    def show(self, text: Text | str, *, layout: bool | None = None) -> None:
        """Show `text` unless it is already shown. layout: whether the height may change (None:
        work it out from the wrapped text)."""
        if text == self.shown:
            return
        self.shown = text
        text = text if isinstance(text, Text) else Text(text)
        self.update(text, layout=self.needs_layout(text) if layout is None else layout)

    def needs_layout(self, text: Text) -> bool:
        """Whether showing `text` changes this widget's height.

        A layout reflows every widget on the screen; skipping it when the height stays is what
        keeps a frequent repaint cheap (and out of the engine's way). The height a text needs is its
        wrapped line count, or the min-height in cells when that is more (no vertical padding
        here).
        """
        width, height = self.content_size
        if width <= 0:
            return True  # not laid out yet: the height is unknown
        fixed = self.styles.height
        if fixed is not None and fixed.is_cells:
            return False  # a height set in cells stays whatever the text: a layout moves nothing
        floor = self.styles.min_height
        lines = max(
            len(text.wrap(self.app.console, width)),
            int(floor.value) if floor and floor.is_cells else 0,
        )
        return lines != height


class Panel(Vertical):
    """A titled inspector panel of Readouts."""

    TITLE = ""

    def on_mount(self) -> None:
        self.border_title = self.TITLE
        self.add_class("panel")

    def set_text(self, selector: str, text: Text | str) -> None:
        """Show text in the Readout at selector (a repaint only if it changed)."""
        self.query_one(selector, Readout).show(text)
