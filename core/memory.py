"""Memory accounting of a loaded engine: weight bytes by module kind and format, KV, live readings.

`weight_report(model)` sums the bytes of the tensors a loaded model really holds; the planner
(pagechat.tools.planner) computes the same figures from config.json alone.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from pagechat.core.kv import block_bytes
from pagechat.core.modelspec import ModelSpec, dtype_name
from pagechat.core.quantization import weight_storage
from torch import nn

KINDS = ("embedding", "attention", "mlp", "norm", "lm_head")


@dataclass(frozen=True, slots=True)
class WeightRow:
    """Bytes of one module kind in one format (dtype, or quantisation and its kernel path)."""

    kind: str
    fmt: str
    path: str
    params: int  # logical weights (a 4-bit value counts as one)
    bytes: int


@dataclass(frozen=True, slots=True)
class WeightReport:
    """A model's weight memory, row per (kind, format); tied weights count once, under embedding."""

    rows: tuple[WeightRow, ...]

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def head(self) -> WeightRow:
        """The row holding lm_head's table: its own, or the embedding's when the two are tied."""
        head = next(r for r in self.rows if r.kind == "lm_head")
        if head.fmt == "tied to embedding":
            return next(r for r in self.rows if r.kind == "embedding")
        return head

    @property
    def head_label(self) -> str:
        """lm_head's format, e.g. 'int8-wo' or 'awq-int4 g32, tied to the embedding'."""
        head = self.head
        return head.fmt + (", tied to the embedding" if head.kind == "embedding" else "")

    def formats(self) -> str:
        """What each kind is held as, in bytes: 'emb Q8_0 28.7 MiB · attn Q4_K 12 MiB + Q6_K→int8
        4 MiB · mlp Q4_K 47.5 MiB · norm bfloat16 68.6 KiB' (a tied head counted in emb)."""
        names = {"embedding": "emb", "attention": "attn", "lm_head": "head"}
        parts = []
        for kind in KINDS:
            rows = [r for r in self.rows if r.kind == kind and r.bytes]
            if rows:
                held = " + ".join(f"{r.fmt} {fmt_bytes(r.bytes)}" for r in rows)
                parts.append(f"{names.get(kind, kind)} {held}")
        return " · ".join(parts)

    def by_kind(self) -> dict[str, int]:
        """kind -> bytes, in KINDS order."""
        out = dict.fromkeys(KINDS, 0)
        for r in self.rows:
            out[r.kind] += r.bytes
        return out


def module_kind(name: str) -> str:
    """The kind of a module of the engine's DecoderModel, from its qualified name."""
    if name.startswith("embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if name.endswith("norm") or "layernorm" in name:
        return "norm"
    return "mlp" if ".mlp." in name else "attention"


def weight_report(model: nn.Module) -> WeightReport:
    """Bytes of every weight tensor the model holds, by kind and format (shared storage once)."""
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if not name:
            continue  # the root holds only the rope tables (non-persistent buffers), not weights
        info = weight_storage(mod)
        if info is not None:
            fmt, path, tensors = info
            params = mod.in_features * mod.out_features + (
                mod.out_features if mod.bias is not None else 0
            )
        else:
            tensors = list(mod.parameters(recurse=False))
            fmt, path = (dtype_name(tensors[0].dtype), "dense") if tensors else ("", "")
            params = sum(t.numel() for t in tensors)
        fresh = [t for t in tensors if t.data_ptr() not in seen]
        if tensors and not fresh:
            acc[(module_kind(name), "tied to embedding", "-")][1] += (
                0  # a row of 0 bytes that says why
            )
            continue
        seen.update(t.data_ptr() for t in fresh)
        if fresh:
            row = acc[(module_kind(name), fmt, path)]
            row[0] += params
            row[1] += sum(t.nbytes for t in fresh)
    rows = [WeightRow(k, f, p, v[0], v[1]) for (k, f, p), v in acc.items()]
    return WeightReport(tuple(sorted(rows, key=lambda r: KINDS.index(r.kind))))


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return block_bytes(spec, 1, dtype)


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit and 3 significant digits: 1536 -> '1.5 KiB', 2097152 -> '2 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    text = f"{n:.0f}" if unit == "B" or abs(n) >= 100 else f"{n:.3g}"
    return f"{text} {unit}"


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """What the engine holds that never changes after load: weights, pool, geometry, context."""

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
        pool = engine.pool.numel() * engine.pool.element_size()
        return cls(
            weight_report(engine.model),
            pool,
            pool // engine.blocks.num_blocks,
            engine.blocks.num_blocks,
            engine.blocks.block_size,
            engine.max_model_len,
            engine.device,
            dtype_name(engine.kv_dtype),
        )

    def seqs_that_fit(self, tokens: int) -> int:
        """Sequences of `tokens` tokens the pool holds at once."""
        return self.num_blocks // -(-tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class Readings:
    """Live readings: torch's CUDA allocator and mem_get_info, or the engine process's CPU RSS."""

    rss: int | None = None
    mem_total: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    # free memory in blocks the allocator split and cannot release (inactive_split_bytes)
    fragmented: int | None = None
    device_free: int | None = None
    device_total: int | None = None


def meminfo(field: str) -> int | None:
    """A /proc/meminfo figure in bytes (MemTotal, MemAvailable), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def read_memory(device: torch.device) -> Readings:
    """Read the allocator (CUDA) or this process's RSS (CPU): call it where the engine runs."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        return Readings(
            allocated=stats["allocated_bytes.all.current"],
            reserved=stats["reserved_bytes.all.current"],
            peak=stats["allocated_bytes.all.peak"],
            fragmented=stats["inactive_split_bytes.all.current"],
            device_free=free,
            device_total=total,
        )
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Readings(rss=rss, mem_total=meminfo("MemTotal"))
