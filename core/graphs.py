"""Step graphs: small steps (decode, draft verification, drafting) replayed as TorchScript traces.

A decoder layer is ~50 torch ops per step. Called from Python, each op costs a few microseconds
beyond its kernel; for a 135M model on a CPU that is as much time as the matmuls. torch.jit.trace
records the ops of one step once, and the recording then runs from C++ (GPU engines such as vLLM and
nano-vllm capture CUDA graphs per batch size for the same reason). A recording keeps no Python
branch: sizes are read from the inputs' shapes, so one trace serves any step that takes the same
branches, which are:
- every sequence computes the same number of tokens (no padding rows); the graph computes every
  token's logits and the runner keeps the rows it wants (a draft's catch-up wants one of two, a
  short prompt one of a few);
- at most MAX_GRAPH_TOKENS tokens: the layers that branch on their row count (pagechat's kernels
  up to quant/kernels.py's MAX_ROWS or more, bf16-wo's torch matmul up to this) take their few-rows
  side, which the trace records;
- which sliding windows need a mask this step, and whether every sequence computes one token (a
  fused decode attention's branch): the trace's key.
Everything else runs eagerly. torch.jit is deprecated in favour of torch.compile, but compiling this
model's decode step takes far longer than an interactive tool can wait at start-up, while a trace
takes well under a second.
"""

from __future__ import annotations

import sys
import warnings

import torch
from pagechat.core.attention import AttentionMetadata, build_metadata
from pagechat.core.blocks import BlockManager
from pagechat.core.model import DecoderModel

# a decode step of up to 16 sequences (eager beyond 8 before: 12 rows of the 135M shape, bf16, 26.4
# against 32.4 ms a step); no more than kernels.MAX_ROWS, where the kernel layers split
MAX_GRAPH_TOKENS = 16
# torch.jit warns that it may break on Python 3.14 and later
TRACE_SUPPORTED = sys.version_info < (3, 14)


def _step(model: DecoderModel, windows: tuple[int | None, ...], masked: tuple[int | None, ...]):
    """The traced function: ids, positions, pool and metadata tensors -> the logits of every row.

    A function, not a module: tracing it records the weights as constants (the same tensors, not
    copies), so a replay fetches no attribute of any submodule. A trace of the model as a module
    looks up ~5 attributes per weight on every replay; this one gives bit-equal logits, faster.
    """

    def step(ids, positions, pool, slot_mapping, gather, q_pos, *masks):
        masks_by_window = dict.fromkeys(windows) | dict(zip(masked, masks))
        meta = AttentionMetadata(slot_mapping, gather, q_pos, masks_by_window)
        return model.logits(model(ids, positions, pool, meta))

    return step


class StepGraphs:
    """The traces of one model, one per mask key: made on first use, or at load by
    ModelRunner.warm_up (the unmasked one always, the causal-mask one when a proposer will verify
    or draft)."""

    def __init__(self, model: DecoderModel, pool: torch.Tensor, blocks: BlockManager) -> None:
        self.model, self.pool, self.blocks = model, pool, blocks
        self.windows = tuple(dict.fromkeys(model.spec.sliding_windows))
        self.traces: dict[tuple, torch.jit.ScriptFunction] = {}

    def warm_up(self, count: int) -> None:
        """Trace a one-sequence step of `count` <= MAX_GRAPH_TOKENS tokens now (see
        ModelRunner.warm_up). It writes K/V into the pool's first slots, which no sequence holds
        yet."""
        table = list(range(self.blocks.blocks_needed(count)))
        meta = build_metadata([0], [count], [table], self.blocks.block_size, self.pool.device)
        positions = torch.arange(count, device=self.pool.device)
        self.run(torch.zeros_like(positions), positions, meta)

    @staticmethod
    def fits(num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step can run as a graph (see the module's docstring)."""
        return num_tokens <= MAX_GRAPH_TOKENS and meta.uniform

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """float32 logits [T, vocab] of every token; the step's K/V go into the pool as when
        eager."""
        masks = {w: m for w in self.windows if (m := meta.mask(w)) is not None}
        key = (meta.q_pos.shape[1] == 1, *masks)
        args = (
            ids,
            positions,
            self.pool,
            meta.slot_mapping,
            meta.gather,
            meta.q_pos,
            *masks.values(),
        )
        # the executor's optimising passes stall the first two calls and gained nothing measurable
        with torch.jit.optimized_execution(False):
            if key not in self.traces:
                # the deprecation notice, and tracer notes on baked-in Python ints
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.traces[key] = torch.jit.trace(
                        _step(self.model, self.windows, tuple(masks)), args, check_trace=False
                    )
            # after a trace this writes the step's K/V a second time, the same values
            return self.traces[key](*args)
