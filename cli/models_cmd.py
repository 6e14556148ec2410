"""`pagechat models`: the models tools/models.py finds, one line each (or JSON)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from pagechat.core.memory import fmt_bytes


def _params(n: int) -> str:
    """A parameter count as model names say it: 135M, 1.5B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _short(name: str) -> str:
    """A path under the current directory as a relative one (./models/x.gguf)."""
    try:
        return f"./{Path(name).relative_to(Path.cwd())}"
    except ValueError:
        return name


def print_models(as_json: bool = False) -> int:
    """Print every model found under the current directory, in the Hugging Face cache and in
    Ollama's store, newest first; returns the exit code."""
    from pagechat.tools.models import FIT_CONTEXT, find_models, free_memory
    from rich.console import Console
    from rich.table import Table

    found, free = find_models(Path.cwd()), free_memory()
    if as_json:
        rows = [dict(asdict(m), fits=None if free is None else m.need_bytes <= free) for m in found]
        print(json.dumps({"free_bytes": free, "models": rows}))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe: a line a model
    if not found:
        console.print("no models found here, in the Hugging Face cache or in Ollama's store")
        return 0
    table = Table(box=None, title_justify="left")
    for col in ("model", "from", "arch", "params", "weights", "size", "fits"):
        right = col in ("params", "size")
        table.add_column(col, overflow="fold", justify="right" if right else "left")
    for m in found:
        if m.error:
            table.add_row(_short(m.name), m.source, "[red]cannot load[/]", "", m.error, "", "")
            continue
        fits = "" if free is None else "yes" if m.need_bytes <= free else "[red]no[/]"
        arch = m.arch.removesuffix("ForCausalLM").lower()
        size = fmt_bytes(m.weight_bytes)
        table.add_row(
            _short(m.name), m.source, arch, _params(m.params), m.quant or m.precision, size, fits
        )
    console.print(table)
    if free is not None:
        console.print(
            f"fits: the weights and one {FIT_CONTEXT}-token context's KV in the {fmt_bytes(free)} "
            "free now",
            style="dim",
        )
    return 0
