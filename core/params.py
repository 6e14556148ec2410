"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagechat.core.errors import PagechatError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_candidates: int = 8  # top-N candidates recorded per sampled token
    n: int = 1  # samples per prompt: forks sharing the prompt's KV blocks (copy-on-write)

    def validate(self) -> SamplingParams:
        """Raise PagechatError naming the first out-of-range field; return self when all are
        valid."""
        checks = [
            ("temperature", self.temperature, "must be >= 0", self.temperature >= 0),
            ("top-p", self.top_p, "must be in (0, 1]", 0 < self.top_p <= 1),
            ("top-k", self.top_k, "must be >= 0 (0 = off)", self.top_k >= 0),
            ("min-p", self.min_p, "must be in [0, 1]", 0 <= self.min_p <= 1),
            (
                "repetition-penalty",
                self.repetition_penalty,
                "must be > 0",
                self.repetition_penalty > 0,
            ),
            ("max-tokens", self.max_tokens, "must be >= 1", self.max_tokens >= 1),
            ("num-candidates", self.num_candidates, "must be >= 0", self.num_candidates >= 0),
            ("n", self.n, "must be >= 1", self.n >= 1),
        ]
        for name, value, rule, ok in checks:
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise PagechatError(f"{name} {rule}, got {value}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
