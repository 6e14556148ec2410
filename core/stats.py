"""RunStats: totals over a run's StepReports (TTFT, prefill and decode speed, KV use) for CLI lines and JSON."""

from __future__ import annotations

from pagechat.core.report import StepReport


class RunStats:
    """Accumulates step reports; decode speed counts pure decode steps, prefill speed the steps with prefill."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.prefill_tokens = self.decode_tokens = self.hit_tokens = self.preemptions = self.steps = 0
        self.prefill_s = self.decode_s = self.wall_s = 0.0
        self.peak_blocks = 0

    def add(self, r: StepReport) -> None:
        self.steps += 1
        self.wall_s += r.elapsed_s
        self.prefill_tokens += r.prefill_tokens
        self.hit_tokens += r.prefix_hit_tokens
        self.preemptions += len(r.preempted)
        self.peak_blocks = max(self.peak_blocks, r.blocks.num_used)
        if r.kind == "decode":
            self.decode_tokens += r.decode_tokens
            self.decode_s += r.elapsed_s
        elif r.kind in ("prefill", "mixed"):
            self.prefill_s += r.elapsed_s

    def ttft_ms(self) -> float:
        """Time to first token of the earliest request that produced one."""
        ttfts = [s.first_token_time - s.arrival for s in self.engine.requests.values() if s.first_token_time]
        return 1000 * min(ttfts) if ttfts else 0.0

    def as_dict(self) -> dict:
        e = self.engine
        return {
            "ttft_ms": round(self.ttft_ms(), 3),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tok_s": round(self.prefill_tokens / self.prefill_s, 2) if self.prefill_s else 0.0,
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else 0.0,
            "kv_blocks_used": self.peak_blocks,
            "kv_blocks_total": e.blocks.num_blocks,
            "prefix_hit_tokens": self.hit_tokens,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "wall_s": round(self.wall_s, 4),
            "dtype": str(e.dtype).removeprefix("torch."),
            "device": str(e.device),
            "attention_backend": e.attention_backend,
        }

    def line(self) -> str:
        d = self.as_dict()
        return (f"TTFT {d['ttft_ms']:.1f} ms | prefill {d['prefill_tokens']} tok at {d['prefill_tok_s']:.1f} tok/s | "
                f"decode {d['decode_tokens']} tok at {d['decode_tok_s']:.1f} tok/s | KV blocks {d['kv_blocks_used']}/"
                f"{d['kv_blocks_total']} peak | prefix-cache hits {d['prefix_hit_tokens']} tok | "
                f"{d['dtype']} on {d['device']}")
