"""Memory accounting: weight bytes by module kind and format, KV bytes, and the capacity planner (`pagechat plan`).

`weight_report(model)` sums the bytes of the tensors a loaded model really holds; `estimate_weights(...)`
computes the same figures from config.json alone (they agree exactly, see tests/test_memory.py), so
`plan` answers "does it fit?" before anything heavy is loaded.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from pagechat.core.kv import CUDA_FREE_FRACTION, block_bytes
from pagechat.core.loader import ModelSpec, dtype_name
from pagechat.quant.layers import INT4_GROUPS, Bf16WOLinear, bf16_head, quant_tensors
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
    """A model's weight memory, row per (kind, format); tied weights are counted once, under embedding."""

    rows: tuple[WeightRow, ...]

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

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
    """The bytes of every weight tensor the model holds, grouped by kind and format (shared storage once)."""
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if not name:
            continue  # the root holds only the rope tables (non-persistent buffers), not weights
        info = quant_tensors(mod)
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


def _linear_bytes(
    n: int, k: int, bias: bool, mode: str | None, elem: int, group: int | None, device_type: str
) -> tuple[str, str, int]:
    """(format, path, bytes) of one decoder linear out=n, in=k as quant/layers.py stores it."""
    b = n * elem if bias else 0
    if mode is None:
        return "", "dense", n * k * elem + b
    if mode == "int8":
        return "int8", "bnb-llm.int8", n * k + 4 * n + b  # int8 rows + fp32 row absmax (SCB)
    if mode == "int8-wo":
        return "int8-wo", f"int8pack-{device_type}", n * k + 2 * n + b  # int8 + bf16 scales
    if mode == "bf16-wo":
        return "bf16-wo", Bf16WOLinear.path, 2 * n * k + b
    g = group or 128
    fast = g in INT4_GROUPS and (
        n % 16 == 0 if device_type == "cpu" else n % 8 == 0 and k % 32 == 0
    )
    if fast:  # packed int4 [n, k/2] bytes + bf16 (scale, zero) per group and column
        return f"awq-int4 g{g}", f"int4pack-{device_type}", n * k // 2 + 4 * n * (k // g) + b
    # the checkpoint's tensors as they are: qweight, qzeros, fp16 scales
    return f"awq-int4 g{g}", "dequant", n * k // 2 + n * (k // g) // 2 + 2 * n * (k // g) + b


def estimate_weights(
    spec: ModelSpec,
    mode: str | None,
    dtype: torch.dtype,
    group: int | None = None,
    device_type: str = "cuda",
) -> WeightReport:
    """What weight_report would say for this config loaded with `mode` on device_type, from config alone."""
    elem = torch.empty((), dtype=dtype).element_size()
    name = dtype_name(dtype)
    h, d, kv, hid, inter = (
        spec.num_heads,
        spec.head_dim,
        spec.num_kv_heads,
        spec.hidden_size,
        spec.intermediate_size,
    )
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    linears = (
        ("attention", (h + 2 * kv) * d, hid, spec.qkv_bias),
        ("attention", hid, h * d, spec.o_bias),
        ("mlp", 2 * inter, hid, spec.mlp_bias),
        ("mlp", hid, inter, spec.mlp_bias),
    )
    for kind, n, k, bias in linears:
        fmt, path, nbytes = _linear_bytes(n, k, bias, mode, elem, group, device_type)
        row = acc[(kind, fmt or name, path)]
        row[0] += (n * k + (n if bias else 0)) * spec.num_layers
        row[1] += nbytes * spec.num_layers
    norm = spec.num_layers * (2 * hid + (2 * d if spec.qk_norm else 0)) + hid
    acc[("norm", name, "dense")] = [norm, norm * elem]
    vocab = spec.vocab_size * hid
    head16 = bf16_head(mode, dtype)  # QuantPlan.head: a bf16 lm_head
    head_bytes = vocab * (2 if head16 else elem)
    # the engine ties lm_head to the embedding also when a checkpoint simply lacks lm_head.weight
    if spec.tie_word_embeddings:  # one table, in the head's dtype
        acc[("embedding", "bfloat16" if head16 else name, "dense")] = [vocab, head_bytes]
        acc[("lm_head", "tied to embedding", "-")] = [0, 0]
    else:
        acc[("embedding", name, "dense")] = [vocab, vocab * elem]
        acc[("lm_head", "bf16-wo", Bf16WOLinear.path) if head16 else ("lm_head", name, "dense")] = [
            vocab,
            head_bytes,
        ]
    rows = [WeightRow(k, f, p, v[0], v[1]) for (k, f, p), v in acc.items()]
    return WeightReport(tuple(sorted(rows, key=lambda r: KINDS.index(r.kind))))


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return block_bytes(spec, 1, dtype)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What fits in a memory budget: the weights, then KV blocks in what is left (vLLM's startup figures)."""

    budget: int
    weights: WeightReport
    kv_dtype: str
    kv_per_token: int
    block_size: int
    kv_budget: int
    num_blocks: int
    context: int

    @property
    def kv_per_block(self) -> int:
        return self.kv_per_token * self.block_size

    @property
    def fits(self) -> bool:
        return self.num_blocks >= math.ceil(self.context / self.block_size)

    @property
    def max_seqs(self) -> int:
        """Sequences that can each hold a full context at once."""
        return self.num_blocks // math.ceil(self.context / self.block_size)

    @property
    def concurrency(self) -> float:
        """vLLM's 'maximum concurrency': pool tokens / context."""
        return self.num_blocks * self.block_size / self.context


def plan_capacity(
    spec: ModelSpec,
    weights: WeightReport,
    kv_dtype: torch.dtype,
    budget: int,
    context: int,
    block_size: int = 16,
) -> CapacityPlan:
    """Blocks that fit when the KV pool takes CUDA_FREE_FRACTION of the budget left after the weights."""
    per_token = kv_bytes_per_token(spec, kv_dtype)
    kv_budget = max(0, int((budget - weights.total) * CUDA_FREE_FRACTION))
    return CapacityPlan(
        budget=budget,
        weights=weights,
        kv_dtype=dtype_name(kv_dtype),
        kv_per_token=per_token,
        block_size=block_size,
        kv_budget=kv_budget,
        num_blocks=kv_budget // (per_token * block_size),
        context=context,
    )


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


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
        pool = engine.pool.numel() * engine.pool.element_size()
        return cls(
            weight_report(engine.model),
            pool,
            pool // engine.blocks.num_blocks,
            engine.blocks.num_blocks,
            engine.blocks.block_size,
            engine.max_model_len,
            engine.device,
            dtype_name(engine.dtype),
        )

    def seqs_that_fit(self, tokens: int) -> int:
        """Sequences of `tokens` tokens the pool holds at once."""
        return self.num_blocks // -(-tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class Readings:
    """Live readings: the torch CUDA allocator and mem_get_info, or the RSS of the engine's process on CPU."""

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
    """Read the allocator (CUDA) or this process's RSS (CPU): call it where the engine runs."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Readings(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            peak=torch.cuda.max_memory_allocated(device),
            device_free=free,
            device_total=total,
        )
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Readings(rss=rss, mem_total=_meminfo_total())
