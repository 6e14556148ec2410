"""`pagechat generate`: stream results in prompt order, then one stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.grammar import constraint_file, grammar_of
from pagechat.core.params import Constraint, SamplingParams
from pagechat.core.report import StepReport
from pagechat.core.sequence import Sequence
from pagechat.core.stats import RunStats


def constraint_from(
    json_schema: Path | None, regex: str | None, choice: str | None, grammar: Path | None
) -> Constraint | None:
    """The one constraint the flags ask for, checked before any model loads."""
    given = {
        "--json-schema": json_schema,
        "--regex": regex,
        "--choice": choice,
        "--grammar": grammar,
    }
    given = {flag: value for flag, value in given.items() if value is not None}
    if len(given) > 1:
        raise PagechatError(f"give one constraint, not {' and '.join(given)}")
    if not given:
        return None
    if json_schema is not None or grammar is not None:
        return constraint_file(json_schema or grammar, "json_schema" if json_schema else "grammar")
    if regex is not None:
        constraint = Constraint("regex", regex)
    else:
        constraint = Constraint("choice", json.dumps([c for c in choice.split(",") if c]))
    grammar_of(constraint)
    return constraint


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
    ids = [engine.requests.encode(p, chat=chat, system=system) for p in prompts]
    stats = RunStats(engine)
    streams = params.n == 1 and params.beam_width == 1
    printer = _Stream() if streams and not as_json else None

    def on_report(report: StepReport) -> None:
        stats.add(report)
        if printer is not None:
            printer.add(report)

    answers: list[list[Sequence]] = []  # per prompt: its sequence, then the samples forked from it
    for seq in engine.generate(ids, params, on_report):
        if seq.parent is None:
            answers.append([])
        answers[-1].append(seq)
    if as_json:
        results = [_result(samples) for samples in answers]
        print(json.dumps({"results": results, "stats": stats.as_dict()}))
    elif not streams:
        for samples in answers:
            sys.stdout.write("".join(f"{head}\n{text}\n" for head, text in _answers(samples)))
    roots = [samples[0] for samples in answers]
    if not as_json and not all(s.error for s in roots):  # every prompt failed: the errors say it
        print(stats.line(), file=sys.stderr)
    for i, s in enumerate(roots):
        if s.error:
            print(f"error: prompt {i + 1}: {s.error}", file=sys.stderr)
    return 2 if any(s.error for s in roots) else 0


def _result(samples: list[Sequence]) -> dict:
    """One prompt's JSON result: its tokens and text, and its samples (n > 1) or its beams, best
    first (beam search; the result's own tokens are the best beam's)."""
    seq = samples[0]
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
            for s in samples
        ]
    if params.beam_width > 1:
        result["beams"] = [
            {"token_ids": list(b.token_ids), "text": b.text, "score": b.score} for b in seq.beams
        ]
    if seq.error:
        result["error"] = seq.error
    return result


class _Stream:
    """Stdout in prompt order, each prompt's one answer streamed as it is generated."""

    def __init__(self) -> None:
        self.order: list[int] | None = None  # the requests, in the order they were added
        self.shown = 0
        self.pending: dict[int, list[str]] = defaultdict(list)
        self.ended: set[int] = set()

    def add(self, report: StepReport) -> None:
        if self.order is None:  # the first step lists every request; ids count up as added
            self.order = sorted(r.seq_id for r in report.seqs)
        for out in report.outputs:
            self.pending[out.request_id].append(out.text_delta)
            if out.finished:
                self.ended.add(out.request_id)
        while self.shown < len(self.order):
            rid = self.order[self.shown]
            sys.stdout.write("".join(self.pending.pop(rid, ())))
            if rid not in self.ended:
                break
            sys.stdout.write("\n")
            self.shown += 1
        sys.stdout.flush()


def _answers(samples: list[Sequence]) -> list[tuple[str, str]]:
    """(header, text) of each of a finished prompt's samples or beams."""
    seq = samples[0]
    if seq.beams:
        b = len(seq.beams)
        return [
            (f"[beam {k}/{b}, score {r.score:.4f}]", r.text) for k, r in enumerate(seq.beams, 1)
        ]
    n = len(samples)
    return [(f"[sample {k}/{n}, {s.finish_reason}]", s.text) for k, s in enumerate(samples, 1)]
