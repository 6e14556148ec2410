"""Memory panel: weights by format, KV pool allocated vs used, device or process readings,
capacity."""

from __future__ import annotations

from collections.abc import Mapping

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.memory import EngineMemory, Readings, fmt_bytes
from pagechat.tui.widgets.panel import Panel, Readout
from rich.text import Text
from textual.app import ComposeResult

BAR_COLOURS = {  # theme variables
    "weights": "pc-accent",
    "kv used": "pc-good",
    "kv free": "pc-kv-free",
    "other": "pc-other",
    "free": "pc-mem-free",
}


def bar_legend(colours: Mapping[str, str]) -> Text:
    t = Text()
    for name, colour in BAR_COLOURS.items():
        t.append("■", colours[colour]).append(f"{name} ", "dim")
    return t


def bar(parts: list[tuple[str, int]], total: int, width: int, colours: Mapping[str, str]) -> Text:
    """A stacked bar of named byte counts over total."""
    t, used = Text(), 0
    for name, n in parts:
        cells = min(width - used, round(width * max(0, n) / total)) if total else 0
        used += cells
        t.append("█" * cells, colours[BAR_COLOURS[name]])
    return t.append("░" * (width - used), colours[BAR_COLOURS["free"]])


class MemoryPanel(Panel):
    """Where the bytes are: the weights report, the pool tensor and the device's own readings."""

    TITLE = "Memory"

    def __init__(self, info: EngineMemory, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info = info

    def compose(self) -> ComposeResult:
        yield Readout(id="memory-weights")
        yield Readout(id="memory-kv")
        yield Readout(id="memory-device")
        yield Readout(id="memory-capacity")

    def on_mount(self) -> None:
        super().on_mount()
        self.set_text("#memory-weights", self.weights_text())
        self.set_text("#memory-capacity", self.capacity_text())

    def weights_text(self) -> Text:
        """The weights' total, what each kind is held as (a GGUF's types, what was requantised)
        and the kernels the quantised ones run."""
        w = self.info.weights
        t = Text().append("weights ", "dim").append(fmt_bytes(w.total), "bold")
        if w.head.kind == "embedding":
            t.append(f" · head tied to emb ({w.head.fmt})", "dim")
        t.append("\n" + w.formats(), "dim")
        paths = sorted({r.path for r in w.rows if r.bytes and r.path not in ("dense", "-")})
        if paths:
            t.append("\nkernels " + " · ".join(paths), "dim")
        return t

    def capacity_text(self) -> Text:
        i = self.info
        t = Text().append("fits ", "dim")
        t.append(str(i.seqs_that_fit(i.max_model_len)), "bold").append(
            f" seqs of {i.max_model_len} (full ctx) · ", "dim"
        )
        return t.append(str(i.seqs_that_fit(2048)), "bold").append(" of 2k", "dim")

    def show(self, snap: BlockSnapshot | None, readings: Readings | None = None) -> None:
        """Refresh the KV line from the block snapshot, and the readings when given."""
        i, width = self.info, max(10, self.content_size.width)
        used = (snap.num_used if snap else 0) * i.block_bytes
        cached = (snap.num_cached if snap else 0) * i.block_bytes
        kv = Text().append("KV pool ", "dim").append(fmt_bytes(i.pool_bytes), "bold")
        colours = self.app.theme_variables
        kv.append(" · used ", "dim").append(fmt_bytes(used), f"bold {colours['pc-good']}")
        kv.append(" · cached ", "dim").append(fmt_bytes(cached), f"bold {colours['pc-cached']}")
        kv.append(f"\n{i.num_blocks} blocks × {fmt_bytes(i.block_bytes)} ({i.dtype})", "dim")
        self.set_text("#memory-kv", kv)
        if readings is not None:
            self.set_text("#memory-device", self.readings_text(readings, width, used))

    def readings_text(self, r: Readings, width: int, kv_used: int) -> Text:
        i, w = self.info, self.info.weights.total
        colours = self.app.theme_variables
        t = Text()
        if r.device_total is not None:
            t.append("activation peak ", "dim").append(
                fmt_bytes(max(0, r.peak - w - i.pool_bytes)), "bold"
            )
            t.append(" (peak − weights − KV)", "dim")
            t.append("\ntorch ", "dim").append(fmt_bytes(r.allocated), "bold").append(
                " allocated · ", "dim"
            )
            t.append(fmt_bytes(r.reserved), "bold").append(" reserved · ", "dim")
            t.append(fmt_bytes(r.fragmented), "bold").append(" fragmented", "dim")
            t.append("\nother ", "dim").append(
                fmt_bytes(max(0, r.reserved - w - i.pool_bytes)), "bold"
            )
            t.append(" (reserved − weights − KV)", "dim")
            dev_used = r.device_total - r.device_free
            t.append(f"\n{i.device} ", "dim").append(
                f"{fmt_bytes(dev_used)} / {fmt_bytes(r.device_total)}", "bold"
            )
            t.append(f" used · {fmt_bytes(r.device_free)} free\n", "dim")
            parts = [
                ("weights", w),
                ("kv used", kv_used),
                ("kv free", i.pool_bytes - kv_used),
                ("other", dev_used - w - i.pool_bytes),
            ]
            return (
                t.append_text(bar(parts, r.device_total, width, colours))
                .append("\n")
                .append_text(bar_legend(colours))
            )
        other = r.rss - w - i.pool_bytes
        t.append("activation peak ", "dim").append("not tracked on CPU", "italic dim")
        t.append("\nengine RSS ", "dim").append(fmt_bytes(r.rss), "bold")
        t.append(" · other ", "dim").append(fmt_bytes(max(0, other)), "bold").append(
            " (RSS − weights − KV)", "dim"
        )
        if r.mem_total:
            t.append("\n")
            t.append_text(
                bar(
                    [
                        ("weights", w),
                        ("kv used", kv_used),
                        ("kv free", i.pool_bytes - kv_used),
                        ("other", other),
                    ],
                    r.mem_total,
                    width - 14,
                    colours,
                )
            )
            t.append(f" of {fmt_bytes(r.mem_total)}", "dim").append("\n").append_text(
                bar_legend(colours)
            )
        return t
