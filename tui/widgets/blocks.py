"""KV blocks panel: one cell per physical block of the engine's block map, drawn line by line."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping

from pagechat.core.blockmap import BlockInfo, BlockSnapshot
from pagechat.core.memory import fmt_bytes
from pagechat.tui.widgets.panel import Panel, Readout
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

OWNER_COLOURS = (  # theme variables, one per sequence in turn
    "pc-accent",
    "pc-bad",
    "pc-good",
    "pc-note",
    "pc-other",
    "pc-cyan",
    "pc-warn",
    "pc-lavender",
)
FILL = "▁▂▃▄▅▆▇█"  # partly filled last block: height = filled / block_size
FULL, SHARED, CACHED, FREE = "█", "◆", "○", "·"
CELL_WIDTHS = (2, 1)  # a glyph and a gap when the pool fits that way, else glyphs side by side


def owner_colour(seq_id: int) -> str:
    """The theme variable of a sequence's colour."""
    return OWNER_COLOURS[seq_id % len(OWNER_COLOURS)]


def state_style(key: str, colours: Mapping[str, str]) -> Style:
    """The style of a cell's colour key: free and cached blocks, or an owner's theme variable."""
    if key == "free":
        return Style(color=colours["pc-faint"])
    if key == "cached":
        return Style(color=colours["pc-cached"], bold=True)
    return Style(color=colours[key])


Cell = tuple[str, str]  # (glyph, colour: "free" | "cached" | an owner's theme variable)


def block_cell(b: BlockInfo, block_size: int) -> Cell:
    """The glyph and colour of one block."""
    if b.state == "free":
        return FREE, "free"
    if b.state == "cached":
        return CACHED, "cached"
    colour = owner_colour(b.owners[0]) if b.owners else "pc-unowned"
    if b.ref_count > 1:
        return SHARED, colour
    if b.filled < block_size:
        return FILL[max(0, math.ceil(len(FILL) * b.filled / block_size) - 1)], colour
    return FULL, colour


def folded_cell(group: tuple[BlockInfo, ...], block_size: int) -> Cell:
    """One cell for k blocks: used blocks win; glyph height = tokens held / slots of the group."""
    used = [b for b in group if b.state == "used"]
    if not used:
        return (CACHED, "cached") if any(b.state == "cached" for b in group) else (FREE, "free")
    owners = Counter(o for b in used for o in b.owners[:1])
    colour = owner_colour(owners.most_common(1)[0][0]) if owners else "pc-unowned"
    if any(b.ref_count > 1 for b in used):
        return SHARED, colour
    level = sum(b.filled for b in used) / (len(group) * block_size)
    return FILL[max(0, math.ceil(len(FILL) * level) - 1)], colour


