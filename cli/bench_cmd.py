"""`pagechat bench`: run core.bench and print a rich table (or the JSON object)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.tools.bench import run_bench
from rich.console import Console
from rich.table import Table

REPEAT_PROMPT = (
    "Please repeat this passage exactly: The KV cache stores keys and values in blocks of sixteen "
    "tokens. Prefill computes the whole prompt at once; decode adds one token per step."
)

ROWS = [
    ("decode tok/s (64 tokens)", "decode_tok_s", "{:.1f}"),
    ("decode ms/token", "decode_ms", "{:.2f}"),
    ("prefill tok/s (128-token prompt)", "prefill_tok_s", "{:.0f}"),
    ("TTFT ms", "ttft_ms", "{:.1f}"),
    ("8 requests, output tok/s", "batch8_tok_s", "{:.1f}"),
    ("MBU (floor / measured decode)", "mbu", "{:.1%}"),
]


def bench_command(
    model_dir: Path,
    config: EngineConfig,
    rounds: int,
    vs_hf: bool,
    as_json: bool,
    spec_text: str | None = None,
) -> None:
    """Load the engine, run the benchmark, print the table or JSON."""
    err = Console(stderr=True)
    engine = Engine(model_dir, config)
    spec_prompt = None
    if engine.proposer is not None:
        spec_prompt = engine.requests.encode(
            spec_text or REPEAT_PROMPT, chat=bool(getattr(engine.tokenizer, "chat_template", None))
        )
    result = run_bench(
        engine,
        rounds=rounds,
        vs_hf=vs_hf,
        spec_prompt=spec_prompt,
        log=lambda s: err.print(f"[dim]{s}[/dim]"),
    )
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    p, t, r = result.pagechat, result.transformers, result.ratios
    table = Table(
        title=f"pagechat bench: {model_dir.name} ({p['dtype']}, {p['quant']}, {rounds} rounds, "
        "medians)"
    )
    table.add_column("figure")
    table.add_column("pagechat", justify="right")
    if t:
        table.add_column(f"transformers ({t['dtype']})", justify="right")
        table.add_column("ratio", justify="right")
    for label, key, fmt in ROWS:
        row = [label, fmt.format(p[key])]
        if t:
            row += [fmt.format(t[key]) + _other_dtype(t, key), f"{r[key]:.2f}x" if key in r else ""]
        table.add_row(*row)
    turns = " ".join(f"{x:.0f}" for x in p["turn_ttft_ms"])
    row = ["turn 1..8 TTFT ms", turns]
    if t:
        row += [
            " ".join(f"{x:.0f}" for x in t["turn_ttft_ms"]) + _other_dtype(t, "turn_ttft_ms"),
            f"turn 8: {r['turn_ttft_ms'][-1]:.2f}x",
        ]
    table.add_row(*row)
    table.add_row(
        "weights",
        f"{p['weight_bytes'] / 2**20:.1f} MiB",
        *([f"{t['weight_bytes'] / 2**20:.1f} MiB", ""] if t else []),
    )
    table.add_row("KV bytes per token", str(p["kv_bytes_per_token"]), *(["", ""] if t else []))
    step = p["step"]
    table.add_row(
        "decode step ms: matmul · attn · other · Python",
        f"{step['matmul_ms']:.2f} · {step['attention_ms']:.2f} · {step['other_ms']:.2f} · "
        f"{step['python_ms']:.2f}",
        *(["", ""] if t else []),
    )
    table.add_row(
        "bandwidth (measured), decode floor",
        f"{p['bandwidth_gb_s']:.1f} GB/s, {p['decode_floor_ms']:.2f} ms",
        *(["", ""] if t else []),
    )
    Console().print(table)
    if "speculation" in p:
        s = p["speculation"]
        plain, spec = s["plain"], s["spec"]
        Console().print(
            f"speculation ({s['proposer']}, k={s['num_draft']}): plain "
            f"{plain['decode_tok_s']:.1f} tok/s, speculative {spec['decode_tok_s']:.1f} tok/s = "
            f"{s['speedup']:.2f}x; acceptance {spec['acceptance_rate']:.0%}; target forwards per "
            f"token {plain['target_forwards_per_token']:.2f} -> "
            f"{spec['target_forwards_per_token']:.2f}"
        )
    sys.stdout.flush()


def _other_dtype(t: dict, key: str) -> str:
    """The mark after transformers' figure `key` where it was taken at its other dtype, the one
    better at it: " (bfloat16)", say; else nothing."""
    other = t["dtypes"].get(key, t["dtype"])
    return f" ({other})" if other != t["dtype"] else ""
