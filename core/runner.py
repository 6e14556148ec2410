"""ModelRunner: a scheduled batch -> one flat ragged forward pass -> the logits that sample."""

from __future__ import annotations

import torch
from pagechat.core import paged_triton
from pagechat.core.attention import build_metadata
from pagechat.core.blocks import BlockManager
from pagechat.core.cuda_graphs import CudaGraphs
from pagechat.core.errors import PagechatError
from pagechat.core.graphs import StepGraphs
from pagechat.core.model import DecoderModel
from pagechat.core.params import SamplingParams
from pagechat.core.scheduler import ScheduledSeq
from pagechat.core.sequence import SamplingState, Sequence


class ModelRunner:
    """Runs the model over the KV pool for scheduled chunks: eagerly, or as a fitting step graph."""

    def __init__(
        self,
        model: DecoderModel,
        pool: torch.Tensor,
        blocks: BlockManager,
        device: torch.device,
        graphs: bool,
        max_seqs: int,
    ) -> None:
        """graphs: decode steps (and on a CPU other small steps) as graphs: on a GPU with the
        paged kernel, CUDA graphs of up to max_seqs sequences (core/cuda_graphs.py), else traces
        (core/graphs.py)."""
        self.model, self.pool, self.blocks, self.device = model, pool, blocks, device
        # decode rows read the pool through block tables (core/paged_triton.py) on a GPU
        self.paged = paged_triton.runs_on(device)
        self.graphs: StepGraphs | CudaGraphs | None = None
        if graphs and self.paged:
            self.graphs = CudaGraphs(model, pool, blocks.block_size, max_seqs)
        elif graphs:
            self.graphs = StepGraphs(model, pool, blocks)
        self.warm_up(1)

    @torch.inference_mode()
    def warm_up(self, count: int) -> None:
        """Make the graphs of `count`-token steps now, while the model loads, not in the first
        reply (as GPU engines capture theirs at start-up): 1 token is a decode step; more take the
        causal-mask trace that verification and a draft's catch-up use. Without graphs, a no-op."""
        if self.graphs is not None:
            self.graphs.warm_up(count)

    def score(self, ids: list[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab] at each position of ids: one prefill outside the
        scheduler (perplexity), its blocks never committed, so never in the prefix cache."""
        if not self.blocks.can_allocate(ids):
            raise PagechatError(
                f"a window of {len(ids)} tokens does not fit the KV pool; lower --seqlen"
            )
        seq = Sequence(-1, list(ids), len(ids), SamplingState(SamplingParams()), 0.0)  # id: none
        self.blocks.allocate(seq.seq_id, seq.token_ids)  # of the engine's
        try:
            return self.run([ScheduledSeq(seq, 0, len(ids))], [len(ids)])
        finally:
            self.blocks.free(seq.seq_id)

    @torch.inference_mode()
    def run(self, items: list[ScheduledSeq], logits_per_item: list[int]) -> torch.Tensor:
        """Compute every item's chunk (+ its draft tokens); return float32 logits for the last
        logits_per_item[i] tokens of each item."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for it, n in zip(items, logits_per_item):
            ids += it.seq.token_ids[it.start : it.start + it.count] + it.draft
            positions += range(it.start, it.start + it.count + len(it.draft))
            rows += range(len(ids) - n, len(ids))
        meta = build_metadata(
            [it.start for it in items],
            [it.count + len(it.draft) for it in items],
            [self.blocks.table(it.seq.seq_id) for it in items],
            self.blocks.block_size,
            self.device,
            self.paged,
        )
        ids_t, positions_t = (
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
        )
        if self.graphs is not None and self.graphs.fits(len(ids), meta):
            logits = self.graphs.run(ids_t, positions_t, meta)
            return logits if len(rows) == len(ids) else logits[self._index(rows)]
        hidden = self.model(ids_t, positions_t, self.pool, meta)
        if not rows:
            return hidden.new_empty((0, self.model.spec.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[self._index(rows)])

    def _index(self, rows: list[int]) -> torch.Tensor:
        """Row indices as a tensor; long even when empty (a prefill chunk that ends no prompt)."""
        return torch.tensor(rows, dtype=torch.long, device=self.device)
