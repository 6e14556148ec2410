"""The decoder's small ops fused for GPU steps, in Triton: RMSNorm, residual add + RMSNorm, rotary
embedding, SiLU x up; the same signatures and roundings as ops.cpp's CPU ones (core/ops.py), so
that core/model.py calls either through `ops.small_ops`.

Each is one kernel where torch's ops take several: a bf16 RMSNorm is nine kernels (the add, the
casts, the square, the mean, the rsqrt, the products), the rotary embedding four, SiLU x up two.
A decode step of a small model is hundreds of such launches, each a few microseconds of a GPU that
waits on them, inside a CUDA graph as outside one.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors: that is how the tests check them against
torch's ops without a GPU.
"""

from __future__ import annotations

import torch
from pagechat.core.paged_triton import pow2
from torch import Tensor


def _rows(x: Tensor) -> Tensor:
    """x as [rows, last dim] with the last dim's elements adjacent."""
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from pagechat.core.fused_kernels import rms_norm as kernel

    rows = _rows(x)
    res = rows if residual is None else _rows(residual)  # read only with a residual
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)  # written only with one
    n = x.shape[-1]
    if rows.shape[0]:
        kernel[(rows.shape[0],)](
            rows, res, weight, out, total, rows.stride(0), res.stride(0), n, eps,
            ADD=residual is not None, BLOCK=pow2(n),
        )  # fmt: skip
    return out, total


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in x's dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    return _norm(x, residual, weight, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] (any row and head strides, D's elements adjacent) rotated with
    core/model.py's tables cos and signed sin [T, 1, D] -> a dense [T, heads, D]."""
    from pagechat.core.fused_kernels import rope as kernel

    if x.stride(-1) != 1:
        x = x.contiguous()
    t, heads, d = x.shape
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        kernel[(t,)](
            x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), heads, d,
            BLOCK_D=pow2(d), HEADS=max(2, pow2(heads)),
        )  # fmt: skip
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2I] = (gate, up) -> [..., I]."""
    from pagechat.core.fused_kernels import silu_mul as kernel

    rows = _rows(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(inter))
    if rows.shape[0]:
        kernel[(rows.shape[0], -(-inter // block))](rows, out, rows.stride(0), inter, BLOCK=block)
    return out
