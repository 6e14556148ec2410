"""`pagechat bench-kv`: what sharing saves and what preemption costs, measured on one engine.

Sharing: the peak KV blocks of n samples (forked from one prompt, copy-on-write) and of a beam
search, against as many separate requests of the same prompt with the prefix cache off.
Preemption: for a sequence of L computed tokens, the time to copy its blocks to the host pool
and back (swap) against the time to compute its L tokens again (recompute)."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.kv import block_bytes
from pagechat.core.memory import read_memory
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import sync
from pagechat.core.swap import copy_between, host_pool


@dataclass(frozen=True, slots=True)
class SharingResult:
    """Peak blocks of one request decoding `ways` answers together vs `ways` separate ones."""

    mode: str  # "samples" | "beams"
    ways: int
    prompt_tokens: int
    new_tokens: int
    shared_blocks: int
    separate_blocks: int

    @property
    def ratio(self) -> float:
        return self.shared_blocks / self.separate_blocks


@dataclass(frozen=True, slots=True)
class PreemptCost:
    """Swap (out and back in) vs recompute of one sequence's computed tokens, medians in ms."""

    tokens: int
    blocks: int
    bytes: int
    swap_ms: float
    recompute_ms: float


def _peak(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> int:
    peak = [0]

    def watch(report):
        peak[0] = max(peak[0], report.blocks.num_used)

    engine.generate(prompts, params, on_report=watch)
    return peak[0]


def sharing(engine: Engine, prompt: list[int], mode: str, ways: int, new: int) -> SharingResult:
    """Peak blocks of n samples (or beams) of prompt vs `ways` separate copies of the request.
    The engine must have its prefix cache off, so separate requests really are separate."""
    one = dict(max_tokens=new, ignore_eos=True)
    if mode == "samples":
        shared = SamplingParams(temperature=1.0, seed=0, n=ways, **one)
    else:
        shared = SamplingParams(temperature=0.0, beam_width=ways, early_stopping=True, **one)
    separate = SamplingParams(temperature=1.0, seed=0, **one)
    return SharingResult(
        mode,
        ways,
        len(prompt),
        new,
        _peak(engine, [prompt], shared),
        _peak(engine, [prompt] * ways, separate),
    )


def preempt_cost(engine: Engine, tokens: int, rounds: int = 3) -> PreemptCost:
    """Median time of swapping a tokens-long sequence's blocks out and in, and of computing
    those tokens again as one prefill."""
    rng = random.Random(tokens)
    block_size = engine.config.block_size
    blocks = -(-tokens // block_size)
    host = host_pool(engine.pool, blocks)
    pairs = list(zip(range(blocks), range(blocks)))
    swap, recompute = [], []
    for _ in range(rounds):
        prompt = [rng.randrange(3, engine.spec.vocab_size) for _ in range(tokens)]
        t0 = time.perf_counter()
        copy_between(engine.pool, host, pairs)
        copy_between(host, engine.pool, pairs)
        sync(engine.device)
        swap.append(time.perf_counter() - t0)
        [seq] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        recompute.append(seq.first_token_time - seq.arrival)
    size = blocks * block_bytes(engine.spec, block_size, engine.kv_dtype)
    return PreemptCost(
        tokens,
        blocks,
        size,
        1000 * statistics.median(swap),
        1000 * statistics.median(recompute),
    )


def kv_engine(model_dir, config: EngineConfig, context: int) -> Engine:
    """The engine of the benchmark: the prefix cache off (separate means separate), a batch
    budget that prefills each measured context in one step."""
    config.prefix_cache = False
    config.max_batch_tokens = max(config.max_batch_tokens, context)
    return Engine(model_dir, config)


def churn_rss(engine: Engine, count: int, marks: int = 10) -> list[tuple[int, int]]:
    """(requests served, this process's RSS in bytes) at `marks` points while `count` short
    requests run one after another, each released when it ends: a long-running server's life."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    points = [(0, read_memory(engine.device).rss or 0)]
    for i in range(1, count + 1):
        prompt = [rng.randrange(3, engine.spec.vocab_size) for _ in range(8)]
        rid = engine.requests.add(prompt, params)
        while engine.has_unfinished():
            engine.step()
        engine.requests.release(rid)
        if i % max(1, count // marks) == 0:
            points.append((i, read_memory(engine.device).rss or 0))
    return points
