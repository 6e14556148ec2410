"""Decode steps on a GPU replayed as CUDA graphs, one per batch size (vLLM's and SGLang's design).

A small model's decode step is hundreds of kernels of a few microseconds each; launched one by one
from Python, the GPU waits on the launches. A CUDA graph records a step's kernels once and
replays them with one launch. A graph replays fixed shapes at fixed addresses, so each captured
batch size has its step recorded over static input buffers, which a step fills before replaying:
its tokens, positions, slots and block table, padded to the next captured size (padding rows
write no K/V: their slot is -1). Attention reads each context's length from q_pos and its blocks
from the table (core/paged_triton.py), so one graph serves every context length. Steps that
compute several tokens for a sequence (prefill chunks, verification) run eagerly.
"""

from __future__ import annotations

import torch
from pagechat.core.attention import AttentionMetadata
from pagechat.core.errors import PagechatError
from pagechat.core.model import DecoderModel

# the batch sizes captured up to --max-seqs (which is captured too): a step pads to the next one
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphs:
    """The decode step of one model over one KV pool, captured at load for each batch size."""

    def __init__(self, model: DecoderModel, pool: torch.Tensor, block_size: int, max_seqs: int):
        self.model, self.pool, self.block_size = model, pool, block_size
        self.sizes = sorted({s for s in CAPTURE_SIZES if s < max_seqs} | {max_seqs})
        most, device = self.sizes[-1], pool.device
        width = -(-model.cos.shape[0] // block_size)  # the blocks of the longest context
        self.ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.slots = torch.full((most,), -1, dtype=torch.long, device=device)
        self.q_pos = torch.zeros(most, 1, dtype=torch.long, device=device)
        self.table = torch.zeros(most, width, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step is a decode step of the paged kernel, of at most the largest size."""
        # no spans: every sequence computes one token
        return meta.block_table is not None and meta.spans is None and num_tokens <= self.sizes[-1]

    def _step(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            self.slots[:size],
            self.slots.new_empty(0),  # no gather: the block table is read instead
            self.q_pos[:size],
            block_table=self.table[:size],
            block_size=self.block_size,
        )
        hidden = self.model(self.ids[:size], self.positions[:size], self.pool, meta)
        return self.model.logits(hidden)

    def warm_up(self, count: int) -> None:
        """Capture every size at the first call for a decode step (count 1); other steps (count >
        1: verification, a draft's catch-up) run eagerly."""
        if count == 1 and not self.graphs:
            try:
                self._capture()
            except RuntimeError as e:
                raise PagechatError(
                    f"capturing the decode step as a CUDA graph failed ({e}); --eager runs "
                    "without graphs"
                ) from e

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record every size's step, largest first, in one memory pool (a smaller step's
        activations fit in the larger's). Padding rows only: nothing is written to the pool."""
        handle = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            # a first eager run compiles the Triton kernels and sets up cuBLAS outside the capture
            stream = torch.cuda.Stream(self.pool.device)
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(stream):
                self._step(size)
            torch.cuda.current_stream(self.pool.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=handle):
                self.logits[size] = self._step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.pool.device)

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """float32 logits [B, vocab] of a decode step that fits, its K/V written into the pool."""
        b = ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.slots[b:size].fill_(-1)
        self.q_pos[:b].copy_(meta.q_pos)
        self.q_pos[b:size].zero_()
        self.table[:b, : meta.block_table.shape[1]].copy_(meta.block_table)
        self.graphs[size].replay()
        # a copy: the next replay overwrites the graph's output
        return self.logits[size][:b].clone()
