"""Preemption by swapping: a host-memory pool that a preempted sequence's KV blocks wait in until
it resumes, instead of being recomputed. The scheduler plans which blocks go where (HostBlocks);
the engine copies them (copy_out, copy_in) and times each copy (SwapRecord)."""

from __future__ import annotations

from collections import deque

import torch


class HostBlocks:
    """The host pool's free list: which host blocks each swapped-out sequence holds."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.held: dict[int, list[int]] = {}  # seq id -> its host blocks, in table order

    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq_id: int, count: int) -> list[int]:
        """count host blocks for seq_id (the caller checked num_free)."""
        blocks = [self._free.popleft() for _ in range(count)]
        self.held[seq_id] = blocks
        return blocks

    def give_back(self, seq_id: int) -> list[int]:
        """The sequence's host blocks, returned to the free list."""
        blocks = self.held.pop(seq_id)
        self._free.extend(blocks)
        return blocks


def host_pool(device_pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A host tensor shaped like the device pool with num_blocks blocks (pinned beside a GPU, so
    copies run at full bus speed)."""
    shape = list(device_pool.shape)
    shape[2] = num_blocks
    pin = device_pool.device.type == "cuda"
    return torch.empty(shape, dtype=device_pool.dtype, pin_memory=pin)


def copy_between(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: list[tuple[int, int]]
) -> None:
    """Copy every layer's K and V of block src (in src_pool) into block dst (in dst_pool)."""
    if pairs:
        src = torch.tensor([s for s, _ in pairs], device=src_pool.device)
        dst = torch.tensor([d for _, d in pairs], device=dst_pool.device)
        dst_pool[:, :, dst] = src_pool[:, :, src].to(dst_pool.device)