class BlockGrid(Widget):
    """The pool as a grid of cells; rows are cached Strips, only changed rows are repainted."""

    DEFAULT_CSS = "BlockGrid { height: 1fr; min-height: 2; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: BlockSnapshot | None = None
        self.fold = 1  # blocks per cell
        self.cell_width = CELL_WIDTHS[0]
        self._cells: list[Cell] = []
        self._rows: list[Strip | None] = []
        self._segments: dict[Cell, Segment] = {}
        self._next_build = 0.0  # big pools: rebuild at most every ~10x the build time

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, self._repaint)

    def _repaint(self, _theme) -> None:
        """A new theme may colour the cells differently: forget the styled segments and rows."""
        self._segments, self._rows = {}, [None] * len(self._rows)
        self.refresh()

    def _segment(self, cell: Cell) -> Segment:
        seg = self._segments.get(cell)
        if seg is None:
            glyph, key = cell
            if self.cell_width == 1 and glyph == FULL:
                glyph = "■"  # gapless cells: a smaller square keeps neighbouring full blocks apart
            style = state_style(key, self.app.theme_variables)
            seg = self._segments[cell] = Segment(glyph + " " * (self.cell_width - 1), style)
        return seg

    @property
    def per_row(self) -> int:
        return max(1, self.size.width // self.cell_width)

    def fit(self, num_blocks: int) -> tuple[int, int]:
        """(cell width, blocks per cell): the widest cells that hold the pool unfolded, else
        folded narrow cells."""
        rows = max(1, self.size.height)
        for w in CELL_WIDTHS:
            if max(1, self.size.width // w) * rows >= num_blocks:
                return w, 1
        w = CELL_WIDTHS[-1]
        return w, math.ceil(num_blocks / (max(1, self.size.width // w) * rows))

    def show(self, snap: BlockSnapshot, force: bool = False) -> None:
        """Show a new snapshot; repaint only the rows whose cells changed."""
        if snap is self.snapshot and not force:
            return
        now = time.perf_counter()
        if not force and now < self._next_build and self.snapshot is not None:
            return
        self.snapshot = snap
        width, k = self.fit(len(snap.blocks))
        if width != self.cell_width:
            self.cell_width, self._segments, self._rows = width, {}, []
        bs, blocks = snap.block_size, snap.blocks
        if k == 1:
            cells = [block_cell(b, bs) for b in blocks]
        else:
            cells = [folded_cell(blocks[i : i + k], bs) for i in range(0, len(blocks), k)]
        self._next_build = now + 10 * (time.perf_counter() - now) if len(blocks) > 4096 else 0.0
        per_row = self.per_row
        rows = math.ceil(len(cells) / per_row)
        if k != self.fold or len(self._rows) != rows:
            self.fold, self._cells, self._rows = k, cells, [None] * rows
            self.refresh()
            return
        old = self._cells
        self._cells = cells
        width = self.size.width
        for y in range(rows):
            a, b = y * per_row, (y + 1) * per_row
            if old[a:b] != cells[a:b]:
                self._rows[y] = None
                self.refresh(Region(0, y, width, 1))

    def on_resize(self) -> None:
        if self.snapshot is not None:
            self._rows = []
            snap, self.snapshot = self.snapshot, None
            self.show(snap, force=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self._rows))

    def render_line(self, y: int) -> Strip:
        if y >= len(self._rows):
            return Strip.blank(self.size.width, self.rich_style)
        strip = self._rows[y]
        if strip is None:
            per_row = self.per_row
            segs = [self._segment(c) for c in self._cells[y * per_row : (y + 1) * per_row]]
            # line-API strips get no background of their own: lay the widget's style under the cells
            strip = (
                Strip(segs)
                .adjust_cell_length(self.size.width)
                .apply_style(self.rich_style)
                .simplify()
            )
            self._rows[y] = strip
        return strip


def legend(snap: BlockSnapshot, colours: Mapping[str, str]) -> Text:
    """What each mark means, and the colour of each sequence holding blocks."""
    t, glyph_style = Text(), Style(color=colours["pc-glyph"])
    for glyph, label, style in (
        (FULL, "full", glyph_style),
        (FILL[3], "part", glyph_style),
        (SHARED, "shared", glyph_style),
        (CACHED, "cached", state_style("cached", colours)),
        (FREE, "free", state_style("free", colours)),
    ):
        t.append(glyph, style).append(f" {label} ", "dim")
    owners = sorted({o for b in snap.blocks for o in b.owners})
    for o in owners[:4]:
        t.append(" ■", Style(color=colours[owner_colour(o)])).append(f"seq {o}", "dim")
    if len(owners) > 4:
        t.append(f" +{len(owners) - 4}", "dim")
    return t


def header(snap: BlockSnapshot, block_bytes: int, fold: int, colours: Mapping[str, str]) -> Text:
    """Totals from the snapshot: used/total, tokens, KV bytes, fragmentation, prefix hits."""
    n = len(snap.blocks)
    t = Text()
    t.append("used ", "dim").append(f"{snap.num_used}/{n}", "bold")
    t.append(" · cached ", "dim").append(str(snap.num_cached), f"bold {colours['pc-cached']}")
    t.append(" · free ", "dim").append(str(snap.num_free), "bold")
    t.append(" · shared ", "dim").append(str(snap.num_shared), "bold")
    t.append("\ntokens ", "dim").append(str(snap.tokens_stored), "bold")
    t.append(" · KV ", "dim").append(
        f"{fmt_bytes(snap.num_used * block_bytes)}/{fmt_bytes(n * block_bytes)}", "bold"
    )
    t.append(" · frag ", "dim").append(f"{100 * snap.fragmentation:.1f}%", "bold")
    t.append("\nprefix hits ", "dim").append(f"{100 * snap.hit_rate:.0f}%", "bold")
    t.append(
        f" ({snap.prefix_hit_tokens}/{snap.prefix_queried_tokens} tok)"
        f" · {snap.block_size} tok/block",
        "dim",
    )
    if fold > 1:
        t.append(f"\n1 cell = {fold} blocks (pool folded to fit)", f"italic {colours['pc-note']}")
    return t


class BlocksPanel(Panel):
    """Header totals, the block grid and a legend."""

    TITLE = "KV blocks"

    def __init__(self, block_bytes: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_bytes = block_bytes
        self.snapshot: BlockSnapshot | None = None

    def compose(self) -> ComposeResult:
        yield Readout(id="blocks-header")
        yield BlockGrid(id="block-grid")
        yield Readout(id="blocks-legend")

    def show(self, snap: BlockSnapshot) -> None:
        """Render a BlockManager snapshot (the engine's, never a recomputation)."""
        grid = self.query_one(BlockGrid)
        grid.show(snap)
        if grid.snapshot is snap:
            self.snapshot = snap
            self.set_text(
                "#blocks-header",
                header(snap, self.block_bytes, grid.fold, self.app.theme_variables),
            )
            self.set_text("#blocks-legend", legend(snap, self.app.theme_variables))
