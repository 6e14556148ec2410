"""`pagechat bench-quant`: decode speed and weight memory of each weight mode on one model.

The modes: fp32 / bf16 / int8 / int8-wo / bf16-wo / AWQ. All engines are loaded first, then timed
in interleaved rounds (fp32, bf16, int8, ... , fp32, bf16, ...), so a machine that gets busier or
quieter during the run affects every mode alike; the median round counts.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagechat.core.errors import PagechatError

MODES = ("fp32", "bf16", "int8", "int8-wo", "bf16-wo", "awq")
_SETTINGS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("auto", "int8"),
    "int8-wo": ("auto", "int8-wo"),
    "bf16-wo": ("float32", "bf16-wo"),
    "awq": ("auto", "awq"),
}


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One mode's figures: median decode tok/s over the rounds, and the bytes its weights take."""

    mode: str
    dtype: str  # the model's activation dtype
    kernels: str  # the quantised layers' kernel paths
    decode_tok_s: float
    rounds: tuple[float, ...]
    weight_bytes: int
    linear_bytes: int  # decoder linears only (what quantisation changes)


def _decode_rate(engine, prompt: list[int], batch: int, new_tokens: int) -> float:
    from pagechat.core.params import SamplingParams

    tokens, seconds = 0, 0.0

    def on_report(r):
        nonlocal tokens, seconds
        if r.kind == "decode":
            tokens += r.decode_tokens
            seconds += r.elapsed_s

    engine.generate(
        [prompt] * batch,
        SamplingParams(max_tokens=new_tokens, ignore_eos=True),
        on_report=on_report,
    )
    return tokens / seconds if seconds else 0.0


def bench_quant(
    model_dir: Path,
    awq_dir: Path | None = None,
    modes: tuple[str, ...] = MODES,
    new_tokens: int = 64,
    prompt_tokens: int = 32,
    batch: int = 1,
    rounds: int = 3,
    device: str = "auto",
    threads: int | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> list[BenchRow]:
    """Load model_dir once per mode (AWQ from awq_dir, or a temp RTN checkpoint); time decoding."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.core.loader import read_spec
    from pagechat.core.memory import weight_report
    from pagechat.core.modelspec import dtype_name
    from pagechat.quant.checkpoint import quantize_checkpoint

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise PagechatError(f"--modes: unknown mode {bad[0]!r} (choose from {', '.join(MODES)})")
    spec = read_spec(Path(model_dir))
    if spec.quantization is not None:
        raise PagechatError(
            f"{model_dir} is already quantised; bench-quant takes the float checkpoint "
            "(and --awq-dir for its AWQ version)"
        )
    tmp = None
    if "awq" in modes and awq_dir is None:
        group = next(
            (
                g
                for g in (128, 64, 32)
                if spec.hidden_size % g == 0 and spec.intermediate_size % g == 0
            ),
            None,
        )
        if group is None:
            raise PagechatError(
                f"{model_dir}: no AWQ group size (128, 64, 32) divides its linears; "
                "drop awq from --modes"
            )
        tmp = tempfile.TemporaryDirectory(prefix="pagechat-bench-")
        log(
            f"making a 4-bit RTN checkpoint (g{group}) for the awq mode: "
            "same kernels and bytes as AWQ"
        )
        awq_dir = quantize_checkpoint(Path(model_dir), Path(tmp.name) / "awq", "rtn", group).out_dir
    prompt = [(7 + 13 * i) % spec.vocab_size for i in range(prompt_tokens)]
    blocks = batch * (math.ceil((prompt_tokens + new_tokens + 1) / 16) + 1)
    try:
        engines = {}
        for m in modes:
            dtype, quant = _SETTINGS[m]
            log(f"loading {m}")
            engines[m] = Engine(
                awq_dir if m == "awq" else model_dir,
                EngineConfig(
                    dtype=dtype, quant=quant, device=device, kv_blocks=blocks, threads=threads
                ),
            )
            # warm-up: first-call allocations, kernel packing caches
            _decode_rate(engines[m], prompt, batch, 4)
        rates: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            for m in modes:
                rates[m].append(_decode_rate(engines[m], prompt, batch, new_tokens))
            log(f"round {r + 1}/{rounds}: " + "  ".join(f"{m} {rates[m][-1]:.1f}" for m in modes))
        rows = []
        for m, e in engines.items():
            rep = weight_report(e.model)
            kernels = sorted({row.path for row in rep.rows if row.kind in ("attention", "mlp")})
            rows.append(
                BenchRow(
                    m,
                    dtype_name(e.dtype),
                    ",".join(kernels),
                    statistics.median(rates[m]),
                    tuple(rates[m]),
                    rep.total,
                    sum(row.bytes for row in rep.rows if row.kind in ("attention", "mlp")),
                )
            )
        return rows
    finally:
        if tmp is not None:
            tmp.cleanup()
