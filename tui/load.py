"""Background load: extra requests from a built-in prompt set, started at a steady rate by the
engine's loop, so that a user watches batching, chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import math

from pagechat.core.params import SamplingParams

# Questions the demo model was taught (tools/demo/corpus.py); each comes back several times in a
# run, so full blocks of a repeated prompt are prefix-cache hits.
PROMPTS = (
    "What is a KV block?",
    "Explain the KV cache.",
    "What is the prefix cache?",
    "Tell me about pagechat.",
    "What is 7 plus 5?",
    "Describe the block size briefly.",
    "What is a block table?",
    "Repeat after me: the pool is full of blocks.",
    "What can you do?",
    "Is 12 bigger than 9?",
    "Count from 3 to 9.",
    "What is preemption?",
)
LOAD_MAX_TOKENS = 64


def load_params(k: int, max_tokens: int = LOAD_MAX_TOKENS) -> SamplingParams:
    """The settings of the k-th load request: sampled, on a seed of its own."""
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=k)


def load_prompt(k: int) -> list[dict]:
    """The conversation of the k-th load request."""
    return [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]


class LoadPlan:
    """`count` requests at `rate` a second from `start`: which are due, and when the next is."""

    def __init__(self, count: int, rate: float, start: float) -> None:
        self.count, self.rate, self.start = count, rate, start
        self.started = 0

    def due(self, now: float) -> range:
        """The numbers of the requests to start now (each at most once)."""
        upto = min(self.count, math.floor((now - self.start) * self.rate) + 1)
        first, self.started = self.started, max(self.started, upto)
        return range(first, self.started)

    @property
    def left(self) -> int:
        return self.count - self.started

    def wait(self, now: float) -> float:
        """Seconds until the next request is due."""
        return max(0.0, self.start + self.started / self.rate - now)
