"""The Triton kernels of core/fused_triton.py (which says what they compute and why), apart so that
a process that never runs a model on a GPU never imports Triton."""

import triton
import triton.language as tl


@triton.jit
def rounded(x, ty: tl.constexpr):
    """float32 x rounded to ty (to nearest, ties to even) and back, so that a store as ty is
    exact. bf16 by its bits: Triton's interpreter, which the tests run, truncates a float32 cast
    to bf16."""
    if ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(ty).to(tl.float32)


@triton.jit
def rms_norm(
    x, residual, weight, out, sum_out, x_row, r_row, n, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row t: out = x / sqrt(mean(x^2) + eps) * weight in float32 math, the normalised row rounded
    to the dtype before the weight multiplies it; with ADD, x + residual first (rounded, as torch
    adds), written to sum_out too."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < n
    ty = out.dtype.element_ty
    xf = tl.load(x + t * x_row + i, mask=m, other=0.0).to(tl.float32)
    if ADD:
        rt = tl.load(residual + t * r_row + i, mask=m, other=0.0).to(tl.float32)
        xf = rounded(xf + rt, ty)
        tl.store(sum_out + t * n + i, xf.to(ty), mask=m)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(weight + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out + t * n + i, rounded(w * rounded(xf * r, ty), ty).to(ty), mask=m)


@triton.jit
def rope(
    x, cos, sin, out, x_row, x_head, heads, d_size,
    BLOCK_D: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """Token t's heads: x * cos + (x rolled by D/2) * sin, each product rounded to the dtype."""
    t = tl.program_id(0)
    h, d = tl.arange(0, HEADS), tl.arange(0, BLOCK_D)
    m = (h[:, None] < heads) & (d[None, :] < d_size)
    at = t * x_row + h[:, None] * x_head
    xt = tl.load(x + at + d[None, :], mask=m, other=0.0).to(tl.float32)
    rolled = (d[None, :] + d_size // 2) % d_size
    other = tl.load(x + at + rolled, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos + t * d_size + d, mask=d < d_size, other=0.0).to(tl.float32)
    s = tl.load(sin + t * d_size + d, mask=d < d_size, other=0.0).to(tl.float32)
    ty = out.dtype.element_ty
    y = rounded(rounded(xt * c[None, :], ty) + rounded(other * s[None, :], ty), ty)
    tl.store(out + (t * heads + h[:, None]) * d_size + d[None, :], y.to(ty), mask=m)


@triton.jit
def silu_mul(gate_up, out, g_row, inter, BLOCK: tl.constexpr):
    """Columns of row t of (gate, up): silu(gate) rounded to the dtype, times up."""
    t, c = tl.program_id(0), tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    g = tl.load(gate_up + t * g_row + i, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gate_up + t * g_row + inter + i, mask=m, other=0.0).to(tl.float32)
    ty = out.dtype.element_ty
    silu = rounded(g / (1.0 + tl.exp(-g)), ty)
    tl.store(out + t * inter + i, rounded(silu * up, ty).to(ty), mask=m)
