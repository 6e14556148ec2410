"""`pagechat bench-kv`: the sharing table and the preemption-cost table (or one JSON object)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from pagechat.core.memory import fmt_bytes
from pagechat.tools.bench_kv import churn_rss, kv_engine, preempt_cost, sharing
from rich.console import Console
from rich.table import Table


def bench_kv_command(
    model_dir: Path,
    config: EngineConfig,
    prompt_tokens: int,
    new_tokens: int,
    ways: tuple[int, int],
    contexts: list[int],
    rounds: int,
    churn: int,
    as_json: bool,
) -> None:
    """Measure sharing (n samples, beams) and preemption cost (swap vs recompute); print them."""
    longest = max([prompt_tokens + new_tokens, *contexts])
    engine = kv_engine(model_dir, config, longest)
    if longest > engine.max_model_len:
        raise PagechatError(
            f"the benchmark needs {longest} tokens of context, the model has "
            f"{engine.max_model_len}; lower --prompt-tokens, --new-tokens or --contexts"
        )
    rng = random.Random(0)
    prompt = [rng.randrange(3, engine.spec.vocab_size) for _ in range(prompt_tokens)]
    shares = [
        sharing(engine, prompt, "samples", ways[0], new_tokens),
        sharing(engine, prompt, "beams", ways[1], new_tokens),
    ]
    costs = [preempt_cost(engine, n, rounds) for n in contexts]
    rss = churn_rss(engine, churn) if churn else []
    if as_json:
        rows = [{**asdict(s), "ratio": round(s.ratio, 4)} for s in shares]
        churned = [{"requests": n, "rss_bytes": b} for n, b in rss]
        out = {"sharing": rows, "preemption": [asdict(c) for c in costs], "churn": churned}
        print(json.dumps(out))
        return
    Console().print(_sharing_table(shares, model_dir))
    Console().print(_cost_table(costs, engine))
    if rss:
        marks = ", ".join(f"{n}: {fmt_bytes(b)}" for n, b in rss)
        Console().print(f"RSS after n released requests (n: RSS): {marks}")


def _sharing_table(shares, model_dir: Path) -> Table:
    table = Table(title=f"KV blocks at peak, {model_dir.name} (prefix cache off)")
    for col in ("run", "shared", "separate requests", "shared / separate"):
        table.add_column(col, justify="right")
    for s in shares:
        table.add_row(
            f"{s.ways} {s.mode} of {s.prompt_tokens}+{s.new_tokens} tokens",
            str(s.shared_blocks),
            str(s.separate_blocks),
            f"{s.ratio:.2f}",
        )
    return table


def _cost_table(costs, engine) -> Table:
    table = Table(title=f"preemption cost per sequence ({engine.precision}, {engine.device})")
    for col in (
        "tokens",
        "blocks",
        "KV bytes",
        "swap out+in ms",
        "recompute ms",
        "swap / recompute",
    ):
        table.add_column(col, justify="right")
    for c in costs:
        table.add_row(
            str(c.tokens),
            str(c.blocks),
            fmt_bytes(c.bytes),
            f"{c.swap_ms:.2f}",
            f"{c.recompute_ms:.1f}",
            f"{c.swap_ms / c.recompute_ms:.3f}",
        )
    return table
