"""pagechat's own CPU matmul kernels (kernels.cpp), built on first use by core/native.py.

`op(name)` is torch.ops.pagechat.<name> once the library is loaded, or None where it cannot run
here (native.library says why, once); then the layers keep torch's own kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pagechat.core import native

SOURCE = Path(__file__).with_name("kernels.cpp")
# the paths layers report when they run these kernels
INT8_PATH, INT4_PATH, FLOAT_PATH = "int8-avx2", "int4-avx2", "avx2"
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
    int4_dequantize(packed, scales, zeros, g) -> float32 [N, K];
    stream_read(t) -> int (reads every byte of t once)."""
    return getattr(torch.ops.pagechat, name) if loaded() else None
