"""pagechat's own CPU matmul kernels (kernels.cpp), built on first use by core/native.py.

`op(name)` is torch.ops.pagechat.<name> once the library is loaded, or None where it cannot run
here (native.library says why, once); then the layers keep torch's own kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pagechat.core import native

SOURCE = Path(__file__).with_name("kernels.cpp")
PANEL = 16  # int4 rows per panel (kernels.cpp's Int4Panels)
# int4 weights go in panels on a CPU with AVX512F, BW, VNNI and VBMI, else in rows (AVX2)
INT4_PANELS = {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= (
    native.cpu_flags() or frozenset()
)
# the paths layers report when they run these kernels
INT8_PATH, FLOAT_PATH = "int8-avx2", "avx2"
INT4_PATH = "int4-avx512vnni" if INT4_PANELS else "int4-avx2"
# decode and small batches, as measured (1-16 rows); prefill's many rows are a GEMM, torch's part
MAX_ROWS = 16
BLOCK = 32  # activations are quantised per block of 32: K must be a multiple


def loaded() -> bool:
    """Whether the kernels are loaded, building them first where needed."""
    return native.library(SOURCE, "matmul kernels")


def op(name: str):
    """torch.ops.pagechat.<name>, or None where pagechat's kernels cannot run:
      int8_linear(x [M, K], weight int8 [N, K], scales [N])
      int4_linear(x [M, K], packed uint8 [N, K/2], scales float32 [N, K/g], zeros uint8 [N, K/g], g)
      float_linear(x [M, K], weight float32 or bf16 [N, K])
    x float32, bf16 or fp16, each -> [M, N] in x's dtype;
    int4_dequantize(packed, scales, zeros, g, rows=None) -> float32 [N or T, K];
    stream_read(t) -> int (reads every byte of t once)."""
    return getattr(torch.ops.pagechat, name) if loaded() else None


def int4_pack(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, panels: bool = INT4_PANELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (values 0..15), scales [N, K/g], zeros uint8 [N, K/g] -> int4_linear's
    (packed, scales float32, zeros), laid out as kernels.cpp describes: in rows, or in panels of
    PANEL rows (N padded with zero rows to a multiple of PANEL; the outputs past N are 0)."""
    n, k = q.shape
    if not panels:
        halves = q.reshape(n, k // BLOCK, 2, BLOCK // 2)
        packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
        return packed.contiguous(), scales.float().contiguous(), zeros.contiguous()
    pad = -n % PANEL
    q, scales, zeros = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, scales, zeros))
    p, groups = (n + pad) // PANEL, scales.shape[1]
    # row 4c + m of a panel, inputs 2i + e of a block -> nibble c of word 2m + e of pair i
    v = q.to(torch.int32).reshape(p, 4, 4, k // BLOCK, BLOCK // 2, 2)
    words = sum(v[:, c] << (4 * c) for c in range(4)).permute(0, 2, 3, 1, 4)
    packed = torch.stack((words & 0xFF, words >> 8), -1).to(torch.uint8)
    return (
        packed.reshape(p, k // BLOCK, PANEL * BLOCK // 2),
        scales.float().reshape(p, PANEL, groups).transpose(1, 2).contiguous(),
        zeros.reshape(p, PANEL, groups).transpose(1, 2).contiguous(),
    )
