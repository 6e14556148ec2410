"""`pagechat serve` over real HTTP on 127.0.0.1, called with the official openai client: chat and
completions, streamed and not, n, seed, stop, logprobs, usage and the prefix cache; greedy text
equals the engine's own; 120 concurrent requests with some clients leaving mid-stream end with
every block back; /metrics and /health."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from drive import Watcher, listening
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import Roofline
from pagechat.server.app import ServerState, create_app
from pagechat.server.serve import ServerSettings, build_state, load_state

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@dataclass
class Served:
    """A running server: its base URL, its engine and its state (the test reads them only while
    the engine's thread is idle)."""

    url: str
    engine: Engine
    state: ServerState

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine loop routes nothing and the engine has no work left."""
        end = time.monotonic() + timeout
        while self.state.loop.num_active or self.engine.has_unfinished():
            assert time.monotonic() < end, "the engine did not go idle"
            time.sleep(0.01)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples as {'name{labels}': value} (labels other than model_name kept)."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}")
                out[key.replace("{}", "")] = float(value)
        return out


@contextmanager
def serving(model_dir, config: EngineConfig, **settings) -> Iterator[Served]:
    """pagechat's server on a tiny model, listening for the block's duration."""
    engine = Engine(model_dir, config)
    state = build_state(engine, ServerSettings(model_name=MODEL, **settings))
    with listening(create_app(state)) as url:
        yield Served(url, engine, state)


def tiny_config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def served(tiny_llama):
    # A pool of 48 blocks of 16 tokens: the concurrent run below preempts.
    with serving(tiny_llama, tiny_config(kv_blocks=48, max_seqs=32)) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(tiny_llama) -> Engine:
    """An engine of the test's own, for the server's answers to be compared with."""
    return Engine(tiny_llama, tiny_config())


def test_serve_loads_and_steps_its_engine_on_one_thread(tiny_llama, monkeypatch):
    """libgomp keeps a worker pool for each thread that ran a parallel op, and with more pool
    threads than cores its workers sleep between ops: an engine loaded on the main thread and
    stepped on another decoded 1.7x slower (core/threads.py). So `pagechat serve` loads, measures
    the roofline and steps on the loop's own thread, never the main one."""
    seen: dict[str, set[int]] = {}

    def on_thread(name, fn):
        def wrapped(*args, **kw):
            seen.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(Engine, "__init__", on_thread("load", Engine.__init__))
    monkeypatch.setattr(Engine, "step", on_thread("step", Engine.step))
    monkeypatch.setattr(Roofline, "measure", on_thread("roofline", Roofline.measure))
    state = load_state(tiny_llama, tiny_config(), ServerSettings(model_name=MODEL))
    with listening(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    assert seen.keys() == {"load", "roofline", "step"}
    used = set().union(*seen.values())
    assert len(used) == 1 and threading.get_ident() not in used


def test_models_and_health(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert served.client().models.retrieve(MODEL).id == MODEL
    health = httpx.get(served.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_greedy_chat_equals_the_engine(served, oracle):
    """Greedy text through the server, whole and streamed, is the engine's own greedy text for
    the same prompt ids; usage counts those ids."""
    ids = oracle.requests.encode_chat(HELLO)
    [want] = oracle.generate([ids], SamplingParams(temperature=0, max_tokens=24))
    client = served.client()
    got = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=24)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == want.num_output_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=HELLO, temperature=0, max_tokens=24, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_greedy_completion_equals_the_engine(served, oracle):
    prompt = "The cat sat on the"
    [want] = oracle.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    got = served.client().completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=16
    )
    assert got.choices[0].text == want.text
    stream = served.client().completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # a chunk per token, its text empty while held back (part of a character), as vLLM streams
    assert sum(1 for c in chunks if c.choices) == len(want.output_ids) == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_of_token_ids_and_of_several_prompts(served, oracle):
    ids = oracle.requests.encode("Once upon a time")
    [want] = oracle.generate([ids], SamplingParams(temperature=0, max_tokens=8))
    got = served.client().completions.create(
        model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=8, n=2
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert {c.text for c in got.choices} == {want.text}
    assert got.usage.prompt_tokens == 2 * len(ids)
    assert got.usage.completion_tokens == 4 * want.num_output_tokens


def test_n_samples_and_seed(served):
    """n choices, each its own sample; the same seed gives the same texts, streamed or not."""
    client = served.client()
    args = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.5, n=3, seed=11)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    other = client.chat.completions.create(**{**args, "seed": 12})
    assert [c.message.content for c in other.choices] != texts


def test_chat_logprobs(served):
    got = served.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(got.choices[0].message.content[:1])
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert token.token == token.top_logprobs[0].token  # greedy: the most likely one
        assert token.bytes == list(token.token.encode())
    plain = served.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(served):
    """Completions' logprobs shape, the same streamed (same seed) as whole."""
    args = dict(model=MODEL, prompt="Hello", max_tokens=5, temperature=0.8, seed=3, logprobs=2)
    got = served.client().completions.create(**args)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 and x <= 0 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    tokens, offsets, logprobs = [], [], []
    for chunk in served.client().completions.create(**args, stream=True):
        tokens += chunk.choices[0].logprobs.tokens
        offsets += chunk.choices[0].logprobs.text_offset
        logprobs += chunk.choices[0].logprobs.token_logprobs
    assert (tokens, offsets, logprobs) == (lp.tokens, lp.text_offset, lp.token_logprobs)


def test_stop_string(served, oracle):
    """A stop string cuts the reply before it, and the reason is stop."""
    [full] = oracle.generate(
        [oracle.requests.encode_chat(HELLO)],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    )
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text
    got = served.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        temperature=0,
        max_tokens=24,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == full.text[: full.text.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_prefix_cache_shows_in_usage(served):
    prompt = "one two three four five six seven eight nine ten " * 6
    client = served.client()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens


async def _one(client: openai.AsyncOpenAI, rng: random.Random) -> str:
    """One random request: chat or completion, streamed or not, n 1 or 2; a third of the
    streams leave after a few chunks. Returns how it ended."""
    words = " ".join(
        rng.choice(["cat", "dog", "sun", "tree", "blue"]) for _ in range(rng.randint(1, 60))
    )
    max_tokens = rng.randint(1, 40)
    n = rng.choice([1, 1, 2])
    extra = {"extra_body": {"ignore_eos": True}, "max_tokens": max_tokens, "n": n}
    chat = rng.random() < 0.5
    if rng.random() < 0.5:
        if chat:
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words}], **extra
            )
        else:
            r = await client.completions.create(model=MODEL, prompt=words, **extra)
        assert r.usage.completion_tokens == n * max_tokens  # every token, preempted or not
        assert {c.finish_reason for c in r.choices} == {"length"}
        return "completed"
    leave = rng.random() < 0.33
    if chat:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words}], stream=True, **extra
        )
    else:
        stream = await client.completions.create(model=MODEL, prompt=words, stream=True, **extra)
    finished, seen = 0, 0
    async with stream:
        async for chunk in stream:
            seen += 1
            finished += sum(c.finish_reason is not None for c in chunk.choices)
            if leave and seen >= 2:
                return "left"
    assert finished == n
    return "completed"


