"""The decoder's small ops fused for CPU steps (ops.cpp: RMSNorm, residual add + RMSNorm, rotary
embedding, SiLU x up, and decode attention), built on first use by native.py.

core/model.py asks `small_ops(device, dtype)` once per model: ops.cpp's on a CPU, Triton's on a
GPU (core/fused_triton.py), else (float16 on a CPU, PAGECHAT_KERNELS=0, no compiler or no Triton)
None, and the model runs the same math as torch ops.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from pagechat.core import fused_triton, native, paged_triton

SOURCE = Path(__file__).with_name("ops.cpp")


def fused(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on device in dtype runs torch.ops.pagechat's fused small ops."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and native.library(SOURCE, "fused ops")
    )


# torch.ops.pagechat (ops.cpp's) or core/fused_triton.py: rms_norm, add_rms_norm, rope, silu_mul
SmallOps = ModuleType | torch._ops._OpNamespace


def small_ops(device: torch.device, dtype: torch.dtype) -> SmallOps | None:
    """The fused small ops a model on device in dtype runs, or None for torch's: ops.cpp's on a
    CPU where fused(), Triton's on a GPU where decode attention is Triton's too."""
    if fused(device, dtype):
        return torch.ops.pagechat
    if paged_triton.runs_on(device):
        return fused_triton
    return None


def sampler_ops_take(x: torch.Tensor) -> bool:
    """Whether ops.cpp's passes over a vocabulary (row_max, candidates, softmax_draw) take x:
    float32 logits [n, V > 0] on a CPU where the ops build."""
    return x.dtype == torch.float32 and x.shape[-1] > 0 and fused(x.device, x.dtype)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value [n, 1] and the index of its first occurrence [n], in one pass:
    ops.cpp's on a CPU where the ops build (torch's max(dim) took 60-80 us over a 49,152-token
    vocabulary, amax 7-9, and the sampler ran both), else torch's max. A NaN makes a value NaN."""
    if sampler_ops_take(x):
        return torch.ops.pagechat.row_max(x)
    values, indices = x.max(dim=-1, keepdim=True)
    return values, indices.squeeze(1)


def candidates(
    x: torch.Tensor, temps: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling panel's candidates of each row of x [n, V] (float32 logits): ids [n, k + 1],
    the row's k largest (larger value first; ties: ops.cpp's the lower id first, torch's in its
    own order) then chosen's [n], and their probabilities under softmax(x / temps) [n, k + 1],
    as e^((x - max) / t) over its sum, so that a temperature too small to divide by gives the
    maxima equal shares. ops.cpp's where the ops build (torch's topk and a softmax of the whole
    row took 85 and 35-92 us over 49,152 ids, ops.cpp's both 43), else torch's."""
    if sampler_ops_take(x):
        return torch.ops.pagechat.candidates(x, temps, chosen, k)
    ids = torch.cat([x.topk(k, dim=-1).indices, chosen.unsqueeze(1)], dim=1)
    shifted = (x - x.amax(dim=-1, keepdim=True)) / temps.unsqueeze(1)
    return ids, shifted.softmax(dim=-1).gather(1, ids)
