"""RunStats: totals over a run's StepReports (TTFT, prefill/decode speed, KV use), CLI and JSON."""

from __future__ import annotations

from collections import Counter

from pagechat.core.modelspec import dtype_name
from pagechat.core.report import SpecTotals, StepReport


class RunStats:
    """Sums step reports: decode speed over pure decode steps, prefill speed over prefill steps."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.prefill_tokens = self.decode_tokens = self.hit_tokens = self.preemptions = (
            self.steps
        ) = 0
        self.prefill_s = self.decode_s = self.wall_s = 0.0
        self.peak_blocks = 0
        self._spec: dict[int, SpecTotals] = {}  # each sequence's, from its newest DraftRecord
        self.block_events: Counter[str] = Counter()  # the allocator's events, by kind
        self.swaps: Counter[str] = Counter()  # swap copies: blocks and bytes out and in

    def add(self, r: StepReport) -> None:
        self.steps += 1
        self.wall_s += r.elapsed_s
        self.prefill_tokens += r.prefill_tokens
        self.hit_tokens += r.prefix_hit_tokens
        self.preemptions += len(r.preempted)
        self.peak_blocks = max(self.peak_blocks, r.blocks.num_used)
        self.block_events.update(e.kind for e in r.block_events)
        for s in r.swaps:
            self.swaps.update({f"blocks_{s.direction}": s.blocks, f"bytes_{s.direction}": s.bytes})
        for d in r.drafts:
            self._spec[d.seq_id] = d.totals
        if r.kind == "decode":
            self.decode_tokens += r.decode_tokens
            self.decode_s += r.elapsed_s
        elif r.kind in ("prefill", "mixed"):
            self.prefill_s += r.elapsed_s

    def ttft_ms(self) -> float:
        """Time to first token of the earliest request that produced one."""
        ttfts = [
            s.first_token_time - s.arrival
            for s in self.engine.requests.values()
            if s.first_token_time
        ]
        return 1000 * min(ttfts) if ttfts else 0.0

    def as_dict(self) -> dict:
        e = self.engine
        return {
            "ttft_ms": round(self.ttft_ms(), 3),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tok_s": round(self.prefill_tokens / self.prefill_s, 2)
            if self.prefill_s
            else 0.0,
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else 0.0,
            "kv_blocks_used": self.peak_blocks,
            "kv_blocks_total": e.blocks.num_blocks,
            "prefix_hit_tokens": self.hit_tokens,
            "preemptions": self.preemptions,
            "block_events": dict(sorted(self.block_events.items())),
            "swaps": dict(sorted(self.swaps.items())),
            "steps": self.steps,
            "wall_s": round(self.wall_s, 4),
            "dtype": dtype_name(e.dtype),
            "device": str(e.device),
            "graphs": e.graphs,
            "threads": e.threads,
            **self._spec_dict(),
        }

    @property
    def spec(self) -> SpecTotals:
        """Speculation over the run: the engine's per-sequence totals added up."""
        return sum(self._spec.values(), SpecTotals())

    def _spec_dict(self) -> dict:
        e, sp = self.engine, self.spec
        if e.proposer is None:
            return {}
        seqs = list(e.requests.values())
        outputs = sum(s.num_output_tokens for s in seqs)
        return {
            "proposer": e.proposer.name,
            "num_draft": e.num_draft,
            "drafted_tokens": sp.drafted,
            "accepted_tokens": sp.accepted,
            "acceptance_rate": round(sp.acceptance_rate or 0.0, 4),
            "mean_acceptance_length": round(sp.mean_acceptance_length or 0.0, 4),
            "per_position_acceptance": [
                round(sp.position_rate(i) or 0.0, 4) for i in range(len(sp.tried))
            ],
            "target_forwards_per_token": round(sum(s.target_forwards for s in seqs) / outputs, 4)
            if outputs
            else 0.0,
        }

    def line(self) -> str:
        d = self.as_dict()
        return (
            f"TTFT {d['ttft_ms']:.1f} ms | "
            f"prefill {d['prefill_tokens']} tok at {d['prefill_tok_s']:.1f} tok/s | "
            f"decode {d['decode_tokens']} tok at {d['decode_tok_s']:.1f} tok/s | "
            f"KV blocks {d['kv_blocks_used']}/{d['kv_blocks_total']} peak | "
            f"prefix-cache hits {d['prefix_hit_tokens']} tok | "
            f"{d['dtype']} on {d['device']}" + self._spec_line(d)
        )

    @staticmethod
    def _spec_line(d: dict) -> str:
        if "proposer" not in d:
            return ""
        return (
            f" | {d['proposer']} k={d['num_draft']}: "
            f"accepted {d['accepted_tokens']}/{d['drafted_tokens']} "
            f"({100 * d['acceptance_rate']:.0f}%), {d['mean_acceptance_length']:.2f} tok/verify, "
            f"{d['target_forwards_per_token']:.2f} target forwards/tok"
        )
