"""The KV pool: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim] for all seqs."""

from __future__ import annotations

import os

import torch
from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from pagechat.core.modelspec import ModelSpec

CPU_DEFAULT_KV_BYTES = 1 << 30  # at most 1 GiB on CPU, where the pool lives in ordinary RAM
CPU_DEFAULT_CONTEXTS = 8  # ...and no more than 8 full-context sequences need
CUDA_FREE_FRACTION = 0.8  # of the device memory still free after the weights are loaded


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem


def pool_blocks(
    spec: ModelSpec, cfg: EngineConfig, dtype: torch.dtype, device: torch.device, max_len: int
) -> int:
    """How many blocks the pool gets: --kv-blocks, else --kv-memory, else a default budget."""
    if cfg.kv_blocks is not None:
        return cfg.kv_blocks
    budget = cfg.kv_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * CUDA_FREE_FRACTION)
        else:
            full = (
                -(-max_len // cfg.block_size)
                * CPU_DEFAULT_CONTEXTS
                * block_bytes(spec, cfg.block_size, dtype)
            )
            budget = min(CPU_DEFAULT_KV_BYTES, full)
    n = budget // block_bytes(spec, cfg.block_size, dtype)
    if n < 1:
        raise PagechatError(
            f"--kv-memory {budget} B is smaller than one KV block "
            f"({block_bytes(spec, cfg.block_size, dtype)} B)"
        )
    return int(n)


def allocate_pool(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The zeroed KV pool tensor; PagechatError when it cannot fit in the device's memory."""
    shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    need = num_blocks * block_bytes(spec, block_size, dtype)
    have = _device_memory(device)
    if need > have:  # refused up front: a pool this large would overflow or be killed later
        raise PagechatError(
            f"a KV pool of {num_blocks} blocks ({need / 2**30:.3g} GiB) is more memory than "
            f"this machine has ({have / 2**30:.3g} GiB on {device.type}); "
            "lower --kv-blocks or --kv-memory"
        )
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise PagechatError(
            f"cannot allocate a KV pool of {num_blocks} blocks on {device}: "
            f"{str(e).splitlines()[0]}; lower --kv-blocks or --kv-memory"
        ) from None


def _device_memory(device: torch.device) -> int:
    """Total bytes of the device's memory (RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def copy_blocks(pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy every layer's K and V of block src into block dst."""
    if pairs:
        src = torch.tensor([s for s, _ in pairs], device=pool.device)
        dst = torch.tensor([d for _, d in pairs], device=pool.device)
        pool[:, :, dst] = pool[:, :, src]
