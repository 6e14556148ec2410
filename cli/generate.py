"""`pagechat generate`: stream results in prompt order, then one stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport
from pagechat.core.sequence import Sequence
from pagechat.core.stats import RunStats


def run_generate(
    model_dir: Path,
    prompts: list[str],
    params: SamplingParams,
    config: EngineConfig,
    *,
    chat: bool,
    system: str | None,
    as_json: bool,
) -> int:
    """Run the prompts as one batch; returns the exit code (2 when a request failed)."""
    engine = Engine(model_dir, config)
    ids = [engine.add_request(engine.encode(p, chat=chat, system=system), params) for p in prompts]
    stats = RunStats(engine)
    printer = None if as_json else _Printer(engine, ids)
    while engine.has_unfinished():
        report = engine.step()
        stats.add(report)
        if printer is not None:
            printer.add(report)
    seqs = [engine.requests[i] for i in ids]
    if as_json:
        results = [_result(engine, s) for s in seqs]
        print(json.dumps({"results": results, "stats": stats.as_dict()}))
    elif not all(s.error for s in seqs):  # when every prompt failed, the errors say it all
        print(stats.line(), file=sys.stderr)
    for i, s in enumerate(seqs):
        if s.error:
            print(f"error: prompt {i + 1}: {s.error}", file=sys.stderr)
    return 2 if any(s.error for s in seqs) else 0


def _result(engine: Engine, seq: Sequence) -> dict:
    """One prompt's JSON result: its tokens and text, and its samples (n > 1) or its beams, best
    first (beam search; the result's own tokens are the best beam's)."""
    params = seq.sampling.params
    result = {
        "prompt_ids": seq.token_ids[: seq.num_prompt_tokens],
        "token_ids": seq.output_ids,
        "text": seq.text,
        "finish_reason": seq.finish_reason,
    }
    if params.n > 1:
        result["samples"] = [
            {"token_ids": s.output_ids, "text": s.text, "finish_reason": s.finish_reason}
            for s in _samples(engine, seq)
        ]
    if params.beam_width > 1:
        result["beams"] = [
            {"token_ids": list(b.token_ids), "text": b.text, "score": b.score} for b in seq.beams
        ]
    if seq.error:
        result["error"] = seq.error
    return result


def _samples(engine: Engine, seq: Sequence) -> list[Sequence]:
    return [seq, *(engine.requests[c] for c in seq.children)]


class _Printer:
    """Stdout in prompt order. A prompt with one answer streams as it is generated; one with
    several samples or beams prints them, each under a header line, once all have ended."""

    def __init__(self, engine: Engine, ids: list[int]) -> None:
        self.engine, self.ids, self.shown = engine, ids, 0
        self.pending: dict[int, list[str]] = defaultdict(list)

    def add(self, report: StepReport) -> None:
        for out in report.outputs:
            self.pending[out.request_id].append(out.text_delta)
        while self.shown < len(self.ids):
            seq = self.engine.requests[self.ids[self.shown]]
            params = seq.sampling.params
            if params.n == 1 and params.beam_width == 1:
                sys.stdout.write("".join(self.pending.pop(seq.seq_id, ())))
                if not seq.finished:
                    break
                sys.stdout.write("\n")
            elif all(s.finished for s in _samples(self.engine, seq)):
                sys.stdout.write(
                    "".join(f"{head}\n{text}\n" for head, text in _answers(self.engine, seq))
                )
            else:
                break
            self.shown += 1
        sys.stdout.flush()


def _answers(engine: Engine, seq: Sequence) -> list[tuple[str, str]]:
    """(header, text) of each of a finished prompt's samples or beams."""
    if seq.beams:
        b = len(seq.beams)
        return [
            (f"[beam {k}/{b}, score {r.score:.4f}]", r.text) for k, r in enumerate(seq.beams, 1)
        ]
    samples = _samples(engine, seq)
    n = len(samples)
    return [(f"[sample {k}/{n}, {s.finish_reason}]", s.text) for k, s in enumerate(samples, 1)]
