"""A GGUF file's tensors as pagechat's layers: each ggml type the kernels run as it is stays in
the file's numbers; the rest are requantised once, at load.

  Q4_0            -> Int4Linear, groups of 32: scale d, zero 8          (18 bytes a block in the
  Q4_1            -> Int4Linear, groups of 32: scale d, min m            file; in panels 19, 20,
  Q4_K            -> Int4Linear, groups of 32: scale d * sc, min -dmin*m 24 and 34)
  Q8_0            -> Int8WOLinear, a scale d per 32 values
  F32, F16, BF16  -> a dense layer in the model's dtype
  anything else   -> Int8WOLinear as Q8_0: dequantised by the gguf package, then quantised to
                     Q8_0 as llama.cpp quantises it (labelled "Q6_K→int8")
Norms and biases (1-D) are read as floats in the model's dtype whatever their type. Each layer's
`quant_format` names the file's type, so the memory report says what came from where. A fused
layer (q/k/v, gate/up) whose parts have different types (Q4_K_M files keep attn_v in Q6_K) is a
StackedLinear of one layer per part.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize
from pagechat.core.errors import PagechatError
from pagechat.core.gguf_model import FLOATS, GGMLTensor, dequantized
from pagechat.core.model import LinearLoader, TableLoader, dense_embedding, dense_linear, linear
from pagechat.quant.head import Int4Head, Int8Head
from pagechat.quant.layers import Int4Linear, Int8WOLinear, on_kernel
from torch import nn

GROUP = 32  # the values a Q4_0 / Q4_1 / Q8_0 block and a Q4_K sub-block hold
INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
NATIVE = (*INT4, T.Q8_0)
REQUANT_ROWS = 1 << 22  # values dequantised at a time when requantising (16 MiB of float32)


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block of b [..., block bytes], as [...]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 16 bytes of a 32-value block: value j in byte j's low nibble, j + 16 in its high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's get_scale_k4)."""
    d, m, md = scales.view(*scales.shape[:-1], 3, 4).unbind(-2)
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def unpack_int4(t: GGMLTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor [N, K] -> q uint8 [N, K] (0..15), scales [N, K/32] and offsets
    [N, K/32]: Q4_0's zeros (uint8, 8) or the others' mins, in the file's own numbers (fp16, or
    for Q4_K the float32 products ggml computes, which are exact)."""
    n, k = t.shape
    if t.type == T.Q4_K:
        b = t.blocks.view(n, k // 256, 144)
        sc, mn = _k_scales(b[..., 4:16])
        scales = _halves(b, 0).float().unsqueeze(-1) * sc.float()
        mins = -(_halves(b, 2).float().unsqueeze(-1) * mn.float())
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 values: 2 sub-blocks each
        q = torch.stack((qs & 0x0F, qs >> 4), dim=3)  # low nibbles: sub-block 2c, high: 2c + 1
        return q.reshape(n, k), scales.reshape(n, -1), mins.reshape(n, -1)
    size = 18 if t.type == T.Q4_0 else 20
    b = t.blocks.view(n, k // GROUP, size)
    q = _nibbles(b[..., size - 16 :]).reshape(n, k)
    if t.type == T.Q4_0:
        return q, _halves(b, 0), torch.full((n, k // GROUP), 8, dtype=torch.uint8)
    return q, _halves(b, 0), _halves(b, 2)


def unpack_q8_0(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [N, K/32 * 34] -> q int8 [N, K] and fp16 scales [N, K/32]."""
    b = blocks.view(n, k // GROUP, 34)
    return b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _halves(b, 0)


def requantize(t: GGMLTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any type the gguf package reads -> Q8_0's (q, scales), a slice of rows at a time."""
    n, k = t.shape
    if k % GROUP:
        raise PagechatError(
            f"{t.file}: tensor {t.name} ({t.type.name}) has rows of {k}, not whole Q8_0 blocks"
        )
    step = max(1, REQUANT_ROWS // k)
    parts = []
    for r in range(0, n, step):
        values = dequantized(t.blocks[r : r + step].numpy(), t.type, f"{t.file}: tensor {t.name}")
        parts.append(torch.from_numpy(np.ascontiguousarray(quantize(values, T.Q8_0))))
    return unpack_q8_0(torch.cat(parts), n, k)


def label(qtype: T) -> str:
    """What a layer made from qtype is called in the memory report."""
    return qtype.name if qtype in NATIVE or qtype in FLOATS else f"{qtype.name}→int8"


class StackedLinear(nn.Module):
    """Linears of different formats side by side: the output is theirs concatenated (a fused
    q/k/v or gate/up whose parts a GGUF stores in different types)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def gguf_layer(
    t: GGMLTensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    int4: type[Int4Linear] = Int4Linear,
    int8: type[Int8WOLinear] = Int8WOLinear,
) -> nn.Module:
    """One layer of tensor t in its type's format (int4 and int8 as the given classes: heads are
    built as Int4Head / Int8Head)."""
    if t.type in FLOATS:
        weight = t.blocks.view(FLOATS[t.type]).reshape(t.shape).to(dtype)
        return on_kernel(linear(weight, bias))
    if t.type in INT4:
        q, scales, offsets = unpack_int4(t)
        layer = int4(q.t(), offsets.t(), scales.t(), bias, GROUP, device)
    elif t.type == T.Q8_0:
        layer = int8(*unpack_q8_0(t.blocks, *t.shape), bias, device)
    else:
        layer = int8(*requantize(t), bias, device)
    layer.quant_format = label(t.type)
    return layer


def _joined(parts: list[GGMLTensor]) -> GGMLTensor:
    """Tensors of one type stacked on their rows (a fused layer's parts)."""
    rows = sum(p.shape[0] for p in parts)
    blocks = torch.cat([p.blocks for p in parts])
    name, first = "+".join(p.name for p in parts), parts[0]
    return GGMLTensor(name, first.type, (rows, first.shape[1]), blocks, first.file)


def gguf_loader(device: torch.device) -> LinearLoader:
    """The LinearLoader of a quantised GGUF's decoder linears."""

    def load(w, names, out_sizes, in_size, bias, dtype):
        named = list(zip(names, out_sizes))
        parts = [w.ggml(f"{n}.weight", (o, in_size)) for n, o in named]
        types = {p.type for p in parts}
        if types <= set(FLOATS):
            return on_kernel(dense_linear(w, names, out_sizes, in_size, bias, dtype))
        biases = [w.floats(f"{n}.bias", (o,), dtype) if bias else None for n, o in named]
        if len(types) == 1:
            b = torch.cat(biases) if bias else None
            return gguf_layer(_joined(parts), b, dtype, device)
        return StackedLinear([gguf_layer(p, b, dtype, device) for p, b in zip(parts, biases)])

    return load


def gguf_head(device: torch.device, dtype: torch.dtype) -> TableLoader:
    """The LM head in the file's own format (a tied one: the embedding reads its table)."""

    def load(w, name: str, shape: tuple[int, int]) -> nn.Module:
        return gguf_layer(w.ggml(name, shape), None, dtype, device, Int4Head, Int8Head)

    return load


def gguf_embedding(device: torch.device, dtype: torch.dtype) -> TableLoader:
    """An untied embedding in the file's own format: a float table as floats, a quantised one
    kept quantised, its rows dequantised as they are looked up."""
    dense = dense_embedding(dtype)

    def load(w, name: str, shape: tuple[int, int]) -> nn.Module:
        if w.type_of(name) in FLOATS:
            return dense(w, name, shape)
        return gguf_head(device, dtype)(w, name, shape).embedding()

    return load
