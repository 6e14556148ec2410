"""`pagechat bench-serve`: one level after another with a progress bar, then one table (or JSON)."""

from __future__ import annotations

import asyncio
import math
from functools import partial

from pagechat.core.errors import PagechatError
from pagechat.tools.bench_serve import (
    LevelReport,
    LoadSpec,
    as_json,
    events_status,
    run_level,
)
from pagechat.tools.http_client import model_card, server_url
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

ROWS = (  # (row label, LevelReport field holding percentiles in ms, percentiles shown)
    ("TTFT ms", "ttft_ms", ("p50", "p90", "p99")),
    ("ITL ms", "itl_ms", ("p50", "p90", "p99")),
    ("TPOT ms", "tpot_ms", ("p50", "p99")),
    ("end-to-end ms", "e2e_ms", ("p50", "p99")),
)


def bench_serve_command(
    spec: LoadSpec, levels: list[int], json_out: bool, watched: bool = False
) -> int:
    """Run every level against the server; returns the exit code (2 when requests failed).
    watched: each level twice, without and then with a watcher on /pagechat/events."""
    url = server_url(spec.url)
    model = spec.model or model_card(url, spec.api_key)["id"]
    spec = LoadSpec(**{**_fields(spec), "url": url, "model": model})
    if watched and (status := events_status(url, spec.api_key)) != 200:
        raise PagechatError(
            f"--watched needs a pagechat server: {url}/pagechat/events answered HTTP {status}"
        )
    console = Console(stderr=True)
    reports = []
    for level in levels:
        for watch in (False, True) if watched else (False,):
            columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            label = f"concurrency {level}{' watched' if watch else ''}"
            with Progress(label, *columns, console=console, transient=json_out) as bar:
                task = bar.add_task("requests", total=spec.requests)
                advance = partial(bar.advance, task)
                reports.append(asyncio.run(run_level(spec, level, advance, watch)))
    if json_out:
        print(as_json(reports, spec))
    else:
        Console().print(_table(reports, spec))
    failed = [r for r in reports if r.failed]
    for r in failed:
        message = f"{r.failed} request(s) failed at concurrency {r.concurrency}: {r.first_error}"
        console.print(f"error: {message}", markup=False, highlight=False)
    return 2 if failed else 0


def _fields(spec: LoadSpec) -> dict:
    return {name: getattr(spec, name) for name in LoadSpec.__slots__}


def _ms(d: dict[str, float], key: str) -> str:
    return f"{d[key]:.1f}" if key in d else "-"


def _table(reports: list[LevelReport], spec: LoadSpec) -> Table:
    """One column per concurrency level, one row per measure."""
    rate = "all at once" if spec.rate == math.inf else f"{spec.rate:g} req/s"
    table = Table(
        title=f"bench-serve {spec.url} ({spec.model}): {spec.requests} requests per level, "
        f"{spec.prompt_words}-word prompts, {spec.output_tokens} output tokens, {rate}"
    )
    table.add_column("concurrency")
    for r in reports:
        watched = "" if r.watched_bytes is None else " watched"
        table.add_column(f"{r.concurrency}{watched}", justify="right")
    table.add_row("completed / failed", *(f"{r.completed} / {r.failed}" for r in reports))
    table.add_row("output tok/s", *(f"{r.output_tok_s:.1f}" for r in reports))
    table.add_row("requests/s", *(f"{r.request_s:.2f}" for r in reports))
    for label, field, keys in ROWS:
        for key in keys:
            table.add_row(f"{label} {key}", *(_ms(getattr(r, field), key) for r in reports))
    if any(r.watched_bytes is not None for r in reports):
        read = (
            f"{r.watched_bytes / 1e6:.1f}" if r.watched_bytes is not None else "-" for r in reports
        )
        table.add_row("events read MB", *read)
    return table