async def _crowd(served: Served, count: int) -> list[str]:
    rng = random.Random(5)
    async with served.async_client(timeout=60) as client:
        return await asyncio.gather(
            *(_one(client, random.Random(rng.random())) for _ in range(count))
        )


def test_concurrent_requests_with_clients_leaving(served):
    """200 concurrent requests of random lengths in a pool that must preempt, watched: every one
    completes in full or is aborted when its client leaves; afterwards every block is back, the
    server keeps nothing of them, and the watcher's block map is the engine's."""
    before = served.metrics()
    with Watcher(served.url) as watcher:
        check_the_crowd(served, watcher, before)


def check_the_crowd(served: Served, watcher: Watcher, before: dict) -> None:
    ends = asyncio.run(_crowd(served, 200))
    served.wait_idle()
    assert ends.count("completed") + ends.count("left") == 200 and ends.count("left") > 5
    assert served.engine.block_map.snapshot().num_used == 0
    assert not served.engine.scheduler.running and not served.engine.scheduler.waiting
    assert served.state.loop.num_active == 0
    assert not served.engine.requests  # each finished or aborted request was released
    after = served.metrics()
    aborted = after.get('pagechat:request_success_total{finished_reason="abort"}', 0) - before.get(
        'pagechat:request_success_total{finished_reason="abort"}', 0
    )
    assert 0 < aborted
    assert after["pagechat:num_preemptions_total"] > before["pagechat:num_preemptions_total"]
    assert after["pagechat:kv_cache_usage_perc"] == 0
    end = time.monotonic() + 10
    while watcher.snapshot != served.engine.block_map.snapshot():
        assert time.monotonic() < end, "the watcher's block map is not the engine's"
        time.sleep(0.05)


def test_a_client_leaving_a_whole_response_aborts_it(served):
    before = served.metrics().get('pagechat:request_success_total{finished_reason="abort"}', 0)
    # 500 tokens take the tiny model 0.3 s on a fast CPU: the client leaves well before
    client = served.client(timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=500, extra_body={"ignore_eos": True}
        )
    served.wait_idle()
    after = served.metrics()
    assert after['pagechat:request_success_total{finished_reason="abort"}'] == before + 1
    assert served.engine.block_map.snapshot().num_used == 0
    # The gauges follow the abort, though no step ran after it.
    assert after["pagechat:num_requests_running"] == after["pagechat:kv_cache_usage_perc"] == 0


FAMILIES = (
    "kv_cache_usage_perc",
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


def test_metrics_change_with_requests(served):
    before = served.metrics()
    assert all(f"pagechat:{name}" in before for name in FAMILIES)
    served.client().completions.create(
        model=MODEL, prompt="Tell me", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = served.metrics()
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert after[f"pagechat:{name}"] > before[f"pagechat:{name}"], name
    gained = after["pagechat:generation_tokens_total"] - before["pagechat:generation_tokens_total"]
    assert gained == 5
    assert (
        after["pagechat:inter_token_latency_seconds_count"]
        - before["pagechat:inter_token_latency_seconds_count"]
        == 4
    )


def test_speculation_metrics_and_output(tiny_llama, oracle):
    """With n-gram speculation the greedy text is unchanged and the spec_decode families count
    drafts, accepted tokens and acceptance per position."""
    prompt = "a b c d a b c d a b c d a b c d a b c"
    [want] = oracle.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    with serving(tiny_llama, tiny_config(ngram=True, num_draft=3)) as s:
        got = s.client().completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=20,
            extra_body={"ignore_eos": True},
        )
        m = s.metrics()
    assert got.choices[0].text == want.text
    drafts, drafted = (
        m["pagechat:spec_decode_num_drafts_total"],
        m["pagechat:spec_decode_num_draft_tokens_total"],
    )
    accepted = m["pagechat:spec_decode_num_accepted_tokens_total"]
    per_pos = [
        m.get(f'pagechat:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
        for i in range(3)
    ]
    assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
