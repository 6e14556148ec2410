"""Quality through pagechat's engine: the perplexity of a text, its windows run whole through the
engine's ModelRunner (paged KV, the same kernels generation uses) reading the logits of every
position; the KV blocks are released after each window.
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
        logits = engine.runner.score(chunk)
        total += F.cross_entropy(
            logits[:-1], torch.tensor(chunk[1:], device=logits.device), reduction="sum"
        ).item()
        count += len(chunk) - 1
        n += 1
    if count == 0:
        raise PagechatError("the text has fewer than 2 tokens; nothing to score")
    return Perplexity(math.exp(total / count), total / count, count, n, time.perf_counter() - t0)
