"""`pagechat plan`: what a checkpoint's weights and KV pool take, from config.json alone.

`estimate_weights` gives the figures `weight_report` reads from a loaded model (they agree exactly,
see tests/test_memory.py), so `plan` answers "does it fit?" before anything heavy is loaded.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType as T
from pagechat.core.gguf import GGUFFile
from pagechat.core.gguf_model import FLOATS, gguf_spec
from pagechat.core.kv import CUDA_FREE_FRACTION
from pagechat.core.memory import KINDS, WeightReport, WeightRow, kv_bytes_per_token
from pagechat.core.modelspec import ModelSpec, dtype_name
from pagechat.quant import kernels
from pagechat.quant.ggml import GROUP, INT4, label
from pagechat.quant.head import INT4_GROUP, check_int4_tie, head_format
from pagechat.quant.layers import (
    INT4_GROUPS,
    INT4_KERNEL_PATH,
    INT8_KERNEL_PATH,
    bf16_wo_path,
    int4_kernel_runs,
    int8_kernel_runs,
)


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
        if int8_kernel_runs(k, device_type):  # int8 + bf16 scales, in panels padded
            rows = kernels.stored_rows(n)
            return "int8-wo", INT8_KERNEL_PATH, rows * k + 2 * rows + b
        return "int8-wo", f"int8pack-{device_type}", n * k + 2 * n + b
    if mode == "bf16-wo":
        return "bf16-wo", bf16_wo_path(k, device_type), 2 * n * k + b
    g = group or 128
    path, nbytes = _int4_bytes(n, k, g, device_type, 2, mins=False)  # AWQ's fp16 scales, zeros
    return f"awq-int4 g{g}", path, nbytes + b


def _int4_bytes(
    n: int, k: int, g: int, device_type: str, scale: int, mins: bool
) -> tuple[str, int]:
    """(path, bytes) of an Int4Linear out=n, in=k in groups of g whose format keeps `scale`-byte
    scales (AWQ's, Q4_0's and Q4_1's fp16: 2; Q4_K's float32: 4) and uint8 zeros or mins in the
    scales' dtype, as quant/layers.py stores it."""
    groups = k // g
    path = _int4_path(n, k, g, device_type)
    if path == INT4_KERNEL_PATH:  # in panels, the format's scales as they are
        rows = kernels.stored_rows(n, panels=True)
        return path, rows * k // 2 + (scale + (scale if mins else 1)) * rows * groups
    if path != "dequant":  # packed int4 [n, k/2] bytes + bf16 (scale, zero) per group and row
        return path, n * k // 2 + 4 * n * groups
    # AWQ's int32 packing of the values and of zeros; the scales and mins as they are
    return path, n * k // 2 + scale * n * groups + (scale * n * groups if mins else n * groups // 2)


def _int4_path(n: int, k: int, g: int, device_type: str) -> str:
    """The kernel an int4 layer out=n, in=k in groups of g runs on device_type (layers.awq_path,
    taking a GPU to have torch's int4 kernel)."""
    if int4_kernel_runs(k, g, device_type):
        return INT4_KERNEL_PATH
    fast = g in INT4_GROUPS and (
        n % 16 == 0 if device_type == "cpu" else n % 8 == 0 and k % 32 == 0
    )
    return f"int4pack-{device_type}" if fast else "dequant"


def _head_bytes(
    spec: ModelSpec, fmt: str, elem: int, name: str, device_type: str
) -> tuple[str, str, int]:
    """(format, path, bytes) of lm_head in head_format `fmt` as quant/head.py builds it; tied, of
    the embedding that holds its table."""
    n, k, tied = spec.vocab_size, spec.hidden_size, spec.tie_word_embeddings
    if fmt == "dense":
        return name, "dense", n * k * elem
    if fmt == "bf16":  # tied: an nn.Embedding over the head's bf16 table
        if tied:
            return "bfloat16", "dense", 2 * n * k
        return "bf16-wo", bf16_wo_path(k, device_type), 2 * n * k
    mode = "int8-wo" if fmt == "int8" else "awq"
    fmt, path, nbytes = _linear_bytes(n, k, False, mode, elem, INT4_GROUP, device_type)
    if tied and mode == "awq":
        check_int4_tie(path)
        if path == "int4pack-cpu":  # Int4PackRows: each row's start (int64) and stride (int16)
            nbytes += 10 * n
    return fmt, path, nbytes


def estimate_weights(
    spec: ModelSpec,
    mode: str | None,
    dtype: torch.dtype,
    group: int | None = None,
    device_type: str = "cuda",
    lm_head: str = "auto",
) -> WeightReport:
    """What weight_report would say for this config loaded as `mode` (and --lm-head) on
    device_type, from config."""
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
    fmt, path, head_bytes = _head_bytes(
        spec, head_format(lm_head, mode, dtype), elem, name, device_type
    )
    # the engine ties lm_head to the embedding also when a checkpoint simply lacks lm_head.weight
    if spec.tie_word_embeddings:  # one table, in the head's format
        acc[("embedding", fmt, path)] = [vocab, head_bytes]
        acc[("lm_head", "tied to embedding", "-")] = [0, 0]
    else:
        acc[("embedding", name, "dense")] = [vocab, vocab * elem]
        acc[("lm_head", fmt, path)] = [vocab, head_bytes]
    rows = [WeightRow(k, f, p, v[0], v[1]) for (k, f, p), v in acc.items()]
    return WeightReport(tuple(sorted(rows, key=lambda r: KINDS.index(r.kind))))


