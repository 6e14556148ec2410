"""`pagechat bench-grammar`: what a JSON-schema constraint costs. Decode tok/s of the same chat
prompt unconstrained and constrained to a schema, at 1 stream and at N, rounds interleaved (the two
sides alternate, so a machine that gets busier moves both alike: quote the ratios); and the time
the grammar's masks took per step, from the engine's own StepReports."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

from pagechat.core.engine import Engine
from pagechat.core.params import Constraint, SamplingParams
from pagechat.core.report import StepReport

PROMPT = "Write a JSON object describing a book: its title, author, year and a long summary."
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "summary": {"type": "string"},
    },
    "required": ["title", "author", "year", "summary"],
    "additionalProperties": False,
}


def _decode(engine: Engine, ids: list[int], params: list[SamplingParams]) -> tuple[float, float]:
    """(decode tok/s over the run's decode steps, mean mask seconds per decode step)."""
    steps: list[StepReport] = []
    engine.generate([ids] * len(params), params, steps.append)
    decode = [r for r in steps if r.kind == "decode"]
    seconds = sum(r.elapsed_s for r in decode)
    tokens = sum(r.decode_tokens for r in decode)
    masks = [r.grammar_s for r in decode]
    return tokens / seconds if seconds else 0.0, statistics.fmean(masks) if masks else 0.0


def grammar_cost(engine: Engine, streams: list[int], rounds: int, max_tokens: int) -> list[dict]:
    """Per stream count: the median decode tok/s without and with the schema, their ratio, and
    the median mask time per decode step."""
    ids = engine.requests.encode(PROMPT, chat=bool(engine.tokenizer.chat_template))
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    out = []
    for n in streams:
        plain = [
            SamplingParams(temperature=0.8, seed=k, max_tokens=max_tokens, num_candidates=0)
            for k in range(n)
        ]
        constrained = [replace(p, constraint=schema) for p in plain]
        _decode(engine, ids, constrained)  # warm: the tokenizer's grammar view is built once
        free, held, masks = [], [], []
        for _ in range(rounds):
            free.append(_decode(engine, ids, plain)[0])
            tok_s, mask_s = _decode(engine, ids, constrained)
            held.append(tok_s)
            masks.append(mask_s)
        a, b = statistics.median(free), statistics.median(held)
        out.append(
            {
                "streams": n,
                "tok_s": round(a, 1),
                "tok_s_constrained": round(b, 1),
                "ratio": round(b / a, 3) if a else 0.0,
                "mask_ms_per_step": round(1000 * statistics.median(masks), 3),
            }
        )
    return out
