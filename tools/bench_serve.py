"""`pagechat bench-serve`: load any OpenAI-compatible server with streamed completions and report
time to first token, inter-token latency, time per output token, end-to-end latency and
throughput, per concurrency level (as vLLM's serving benchmark measures them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import httpx
from pagechat.tools.http_client import bearer

WORDS = (
    "the block pool holds keys and values for every sequence while the scheduler picks which "
    "requests run each step and the sampler turns logits into tokens one at a time"
).split()
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What one benchmark run sends: how many requests, how fast, how long each is."""

    url: str
    model: str
    requests: int = 64
    rate: float = math.inf  # requests per second (Poisson arrivals); inf: all at once
    prompt_words: int = 128
    output_tokens: int = 64
    seed: int = 0
    api_key: str | None = None


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class LevelReport:
    """One concurrency level's results: counts, throughputs and latency percentiles in ms."""

    concurrency: int
    completed: int
    failed: int
    duration_s: float
    output_tok_s: float
    request_s: float
    total_tok_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    first_error: str = ""
    watched_bytes: int | None = None  # with a watcher on /pagechat/events: what it read


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 of values given in seconds, in milliseconds (empty: no keys)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": 1000 * statistics.fmean(ordered)}
    for p in PERCENTILES:
        k = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
        out[f"p{p}"] = 1000 * ordered[k]
    return out


def prompts(spec: LoadSpec, run: str) -> list[str]:
    """Distinct prompts of spec.prompt_words words each, seeded (so runs compare), and new for
    each `run` (a level, watched or not): the same prompts again were prefix-cache hits, so every
    level after the first measured a warm cache (a run starting at 16 streams on SmolLM2: TTFT p50
    1.85 s there, against 0.2 s after the levels 1 and 4)."""
    rng = random.Random(f"{spec.seed} {run}")
    return [
        f"{run}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(spec.prompt_words))
        for i in range(spec.requests)
    ]


async def _stream(client: httpx.AsyncClient, spec: LoadSpec, prompt: str) -> RequestResult:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res, first = RequestResult(ok=False), True
    start = last = time.perf_counter()
    async with client.stream(
        "POST", "/v1/completions", json=body, headers=bearer(spec.api_key)
    ) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                res.output_tokens = chunk["usage"]["completion_tokens"]
            # A chunk with a choice carries tokens, even when their text is empty (a special
            # token, or bytes that are not yet a whole character): count it, as vLLM's own
            # benchmark does; the last chunk (usage only) has no choice.
            if chunk.get("choices"):
                if first:
                    res.ttft, first = now - start, False
                else:
                    res.itl.append(now - last)
                last = now
    res.latency = time.perf_counter() - start
    res.ok = res.output_tokens > 0
    res.error = "" if res.ok else "the stream carried no usage (stream_options.include_usage)"
    return res


async def _one(client, spec, prompt, gate, done: Callable[[], None]) -> RequestResult:
    async with gate:
        try:
            return await _stream(client, spec, prompt)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
        finally:
            done()


async def run_level(
    spec: LoadSpec, concurrency: int, done: Callable[[], None] = lambda: None, watched=False
) -> LevelReport:
    """Send every prompt, at most `concurrency` in flight, arrivals at spec.rate; `watched`: with
    a watcher reading a pagechat server's /pagechat/events all the while (what watching costs)."""
    rng = random.Random(spec.seed + 1)
    gate = asyncio.Semaphore(concurrency)
    # a connection per request, as vLLM's benchmark opens one: llama-server (cpp-httplib) closes a
    # kept-alive connection after a few requests, and a request sent on it just then failed with
    # "Server disconnected without sending a response" (2 of 40 at one stream)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=spec.url, limits=limits, timeout=timeout) as client:
        read = [0]
        watcher = asyncio.create_task(_watch(client, spec, read)) if watched else None
        start = time.perf_counter()
        tasks = []
        for prompt in prompts(spec, f"{concurrency}{' watched' if watched else ''}"):
            tasks.append(asyncio.create_task(_one(client, spec, prompt, gate, done)))
            if spec.rate != math.inf:
                await asyncio.sleep(rng.expovariate(spec.rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    report = summarise(results, concurrency, duration)
    return replace(report, watched_bytes=read[0]) if watched else report


async def _watch(client: httpx.AsyncClient, spec: LoadSpec, read: list[int]) -> None:
    """Read the event stream as a watcher does, counting its bytes in read[0]."""
    async with client.stream("GET", "/pagechat/events", headers=bearer(spec.api_key)) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            read[0] += len(chunk)


def summarise(results: list[RequestResult], concurrency: int, duration: float) -> LevelReport:
    """The level's report from its requests (failed ones are counted, not timed)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in ok)
    return LevelReport(
        concurrency=concurrency,
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        output_tok_s=out_tokens / duration,
        request_s=len(ok) / duration,
        total_tok_s=all_tokens / duration,
        ttft_ms=percentiles([r.ttft for r in ok]),
        itl_ms=percentiles([gap for r in ok for gap in r.itl]),
        tpot_ms=percentiles([t for r in ok if (t := r.tpot) is not None]),
        e2e_ms=percentiles([r.latency for r in ok]),
        first_error=next((r.error for r in results if not r.ok), ""),
    )


def events_status(url: str, api_key: str | None) -> int:
    """The status a server answers GET /pagechat/events with (200: a pagechat server to watch)."""
    with httpx.stream("GET", f"{url}/pagechat/events", headers=bearer(api_key), timeout=10.0) as r:
        return r.status_code


def as_json(reports: list[LevelReport], spec: LoadSpec) -> str:
    load = {k: v for k, v in asdict(spec).items() if k != "api_key"}
    load["rate"] = None if spec.rate == math.inf else spec.rate
    return json.dumps({"load": load, "levels": [asdict(r) for r in reports]})
