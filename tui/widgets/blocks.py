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
from textual.message import Message
from textual.strip import Strip
from textual.timer import Timer
from textual.widget import Widget

OWNER_COLOURS = (  # theme variables, one per sequence id in turn: 16 apart
    "pc-accent",
    "pc-bad",
    "pc-good",
    "pc-note",
    "pc-other",
    "pc-cyan",
    "pc-warn",
    "pc-lavender",
    *(f"pc-seq-{i}" for i in range(8, 16)),
)
FILL = "▁▂▃▄▅▆▇█"  # partly filled last block: height = filled / block_size
FULL, SHARED, CACHED, FREE = "█", "◆", "○", "·"
REFS = "23456789"  # a block shared by 2..9 sequences shows how many; more than 9 shows SHARED
CELL_WIDTHS = (2, 1)  # a glyph and a gap when the pool fits that way, else glyphs side by side
FLASH_S = 0.8  # how long a block copied on write or hit in the prefix cache stays highlighted
FLASH_COLOURS = {"copied": "pc-warn", "hit": "pc-cached"}  # the highlight's background


def owner_colour(seq_id: int) -> str:
    """The theme variable of a sequence's colour."""
    return OWNER_COLOURS[seq_id % len(OWNER_COLOURS)]


def state_style(key: str, colours: Mapping[str, str]) -> Style:
    """The style of a cell's colour key: free and cached blocks, or an owner's theme variable;
    `key!copied` and `key!hit` flash it (just copied on write, or hit in the prefix cache)."""
    if "!" in key:
        flash = FLASH_COLOURS[key.split("!")[1]]
        return Style(color=colours["pc-on-accent"], bgcolor=colours[flash], bold=True)
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
        return (REFS[b.ref_count - 2] if b.ref_count <= 9 else SHARED), colour
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
    """The pool as a grid of cells; rows are cached Strips, only changed rows are repainted.

    Nothing is drawn before the grid has a size: the scale (blocks per cell) depends on it, and
    the panel states it from the first frame that shows a block.
    """

    DEFAULT_CSS = "BlockGrid { height: 1fr; min-height: 2; }"

    class Refit(Message):
        """The grid drew a snapshot at a new scale (blocks per cell)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: BlockSnapshot | None = None
        self.fold = 1  # blocks per cell
        self.cell_width = CELL_WIDTHS[0]
        self._cells: list[Cell] = []
        self._rows: list[Strip | None] = []
        self._segments: dict[Cell, Segment] = {}
        self._next_build = 0.0  # big pools: rebuild at most every ~10x the build time
        self._waiting: BlockSnapshot | None = None  # given before the grid had a size
        self._seen = 0  # the serial of the last snapshot shown: later marks flash
        self._flash: dict[int, tuple[float, str]] = {}  # block -> (until when, "copied" | "hit")
        self._unflash_timer: Timer | None = None

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
        if not self.size.area:  # not laid out: the scale is unknown; on_resize draws it
            self._waiting = snap
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
        for block, kind in self.flashes(snap, now).items():
            glyph, key = cells[block // k]
            cells[block // k] = glyph, f"{key.split('!')[0]}!{kind}"
        self._next_build = now + 10 * (time.perf_counter() - now) if len(blocks) > 4096 else 0.0
        per_row = self.per_row
        rows = math.ceil(len(cells) / per_row)
        if k != self.fold or len(self._rows) != rows:
            self.fold, self._cells, self._rows = k, cells, [None] * rows
            self.refresh()
            self.post_message(self.Refit())
            return
        old = self._cells
        self._cells = cells
        width = self.size.width
        for y in range(rows):
            a, b = y * per_row, (y + 1) * per_row
            if old[a:b] != cells[a:b]:
                self._rows[y] = None
                self.refresh(Region(0, y, width, 1))

    def flashes(self, snap: BlockSnapshot, now: float) -> dict[int, str]:
        """The blocks to highlight: those copied into or hit since the last snapshot shown (the
        snapshots between included), for FLASH_S each."""
        if snap.serial > self._seen:
            for b in snap.blocks:
                if b.mark > self._seen:
                    self._flash[b.block_id] = (now + FLASH_S, b.marked)
            self._seen = snap.serial
        self._flash = {b: f for b, f in self._flash.items() if f[0] > now}
        if self._flash and self._unflash_timer is None:  # redraw when the first one ends
            first = min(until for until, _ in self._flash.values())
            self._unflash_timer = self.set_timer(first - now + 0.01, self._unflash)
        return {b: kind for b, (_, kind) in self._flash.items()}

    def _unflash(self) -> None:
        self._unflash_timer = None
        if self.snapshot is not None:
            self.show(self.snapshot, force=True)

    def on_resize(self) -> None:
        snap = self.snapshot or self._waiting
        if snap is not None:
            self._rows, self.snapshot, self._waiting = [], None, None
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


def legend(
    snap: BlockSnapshot, colours: Mapping[str, str], names: Mapping[int, str], width: int
) -> Text:
    """What each mark means, then each sequence holding blocks in its colour, named (chat, load
    3 s2...), in two lines of `width` at most."""
    t, glyph_style = Text(), Style(color=colours["pc-glyph"])
    for glyph, label, style in (
        (FULL, "full", glyph_style),
        (FILL[3], "part", glyph_style),
        ("2", "shared", glyph_style),
        (CACHED, "cached", state_style("cached", colours)),
        (FREE, "free", state_style("free", colours)),
    ):
        t.append(glyph, style).append(f" {label} ", "dim")
    owners = sorted({o for b in snap.blocks for o in b.owners})
    if not owners:
        return t
    line, room = Text("\n"), 2 * width - len(t) - 1  # the owners' line(s) below the marks
    for i, o in enumerate(owners):
        item = f"{o} {names.get(o, 'seq')}"
        more = f" +{len(owners) - i} more"
        if len(line) + len(item) + 3 + (len(more) if i + 1 < len(owners) else 0) > room:
            return t.append_text(line.append(more, "dim"))
        line.append("■", Style(color=colours[owner_colour(o)])).append(f"{item}  ", "dim")
    line.rstrip()
    return t.append_text(line)


def header(snap: BlockSnapshot, block_bytes: int, colours: Mapping[str, str]) -> Text:
    """Totals from the snapshot: used/total, tokens, KV bytes, fragmentation, prefix hits; then
    what the grid's flashes mean."""
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
    t.append("\njust now: ", "dim").append(FULL, state_style("x!copied", colours))
    return (
        t.append(" copied ", "dim")
        .append(FULL, state_style("x!hit", colours))
        .append(" hit", "dim")
    )


