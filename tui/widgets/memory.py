"""Memory panel: weights by format, KV pool allocated vs used, device / process readings, and capacity."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from pagechat.core.blocks import BlockSnapshot
from pagechat.core.loader import dtype_name
from pagechat.core.memory import WeightReport
from pagechat.tui.widgets.panel import Panel, short_bytes

BAR_COLOURS = {"weights": "#5fafff", "kv used": "#87d787", "kv free": "#2e5e2e", "other": "#d787ff", "free": "#3a3a3a"}


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """What the engine holds that never changes after load: weights, the pool, its geometry and context."""

    weights: WeightReport
    pool_bytes: int
    block_bytes: int
    num_blocks: int
    block_size: int
    max_model_len: int
    device: torch.device
    dtype: str

    @classmethod
    def of(cls, engine) -> EngineMemory:
        from pagechat.core.memory import weight_report

        pool = engine.pool.numel() * engine.pool.element_size()
        return cls(weight_report(engine.model), pool, pool // engine.blocks.num_blocks, engine.blocks.num_blocks,
                   engine.blocks.block_size, engine.max_model_len, engine.device,
                   dtype_name(engine.dtype))

    def seqs_that_fit(self, tokens: int) -> int:
        """Sequences of `tokens` tokens the pool holds at once."""
        return self.num_blocks // -(-tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class Readings:
    """Live readings: the torch CUDA allocator and mem_get_info, or the process RSS on CPU."""

    rss: int | None = None
    mem_total: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    device_free: int | None = None
    device_total: int | None = None


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def read_memory(device: torch.device) -> Readings:
    """Read the allocator (CUDA) or the process RSS (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Readings(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                        peak=torch.cuda.max_memory_allocated(device), device_free=free, device_total=total)
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Readings(rss=rss, mem_total=_meminfo_total())


def bar_legend() -> Text:
    t = Text()
    for name, colour in BAR_COLOURS.items():
        t.append("■", colour).append(f"{name} ", "dim")
    return t


def bar(parts: list[tuple[str, int]], total: int, width: int) -> Text:
    """A stacked bar of named byte counts over total."""
    t, used = Text(), 0
    for name, n in parts:
        cells = min(width - used, round(width * max(0, n) / total)) if total else 0
        used += cells
        t.append("█" * cells, BAR_COLOURS.get(name, "white"))
    return t.append("░" * (width - used), BAR_COLOURS["free"])


class MemoryPanel(Panel):
    """Where the bytes are, from the weights report, the pool tensor and the device's own readings."""

    TITLE = "Memory"
    frozen = False  # hide live readings (snapshot tests)

    def __init__(self, info: EngineMemory, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info = info

    def compose(self) -> ComposeResult:
        yield Static(id="memory-weights")
        yield Static(id="memory-kv")
        yield Static(id="memory-device")
        yield Static(id="memory-capacity")

    def on_mount(self) -> None:
        super().on_mount()
        self.set_text("#memory-weights", self.weights_text())
        self.set_text("#memory-capacity", self.capacity_text())

    def weights_text(self) -> Text:
        w = self.info.weights
        t = Text().append("weights ", "dim").append(short_bytes(w.total), "bold")
        fmts: dict[str, int] = {}
        for r in w.rows:
            if r.bytes:
                key = r.fmt if r.path in ("dense", "-") else f"{r.fmt} {r.path}"
                fmts[key] = fmts.get(key, 0) + r.bytes
        t.append(" · " + " · ".join(f"{k} {short_bytes(v)}" for k, v in fmts.items()), "dim")
        names = {"embedding": "emb", "attention": "attn", "lm_head": "head"}
        kinds = " · ".join(f"{names.get(k, k)} {short_bytes(v)}" for k, v in w.by_kind().items() if v)
        return t.append("\n" + kinds, "dim")

    def capacity_text(self) -> Text:
        i = self.info
        t = Text().append("fits ", "dim")
        t.append(str(i.seqs_that_fit(i.max_model_len)), "bold").append(f" seqs of {i.max_model_len} (full ctx) · ", "dim")
        return t.append(str(i.seqs_that_fit(2048)), "bold").append(" of 2k", "dim")

    def show(self, snap: BlockSnapshot | None, readings: Readings | None = None) -> None:
        """Refresh the KV line from the block snapshot, and the device / process readings when given."""
        i, width = self.info, max(10, self.content_size.width)
        used = (snap.num_used if snap else 0) * i.block_bytes
        cached = (snap.num_cached if snap else 0) * i.block_bytes
        kv = Text().append("KV pool ", "dim").append(short_bytes(i.pool_bytes), "bold")
        kv.append(" · used ", "dim").append(short_bytes(used), "bold #87d787")
        kv.append(" · cached ", "dim").append(short_bytes(cached), "bold #00af87")
        kv.append(f"\n{i.num_blocks} blocks × {short_bytes(i.block_bytes)} ({i.dtype})", "dim")
        self.set_text("#memory-kv", kv)
        if readings is not None:
            self.set_text("#memory-device", self.readings_text(readings, width, used))

    def readings_text(self, r: Readings, width: int, kv_used: int) -> Text:
        i, w = self.info, self.info.weights.total
        if self.frozen:
            return Text().append(f"{i.device.type} readings hidden (frozen numbers)", "dim")
        t = Text()
        if r.device_total is not None:
            t.append("activation peak ", "dim").append(short_bytes(max(0, r.peak - w - i.pool_bytes)), "bold")
            t.append(" (peak − weights − KV)", "dim")
            t.append("\ntorch ", "dim").append(short_bytes(r.allocated), "bold").append(" allocated · ", "dim")
            t.append(short_bytes(r.reserved), "bold").append(" reserved", "dim")
            t.append("\nother ", "dim").append(short_bytes(max(0, r.reserved - w - i.pool_bytes)), "bold")
            t.append(" (reserved − weights − KV)", "dim")
            dev_used = r.device_total - r.device_free
            t.append(f"\n{i.device} ", "dim").append(f"{short_bytes(dev_used)} / {short_bytes(r.device_total)}", "bold")
            t.append(f" used · {short_bytes(r.device_free)} free\n", "dim")
            parts = [("weights", w), ("kv used", kv_used), ("kv free", i.pool_bytes - kv_used),
                     ("other", dev_used - w - i.pool_bytes)]
            return t.append_text(bar(parts, r.device_total, width)).append("\n").append_text(bar_legend())
        other = r.rss - w - i.pool_bytes
        t.append("activation peak ", "dim").append("not tracked on CPU", "italic dim")
        t.append("\nprocess RSS ", "dim").append(short_bytes(r.rss), "bold")
        t.append(" · other ", "dim").append(short_bytes(max(0, other)), "bold").append(" (RSS − weights − KV)", "dim")
        if r.mem_total:
            t.append("\n")
            t.append_text(bar([("weights", w), ("kv used", kv_used), ("kv free", i.pool_bytes - kv_used),
                               ("other", other)], r.mem_total, width - 14))
            t.append(f" of {short_bytes(r.mem_total)}", "dim").append("\n").append_text(bar_legend())
        return t