def _gguf_linear_bytes(qtype: T, n: int, k: int, elem: int, device_type: str) -> tuple[str, int]:
    """(path, bytes) of a GGUF linear of type qtype, out=n, in=k, as quant/ggml.py builds it."""
    groups = k // GROUP
    if qtype in FLOATS:
        return "dense", n * k * elem
    if qtype in INT4:  # Q4_0: fp16 scales and zeros; Q4_1: fp16 mins; Q4_K: float32 both
        scale = 4 if qtype == T.Q4_K else 2
        return _int4_bytes(n, k, GROUP, device_type, scale, mins=qtype != T.Q4_0)
    # Q8_0, and the types requantised to it: int8 and an fp16 scale per group (float32 in rows)
    if int8_kernel_runs(k, device_type):
        rows = kernels.stored_rows(n)
        return INT8_KERNEL_PATH, rows * k + (2 if kernels.INT8_PANELS else 4) * rows * groups
    return "dequant", n * k + 2 * n * groups


def estimate_gguf_weights(
    f: GGUFFile, dtype: torch.dtype, device_type: str = "cuda", lm_head: str = "auto"
) -> WeightReport:
    """What weight_report would say of a quantised GGUF loaded in dtype on device_type: each
    tensor in its type's layout, the decoder's fused linears one layer where their parts share a
    type and one per part where they do not (quant/ggml.py)."""
    spec = gguf_spec(f)
    elem = torch.empty((), dtype=dtype).element_size()
    name = dtype_name(dtype)
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(kind: str, qtype: T, n: int, k: int, bias: bool) -> tuple[str, str, int]:
        path, nbytes = _gguf_linear_bytes(qtype, n, k, elem, device_type)
        fmt = name if qtype in FLOATS else label(qtype)
        row = acc[(kind, fmt, path)]
        row[0] += n * k + (n if bias else 0)
        row[1] += nbytes + (n * elem if bias else 0)
        return fmt, path, nbytes

    for i in range(spec.num_layers):
        for kind, parts in (
            ("attention", ("attn_q", "attn_k", "attn_v")),
            ("attention", ("attn_output",)),
            ("mlp", ("ffn_gate", "ffn_up")),
            ("mlp", ("ffn_down",)),
        ):
            infos = [f.tensors[f"blk.{i}.{p}.weight"] for p in parts]
            bias = f"blk.{i}.{parts[0]}.bias" in f.tensors
            groups = [infos] if len({t.type for t in infos}) == 1 else [[t] for t in infos]
            for group in groups:
                add(kind, group[0].type, sum(t.shape[0] for t in group), infos[0].shape[1], bias)
    norms = sum(t.shape[0] for t in f.tensors.values() if len(t.shape) == 1 and "norm" in t.name)
    acc[("norm", name, "dense")] = [norms, norms * elem]
    vocab, hidden = spec.vocab_size, spec.hidden_size
    table = f.tensors["token_embd.weight" if spec.tie_word_embeddings else "output.weight"]
    if lm_head == "auto":
        path, nbytes = _gguf_linear_bytes(table.type, vocab, hidden, elem, device_type)
        fmt = name if table.type in FLOATS else label(table.type)
        if spec.tie_word_embeddings and path == "int4pack-cpu":
            nbytes += 10 * vocab  # Int4PackRows: each row's start (int64) and stride (int16)
    else:
        fmt, path, nbytes = _head_bytes(
            spec, head_format(lm_head, "gguf", dtype), elem, name, device_type
        )
    if spec.tie_word_embeddings:
        acc[("embedding", fmt, path)] = [vocab * hidden, nbytes]
        acc[("lm_head", "tied to embedding", "-")] = [0, 0]
    else:
        acc[("lm_head", fmt, path)] = [vocab * hidden, nbytes]
        embed = f.tensors["token_embd.weight"].type
        path, nbytes = _gguf_linear_bytes(embed, vocab, hidden, elem, device_type)
        acc[("embedding", name if embed in FLOATS else label(embed), path)] = [
            vocab * hidden,
            nbytes,
        ]
    rows = [WeightRow(k, fm, p, v[0], v[1]) for (k, fm, p), v in acc.items()]
    return WeightReport(tuple(sorted(rows, key=lambda r: KINDS.index(r.kind))))


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What fits in a budget: the weights, then KV blocks in the rest (vLLM's startup figures)."""

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
    """Blocks that fit when the KV pool takes CUDA_FREE_FRACTION of what the weights leave."""
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
