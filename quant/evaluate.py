"""Quality checks through pagechat's engine: perplexity of a text, greedy agreement of two engines.

Both run whole windows through the engine's ModelRunner (paged KV, the same kernels generation uses)
and read the logits of every position; the KV blocks are released after each window.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagechat.core.errors import PagechatError


@dataclass(frozen=True, slots=True)
class Perplexity:
    """exp(mean next-token NLL) over `tokens` predicted tokens in non-overlapping windows."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    seconds: float


def window_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] at each position of ids: one prefill through the engine."""
    from pagechat.core.params import SamplingParams
    from pagechat.core.scheduler import ScheduledSeq
    from pagechat.core.sequence import Sequence

    if not engine.blocks.can_allocate(ids):
        raise PagechatError(
            f"a window of {len(ids)} tokens does not fit the KV pool; lower --seqlen"
        )
    seq = Sequence(
        -1, list(ids), len(ids), SamplingParams(), time.perf_counter()
    )  # outside the engine's request ids
    engine.blocks.allocate(
        seq.seq_id, seq.token_ids
    )  # never committed, so it never enters the prefix cache
    try:
        return engine.runner.run([ScheduledSeq(seq, 0, len(ids))], [len(ids)])
    finally:
        engine.blocks.free(seq.seq_id)


def perplexity(engine, ids: list[int], window: int | None = None) -> Perplexity:
    """Perplexity of ids in windows of `window` tokens (default: the engine's context, <= 2048)."""
    t0 = time.perf_counter()
    window = min(window or 2048, engine.max_model_len)
    if window < 2:
        raise PagechatError(f"--seqlen must be >= 2, got {window}")
    total, count, n = 0.0, 0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = window_logits(engine, chunk)
        total += F.cross_entropy(
            logits[:-1], torch.tensor(chunk[1:], device=logits.device), reduction="sum"
        ).item()
        count += len(chunk) - 1
        n += 1
    if count == 0:
        raise PagechatError("the text has fewer than 2 tokens; nothing to score")
    return Perplexity(math.exp(total / count), total / count, count, n, time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class Agreement:
    """How close a model's greedy decoding is to a reference's over the same prompts."""

    # teacher-forced: share of the reference's generated tokens the model also ranks first
    top1: float
    exact: float  # share of prompts whose free-running greedy output is identical
    prefix: float  # mean share of each output that matches before the first difference
    tokens: int


def greedy_agreement(ref, other, prompts: list[list[int]], max_tokens: int = 32) -> Agreement:
    """Greedy generations of ref and other on the same prompts, compared token by token."""
    from pagechat.core.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    a = [s.output_ids for s in ref.generate(prompts, params)]
    b = [s.output_ids for s in other.generate(prompts, params)]
    hits = total = 0
    prefix = []
    for p, ra, rb in zip(prompts, a, b):
        logits = window_logits(other, p + ra)[
            len(p) - 1 : -1
        ]  # other's prediction at each of ref's positions
        hits += int((logits.argmax(-1).cpu() == torch.tensor(ra)).sum())
        total += len(ra)
        same = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        prefix.append(same / max(1, len(ra)))
    return Agreement(
        hits / max(1, total),
        sum(x == y for x, y in zip(a, b)) / len(prompts),
        sum(prefix) / len(prefix),
        total,
    )
