"""pagechat's own CPU matmul kernels (kernels.cpp), built on first use by core/native.py.

`op(name)` is torch.ops.pagechat.<name> once the library is loaded, or None where it cannot run
here (native.library says why, once); then the layers keep torch's own kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pagechat.core import native

SOURCE = Path(__file__).with_name("kernels.cpp")
PANEL = 16  # int4 and int8 rows per panel (kernels.cpp's Panels)
# int4 weights go in panels on every CPU; int8 weights on a CPU with AVX512F, BW, VL and VNNI, else
# in rows (AVX2; also where PAGECHAT_KERNELS=avx2)
INT8_PANELS = not native.avx2_only() and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= (
    native.cpu_flags() or frozenset()
)
# bf16 weights times bf16 activations by AVX512-BF16's vdpbf16ps (not where PAGECHAT_KERNELS=avx2)
BF16_DOT = not native.avx2_only() and {"avx512f", "avx512bw", "avx512_bf16"} <= (
    native.cpu_flags() or frozenset()
)
# float32 and bf16 weights times float32 activations in AVX512 tiles of 8 rows on a CPU with
# AVX512F, else AVX2's of 4 (also where PAGECHAT_KERNELS=avx2)
FLOAT_WIDE = not native.avx2_only() and "avx512f" in (native.cpu_flags() or frozenset())
# the paths layers report when they run these kernels (the float one is bf16-wo's, whose float32
# activations take the float tile; a bf16 model's dense layers are reported as dense)
_ISA = "avx512vnni" if INT8_PANELS else "avx2"
INT8_PATH, INT4_PATH = f"int8-{_ISA}", f"int4-{_ISA}"
FLOAT_PATH = "avx512" if FLOAT_WIDE else "avx2"
# decode and small batches, as measured (1-16 rows); prefill's many rows are a GEMM, torch's part
MAX_ROWS = 16
# bf16 rows on vdpbf16ps beat oneDNN's bf16 GEMM up to 32-48 (the 135M shape's layers, 2 threads,
# no AMX, interleaved: 8 rows 0.56x its time, 32 rows 0.89x, 48 rows 1.09x; docs/benchmarks.md)
DOT_ROWS = 32
BLOCK = 32  # activations are quantised per block of 32: K must be a multiple


def loaded() -> bool:
    """Whether the kernels are loaded, building them first where needed."""
    return native.library(SOURCE, "matmul kernels")


def op(name: str):
    """torch.ops.pagechat.<name>, or None where pagechat's kernels cannot run:
      int8_linear(x [M, K], weight int8 [N, K] (or int8_pack's panels), scales [N] or [N, G])
      int4_linear(x [M, K], packed, scales, offsets, g) (int4_pack's, either layout)
      float_linear(x [M, K], weight float32 or bf16 [N, K], dot=False) (dot: BF16_DOT's
        vdpbf16ps where x and the weight are bf16)
    x float32, bf16 or fp16, each -> [M, N] in x's dtype;
    int4_dequantize(packed, scales, offsets, g, rows=None, dtype=None) -> [N or T, K] float32/bf16;
    int8_unpanel(weight in panels, dtype, scales=None) -> [N, K] float32 or bf16;
    stream_read(t) -> int (reads every byte of t once)."""
    return getattr(torch.ops.pagechat, name) if loaded() else None


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T on the float kernel, by vdpbf16ps where BF16_DOT and both are
    bf16."""
    return torch.ops.pagechat.float_linear(x, weight, BF16_DOT)


def float_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] @ weight float32 or bf16 [N, K]^T -> float32 [M, N] on gemm.h's prefill
    GEMM, which reads the weight as stored (loaded)."""
    return torch.ops.pagechat.float_gemm(x, weight)


def float_rows(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
    """The most activation rows the float kernel takes for these dtypes; more go to torch's GEMM."""
    dot = BF16_DOT and x_dtype == weight_dtype == torch.bfloat16
    return DOT_ROWS if dot else MAX_ROWS


def int4_pack(
    q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (values 0..15), scales [N, K/g] and offsets [N, K/g] (uint8 zeros: w = (q -
    zero) * scale; float mins: w = q * scale + min) -> int4_linear's (packed, scales, offsets) in
    panels of PANEL rows, as kernels.cpp describes (fp16 scales kept in fp16, others float32, mins
    in the scales' dtype; N padded with zero rows to a multiple of PANEL, whose outputs are 0)."""
    k = q.shape[1]
    dtype = torch.float16 if scales.dtype == torch.float16 else torch.float32
    q, scales, offsets = _pad_rows(q), _pad_rows(scales.to(dtype)), _pad_rows(offsets)
    p = q.shape[0] // PANEL
    # row r of a panel, input 16h + 4t + e of a block -> byte 4r + e of the block's part t, its
    # low nibble (h = 0) or high one
    v = q.reshape(p, PANEL, k // BLOCK, 2, 4, 4)
    packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    mins = offsets.is_floating_point()
    return (
        packed.reshape(p, k // BLOCK, PANEL * BLOCK // 2).contiguous(),
        _panel_groups(scales),
        _panel_groups(offsets.to(dtype) if mins else offsets),
    )


def _panel_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-row, per-group values [N, G] (N a multiple of PANEL) -> the panels' [N/16, G, 16]."""
    return t.reshape(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def stored_rows(n: int, panels: bool = INT8_PANELS) -> int:
    """The rows int4_pack (panels: True) and int8_pack store for n: in panels, n padded to a
    multiple of PANEL."""
    return n + (-n % PANEL if panels else 0)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows added up to stored_rows(N) in panels."""
    n = t.shape[0]
    return torch.cat([t, t.new_zeros(stored_rows(n, True) - n, *t.shape[1:])])


def int8_pack(
    q: torch.Tensor, scales: torch.Tensor, panels: bool = INT8_PANELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K], scales [N] (a row's) or [N, G] (a group of K/G inputs') -> int8_linear's
    (weight, scales): as they are (group scales float32), or in panels of PANEL rows, [N/16, K/32,
    512] and scales [N] or [N/16, G, 16] (fp16 group scales kept in fp16, others float32; both
    padded with zero rows to a multiple of PANEL; the outputs past N are 0)."""
    grouped = scales.dim() == 2
    if grouped:
        half = panels and scales.dtype == torch.float16
        scales = scales.to(torch.float16 if half else torch.float32)
    if not panels:
        return q.contiguous(), scales.contiguous()
    q, scales = _pad_rows(q), _pad_rows(scales)
    n, k = q.shape
    # row r of a panel, inputs 2i + e of a block -> byte 2r + e of pair i
    v = q.reshape(n // PANEL, PANEL, k // BLOCK, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
    weight = v.reshape(n // PANEL, k // BLOCK, PANEL * BLOCK).contiguous()
    return weight, _panel_groups(scales) if grouped else scales


def int8_rows(
    weight: torch.Tensor, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.int8
) -> torch.Tensor:
    """int8_pack's weight (either layout) as rows [N, K] of dtype (int8 values, exact in bf16 and
    float32; in panels, N padded), or only the rows `ids` [T]. All the rows of panels as float32 or
    bf16 (prefill's GEMM) come from int8_unpanel, in one pass."""
    if weight.dim() == 2:
        return (weight if ids is None else weight[ids]).to(dtype)
    p, blocks = weight.shape[:2]
    if ids is None and dtype in (torch.float32, torch.bfloat16):
        return op("int8_unpanel")(weight, dtype)
    v = weight.view(p, blocks, BLOCK // 2, PANEL, 2)
    if ids is None:
        return v.permute(0, 3, 1, 2, 4).reshape(p * PANEL, blocks * BLOCK).to(dtype)
    return v[ids // PANEL, :, :, ids % PANEL].reshape(ids.shape[0], blocks * BLOCK).to(dtype)


def int8_dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """int8_pack's (weight, scales) as dequantised rows [N, K] (in panels, N padded) or the rows
    `ids` [T], in float32 or bf16: each value times its row's or group's scale (exact in float32:
    an int8 times an fp16 or float32 scale of a GGUF or an int8 layer)."""
    if weight.dim() == 3 and ids is None:
        return op("int8_unpanel")(weight, dtype, scales)
    rows = int8_rows(weight, ids, torch.float32)
    if scales.dim() == 1:  # a scale per row
        s = scales if ids is None else scales[ids]
        return (rows * s.float().unsqueeze(1)).to(dtype)
    if scales.dim() == 3 and ids is None:  # panels' [N/16, G, 16] back to [N, G]
        s = scales.transpose(1, 2).reshape(-1, scales.shape[1])
    elif scales.dim() == 3:  # only the rows looked up (a decode step's one token per sequence:
        # the whole table's scales transposed for it took 0.3 ms a step)
        s = scales[ids // PANEL, :, ids % PANEL]
    else:
        s = scales if ids is None else scales[ids]
    s = s.float()
    return (rows.view(rows.shape[0], s.shape[1], -1) * s.unsqueeze(-1)).view(rows.shape).to(dtype)
