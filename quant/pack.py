"""4-bit group quantisation and the AutoAWQ GEMM packing: eight 4-bit values per int32, interleaved.

Shapes follow AutoAWQ (transposed vs nn.Linear): for a Linear(in=K, out=N) with group g, qweight is
int32 [K, N/8], qzeros int32 [K/g, N/8], scales fp16 [K/g, N];
W^T[k, n] = (q[k, n] - z[k//g, n]) * s[k//g, n].
"""

from __future__ import annotations

import torch

BITS = 4
MAX_Q = 2**BITS - 1
# Nibble i (bits 4i..4i+3) of packed word c holds logical column 8c + AWQ_ORDER[i]; unpacking takes
# nibbles LSB-first, so logical column j is nibble AWQ_REVERSE[j]. (The order suits the loads of
# AutoAWQ's CUDA kernel.)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 [R, N] -> AutoAWQ-packed int32 [R, N/8]."""
    r, n = q.shape
    nib = q.to(torch.int64).view(r, n // 8, 8)[:, :, list(AWQ_ORDER)]
    words = (nib << _SHIFTS.to(torch.int64)).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(
        torch.int32
    )  # two's-complement wrap to int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ-packed int32 [R, N/8] -> uint8 values 0..15 [R, N]."""
    r, c = packed.shape
    nib = (
        packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(packed.device)
    ) & 0xF  # arithmetic shift, then mask
    return nib[:, :, list(AWQ_REVERSE)].reshape(r, c * 8).to(torch.uint8)


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of w [N, K] per group -> q [N, K], zeros and scales [N, K/g]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = (hi - lo).clamp(min=1e-5) / MAX_Q
    zeros = (-torch.round(lo / scales)).clamp(0, MAX_Q)
    q = (torch.round(g / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, MAX_Q)
    return q.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] after a 4-bit quantise-dequantise round trip (what the packed layer uses)."""
    n, k = w.shape
    q, z, s = quantize_groups(w, group)
    deq = (q.float().reshape(n, k // group, group) - z.float().unsqueeze(-1)) * s.unsqueeze(-1)
    return deq.reshape(n, k).to(w.dtype)


def to_awq(
    w: torch.Tensor, group: int, bias: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """An nn.Linear weight [N, K] (and bias) -> AutoAWQ GEMM {qweight, qzeros, scales[, bias]}."""
    q, z, s = quantize_groups(w, group)
    s16 = s.to(torch.float16)
    # Round the scales to fp16 first and requantise with them: the stored q then fits the stored
    # scale exactly.
    q = _requantize(w, z, s16.float(), group)
    out = {
        "qweight": pack_awq(q.t().contiguous()),
        "qzeros": pack_awq(z.t().contiguous()),
        "scales": s16.t().contiguous(),
    }
    if bias is not None:
        out["bias"] = bias.to(torch.float16)
    return out


def _requantize(
    w: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    q = (torch.round(g / scales.unsqueeze(-1)) + zeros.float().unsqueeze(-1)).clamp(0, MAX_Q)
    return q.reshape(n, k).to(torch.uint8)


def dequantize(
    q: torch.Tensor,
    offsets: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """AWQ-layout q [K, N], offsets and scales [K/g, N] -> W^T [K, N] in dtype: offsets are
    integer zeros, w = (q - zero) * scale, or float mins (GGUF's Q4_1, Q4_K), w = q * scale +
    min."""
    k, n = q.shape
    g = q.to(dtype).view(k // group, group, n)
    s, o = scales.to(dtype).unsqueeze(1), offsets.to(dtype).unsqueeze(1)
    deq = g * s + o if offsets.is_floating_point() else (g - o) * s
    return deq.view(k, n)
