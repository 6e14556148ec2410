"""Paged decode attention in Triton, for CUDA: each query reads its sequence's K/V where they lie in
the pool, through its block table (vLLM's paged attention), instead of a gather of every context
into dense tensors. The kernels' grids depend on the batch and the table's width alone (context
lengths are read from a tensor), so a decode step that runs them can be captured as a CUDA graph
and replayed for any lengths (core/cuda_graphs.py).

A context is cut into partitions attended in parallel, each with its own running max and sum, then
merged (flash-decoding, vLLM's paged attention v2): one sequence of a model with 3 KV heads would
otherwise keep 3 of a GPU's 132 multiprocessors busy. The query heads sharing a KV head are one
program's rows, so their keys are read once.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors: that is how the tests check them
against the gathered path without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from pagechat.core import native
from torch import Tensor

MAX_PARTITIONS = 32  # a context is attended in at most this many pieces
MIN_PARTITION = 256  # tokens; fewer would cost more in merging than they save


@functools.cache
def available() -> bool:
    """Whether Triton is installed (CUDA builds of torch ship it) and PAGECHAT_KERNELS allows
    pagechat's own kernels."""
    return native.enabled() and importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether steps on device run pagechat's Triton kernels (this decode attention, and
    core/fused_triton.py's small ops, which only CUDA graphs record, not a step's trace)."""
    return device.type == "cuda" and available()


def pow2(n: int) -> int:
    """The smallest power of two >= n: a Triton block's size."""
    return 1 << max(n - 1, 0).bit_length()


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    block_table: Tensor, q_pos: Tensor, block_size: int, window: int,
) -> Tensor:  # fmt: skip
    """One new token per row: write k/v [T, KV, D] at slot_mapping [T] (negative: skipped), then
    attend q [T, H, D] at positions q_pos [T, 1] to positions 0..q_pos of its row of block_table
    [T, W] (within `window` when > 0) -> [T, H, D] in q's dtype. Rows' last dims contiguous; the
    caches [slots, KV, D]."""
    from pagechat.core.paged_kernels import attend_part, merge, store_kv

    (t, heads, d), kv_heads = q.shape, k_cache.shape[1]
    if t == 0:
        return torch.empty_like(q)
    q_pos = q_pos.reshape(t)  # a view of the contiguous [T, 1]
    n = kv_heads * d
    store_kv[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(0), n,
        BLOCK=pow2(n),
    )  # fmt: skip
    # partitions from the table's width, not the longest context: the same grid for any lengths
    width = block_table.shape[1] * block_size
    parts = min(MAX_PARTITIONS, -(-width // MIN_PARTITION))
    part = -(-width // parts)
    group = heads // kv_heads
    # at least 2 rows: Triton's ranges of one element have failed to compile in some versions
    g, bd = max(2, pow2(group)), pow2(d)
    acc = torch.empty(t, heads, parts, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(t, heads, parts, 2, dtype=torch.float32, device=q.device)
    attend_part[(t, kv_heads, parts)](
        q, k_cache, v_cache, block_table, q_pos, acc, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        block_size, part, window, d**-0.5,
        GROUP=group, G=g, D=d, BLOCK_D=bd, BLOCK_N=max(16, min(64, 8192 // (g * bd))), P=parts,
    )  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    merge[(t, heads)](
        acc, ml, out, out.stride(0), out.stride(1), heads, D=d, BLOCK_D=bd, P=parts,
        P_PAD=max(2, pow2(parts)),
    )  # fmt: skip
    return out
