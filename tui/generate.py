"""`pagechat generate`: stream results in prompt order, then one stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
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
    pending: dict[int, list[str]] = {i: [] for i in ids}
    shown = 0  # results before this index are printed whole; ids[shown] streams live
    while engine.has_unfinished():
        report = engine.step()
        stats.add(report)
        for out in report.outputs:
            pending[out.request_id].append(out.text_delta)
        while not as_json and shown < len(ids):
            rid = ids[shown]
            sys.stdout.write("".join(pending[rid]))
            pending[rid].clear()
            if not engine.requests[rid].finished:
                break
            sys.stdout.write("\n")
            shown += 1
        sys.stdout.flush()
    seqs = [engine.requests[i] for i in ids]
    if as_json:
        results = [
            {
                "prompt_ids": s.token_ids[: s.num_prompt_tokens],
                "token_ids": s.output_ids,
                "text": s.text,
                "finish_reason": s.finish_reason,
                **({"error": s.error} if s.error else {}),
            }
            for s in seqs
        ]
        print(json.dumps({"results": results, "stats": stats.as_dict()}))
    else:
        print(stats.line(), file=sys.stderr)
    for i, s in enumerate(seqs):
        if s.error:
            print(f"error: prompt {i + 1}: {s.error}", file=sys.stderr)
    return 2 if any(s.error for s in seqs) else 0
