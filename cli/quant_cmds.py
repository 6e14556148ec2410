"""Bodies of the quantisation commands: quantize, eval, plan, bench-quant (cli.py holds their
typer wrappers)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from pagechat.core.errors import PagechatError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

out = Console(highlight=False, markup=False, soft_wrap=True)
if not out.is_terminal:
    out.width = 160  # rich's default of 80 columns squeezes the tables in a log or a pipe
err = Console(stderr=True, highlight=False, markup=False)

if TYPE_CHECKING:
    from pagechat.core.config import EngineConfig


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PagechatError(f"cannot read {what} {path}: {e}") from None


def quantize_command(
    model_dir: Path,
    out_dir: Path,
    method: str,
    group_size: int,
    calib: Path | None,
    samples: int,
    seqlen: int,
    threads: int | None = None,
) -> None:
    """Quantise a float checkpoint to an AutoAWQ GEMM checkpoint, with a progress bar per
    decoder block."""
    from pagechat.core.threads import apply_threads, check_threads
    from pagechat.quant.checkpoint import check_request, quantize_checkpoint
    from pagechat.tools.demo.corpus import calibration_texts

    check_threads(threads)
    check_request(
        model_dir, out_dir, method, group_size, samples, seqlen
    )  # fail before the progress bar shows
    apply_threads(threads)  # the calibration forwards run the engine's torch ops
    texts = [_read_text(calib, "--calib file")] if calib else calibration_texts()
    cols = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("blocks"),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=err, transient=False) as bar:
        task = bar.add_task(f"{method} g{group_size}", total=None)

        def progress(i: int, n: int, stage: str) -> None:
            bar.update(task, total=n, completed=i, description=f"{method} g{group_size}: {stage}")
            if not err.is_terminal:  # a log file gets one line per block instead of a live bar
                err.print(f"{method} g{group_size}: block {i}/{n} {stage}")

        res = quantize_checkpoint(
            model_dir, out_dir, method, group_size, texts, samples, seqlen, progress
        )
    calib_note = (
        f", calibrated on {res.calib_shape[0]} x {res.calib_shape[1]} tokens"
        if res.calib_shape
        else ""
    )
    out.print(
        f"wrote {method} 4-bit g{group_size} AutoAWQ GEMM checkpoint to {res.out_dir} "
        f"in {res.seconds:.1f}s{calib_note}"
    )
    if res.alphas:
        groups = sorted({g for a in res.alphas for g in a})
        out.print(
            "AWQ alpha per block: "
            + "; ".join(
                f"{i}: " + " ".join(f"{g}={a[g]:.2f}" for g in groups if g in a)
                for i, a in enumerate(res.alphas)
            )
        )


def eval_command(model_dir: Path, text: Path, config: EngineConfig, seqlen: int | None) -> None:
    """Perplexity of a text file through pagechat's engine; with a quantised LM head, also with a
    float one, and the difference the head makes."""
    from dataclasses import replace

    from pagechat.core.engine import Engine
    from pagechat.quant.evaluate import perplexity
    from pagechat.quant.head import head_format

    config = replace(config, prefix_cache=False)
    body = _read_text(text, "--text file")
    engine = Engine(model_dir, config)
    ids = engine.tokenizer(
        body, add_special_tokens=False, verbose=False
    ).input_ids  # long texts are windowed
    res = _print_perplexity(engine, perplexity(engine, ids, seqlen))
    fmt = head_format(config.lm_head, engine.quant.mode, engine.dtype)
    if fmt not in ("int8", "int4"):
        return
    tied = " (and the tied embedding)" if engine.spec.tie_word_embeddings else ""
    del engine  # one model in memory at a time
    float_head = Engine(model_dir, replace(config, lm_head="float"))
    ref = _print_perplexity(float_head, perplexity(float_head, ids, seqlen))
    out.print(
        f"the {fmt} lm_head{tied} vs a float one: perplexity {res.ppl - ref.ppl:+.4f} "
        f"({100 * (res.ppl / ref.ppl - 1):+.2f}%), mean NLL {res.nll - ref.nll:+.4f}"
    )


def _print_perplexity(engine, res):
    """Print one eval line (the perplexity and what produced it); return res."""
    from pagechat.core.memory import fmt_bytes, weight_report
    from pagechat.core.modelspec import dtype_name

    rep = weight_report(engine.model)
    kernels = ",".join(sorted({r.path for r in rep.rows if r.kind in ("attention", "mlp")}))
    dt = dtype_name(engine.dtype)
    out.print(
        f"perplexity {res.ppl:.4f} (mean NLL {res.nll:.4f}) over {res.tokens} tokens in "
        f"{res.windows} window(s) | quant {engine.quant.mode or 'none'} ({kernels}) | "
        f"lm_head {rep.head_label} | {dt} on {engine.device} | "
        f"weights {fmt_bytes(rep.total)} | {res.seconds:.1f}s"
    )
    return res


def plan_command(
    model_dir: Path,
    quant: str | None,
    lm_head: str,
    gpu_memory: str,
    context: int | None,
    dtype: str,
    block_size: int,
    group_size: int,
) -> None:
    """vLLM-style capacity lines for a budget, from config.json alone."""
    from pagechat.core.config import check_dtype, parse_bytes
    from pagechat.core.gguf import GGUFFile
    from pagechat.core.loader import read_spec
    from pagechat.core.memory import fmt_bytes
    from pagechat.core.modelspec import DTYPES
    from pagechat.core.sources import gguf_file
    from pagechat.quant.head import HEAD_LABELS, check_lm_head, head_format
    from pagechat.quant.loaders import MODE_LABELS, resolve_quant
    from pagechat.tools.planner import estimate_gguf_weights, estimate_weights, plan_capacity

    check_dtype(dtype)
    spec = read_spec(model_dir)
    hypothetical = (
        quant == "awq" and spec.quantization is None
    )  # planning a `pagechat quantize` first
    if hypothetical:  # resolve_quant checks it otherwise
        check_lm_head(lm_head, spec, f"{model_dir}/config.json")
    plan = None if hypothetical else resolve_quant(spec, quant, model_dir, lm_head)
    mode = "awq" if hypothetical else plan.mode
    group = group_size if hypothetical else (plan.group_size or group_size)
    if (
        dtype == "auto"
    ):  # what the engine picks on CUDA: the checkpoint's dtype (fp16 for AWQ / bnb checkpoints);
        # bf16-wo exists for float32 models
        name = (
            "float16"
            if hypothetical
            else "float32"
            if mode == "bf16-wo"
            else (spec.torch_dtype or "bfloat16")
        )
        dtype = name if name in DTYPES else "bfloat16"
    if block_size < 1:
        raise PagechatError(f"--block-size must be >= 1, got {block_size}")
    ctx = context or spec.max_position_embeddings
    if not 1 <= ctx <= spec.max_position_embeddings:
        raise PagechatError(
            f"--context {ctx} must be between 1 and the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    if mode == "gguf":
        with GGUFFile(gguf_file(model_dir)) as f:
            weights = estimate_gguf_weights(f, DTYPES[dtype], "cuda", lm_head)
    else:
        weights = estimate_weights(spec, mode, DTYPES[dtype], group, "cuda", lm_head)
    cap = plan_capacity(spec, weights, DTYPES[dtype], parse_bytes(gpu_memory), ctx, block_size)
    table = Table(
        title=f"{spec.arch}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads ({spec.num_kv_heads} KV), vocab {spec.vocab_size}"
    )
    for c in ("kind", "format", "kernel", "params", "bytes"):
        table.add_column(c, justify="right" if c in ("params", "bytes") else "left")
    for r in weights.rows:
        table.add_row(r.kind, r.fmt, r.path, f"{r.params:,}", fmt_bytes(r.bytes))
    table.add_row(
        "total", "", "", f"{sum(r.params for r in weights.rows):,}", fmt_bytes(weights.total)
    )
    out.print(table)
    out.print(
        f"quantisation: {MODE_LABELS[mode]}{' (after pagechat quantize)' if hypothetical else ''}; "
        f"lm_head {HEAD_LABELS[head_format(lm_head, mode, DTYPES[dtype])]} "
        f"({weights.head_label}); activations and KV in {dtype}"
    )
    out.print(
        f"KV cache: {fmt_bytes(cap.kv_per_token)} per token, {fmt_bytes(cap.kv_per_block)} per "
        f"block of {block_size} tokens"
    )
    out.print(
        f"budget {fmt_bytes(cap.budget)}: weights {fmt_bytes(weights.total)}, KV pool "
        f"{fmt_bytes(cap.kv_budget)} (80% of what is left after the weights, as the engine "
        "sizes it on CUDA)"
    )
    if weights.total > cap.budget:
        out.print(f"does not fit: the weights alone need {fmt_bytes(weights.total)}")
        return
    out.print(f"# KV blocks: {cap.num_blocks:,} ({cap.num_blocks * block_size:,} tokens)")
    out.print(
        f"Maximum concurrency for {ctx:,} tokens per request: {cap.concurrency:.2f}x "
        f"({cap.max_seqs:,} sequences of {math.ceil(ctx / block_size)} blocks at once)"
    )


def bench_quant_command(
    model_dir: Path,
    awq_dir: Path | None,
    modes: str,
    tokens: int,
    prompt_tokens: int,
    batch: int,
    rounds: int,
    device: str,
    threads: int | None = None,
) -> None:
    """Decode tok/s and weight memory per mode, measured in interleaved rounds."""
    from pagechat.core.memory import fmt_bytes
    from pagechat.core.threads import check_threads
    from pagechat.tools.bench_quant import bench_quant

    for name, v in (
        ("--tokens", tokens),
        ("--prompt-tokens", prompt_tokens),
        ("--batch", batch),
        ("--rounds", rounds),
    ):
        if v < 1:
            raise PagechatError(f"{name} must be >= 1, got {v}")
    check_threads(threads)
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    rows = bench_quant(
        model_dir,
        awq_dir,
        chosen,
        tokens,
        prompt_tokens,
        batch,
        rounds,
        device,
        threads,
        log=lambda s: err.print(s),
    )
    base = rows[0]
    table = Table(
        title=f"decode, batch {batch}, {tokens} new tokens, median of {rounds} interleaved rounds"
    )
    for c in (
        "mode",
        "activations",
        "kernel",
        "decode tok/s",
        f"vs {base.mode}",
        "weights",
        "decoder linears",
    ):
        table.add_column(c, justify="left" if c in ("mode", "activations", "kernel") else "right")
    for r in rows:
        table.add_row(
            r.mode,
            r.dtype,
            r.kernels,
            f"{r.decode_tok_s:.1f}",
            f"{r.decode_tok_s / base.decode_tok_s:.2f}x",
            fmt_bytes(r.weight_bytes),
            fmt_bytes(r.linear_bytes),
        )
    out.print(table)