class BlocksPanel(Panel):
    """Header totals, the block grid and a legend."""

    TITLE = "KV blocks"

    def __init__(self, block_bytes: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_bytes = block_bytes
        self.snapshot: BlockSnapshot | None = None
        self.names: Mapping[int, str] = {}

    def compose(self) -> ComposeResult:
        yield Readout(id="blocks-header")
        yield BlockGrid(id="block-grid")
        yield Readout(id="blocks-legend")

    def show(self, snap: BlockSnapshot, names: Mapping[int, str] | None = None) -> None:
        """Render a BlockManager snapshot (the engine's, never a recomputation); names: what
        each sequence is, for the legend."""
        grid = self.query_one(BlockGrid)
        self.names = names if names is not None else self.names
        grid.show(snap)
        if grid.snapshot is snap:
            self.describe(snap)

    def describe(self, snap: BlockSnapshot) -> None:
        """The header and legend of the snapshot the grid draws, and its scale in the title.

        The scale goes in the border, not the header: the header's rows are fixed (the grid below
        must not move) and a narrow panel cuts its last lines, while a misread scale misreads the
        whole grid."""
        self.snapshot, colours = snap, self.app.theme_variables
        fold = self.query_one(BlockGrid).fold
        scale = f"1 cell = {fold} blocks (folded)" if fold > 1 else "1 cell = 1 block"
        title = f"{self.TITLE} · {scale}"
        if self.border_title != title:  # setting it repaints the panel, even to the same text
            self.border_title = title
        self.set_text("#blocks-header", header(snap, self.block_bytes, colours))
        width = self.query_one("#blocks-legend").content_size.width or 40
        self.set_text("#blocks-legend", legend(snap, colours, self.names, width))

    def on_block_grid_refit(self, event: BlockGrid.Refit) -> None:
        grid = self.query_one(BlockGrid)
        if grid.snapshot is not None:
            self.describe(grid.snapshot)
