"""`pagechat serve --kv-events`: the prefix cache's block events on vLLM's wire. The oracles are
vLLM's own encoder (a batch it encoded, recorded in tests/fixtures/vllm/kv_events_batch.hex) and
a subscriber written here from vLLM's published schema (ZMQ frames topic / 8-byte big-endian
sequence / msgpack [ts, events, data_parallel_rank], events tagged by "type"), not pagechat's code:
what it decodes must be the engine's own prefix cache, and a replay must give the same batches."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from pagechat.core.blocks import BlockEvent
from pagechat.server.kv_events import encode_batch
from pagechat.tools.kv_events import CacheView, EventFeed, PrefixCache
from test_server import serving, tiny_config

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "kv_events_batch.hex"


def test_a_batch_is_byte_for_byte_what_vllms_encoder_writes():
    """vLLM 0.32.0's msgspec encoder, given the same two BlockStored and one BlockRemoved with
    the fields a real vLLM server fills (tests/fixtures/vllm/kv_events) and the hash -7 as vLLM's
    unsigned 2**64 - 7, wrote the fixture (its command is in tests/fixtures/README.md)."""
    events = [
        BlockEvent("stored", block=0, key=-7, parent=None, token_ids=(1, 2)),
        BlockEvent("allocated", 1, 3),  # not a prefix-cache event: not published
        BlockEvent("stored", block=1, key=9, parent=-7, token_ids=(3, 4)),
        BlockEvent("removed", block=0, key=-7),
    ]
    assert encode_batch(events, 2, 1.5) == bytes.fromhex(FIXTURE.read_text().strip())


def registry(engine) -> dict[int, tuple[int, ...]]:
    """The engine's full cached blocks: chained hash (unsigned, as on the wire) -> tokens."""
    blocks = engine.blocks
    return {hash(k) % 2**64: k[1] for k in blocks._registry if len(k[1]) == blocks.block_size}


class Subscriber:
    """vLLM's KV-event subscriber, from its schema: the stored blocks by hash, as it builds them."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, bytes]] = []
        self.blocks: dict[int, dict] = {}  # hash -> its BlockStored
        self.gone: set[int] = set()  # hashes removed

    def drain(self, quiet_s: float = 0.5) -> None:
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.take(int.from_bytes(seq, "big"), payload)

    def take(self, seq: int, payload: bytes) -> None:
        self.batches.append((seq, payload))
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for e in events:
            if e["type"] == "BlockStored":
                assert list(e) == [
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                    "kv_cache_spec_kind",
                ]
                assert all(0 <= h < 2**64 for h in e["block_hashes"])
                size = e["block_size"]
                assert len(e["token_ids"]) == size * len(e["block_hashes"])
                parent = e["parent_block_hash"]
                assert parent is None or parent in self.blocks or parent in self.gone
                for h in e["block_hashes"]:
                    self.blocks[h] = e
            elif e["type"] == "BlockRemoved":
                assert list(e) == ["type", "block_hashes", "medium", "group_idx"]
                for h in e["block_hashes"]:
                    self.gone.add(h)
                    del self.blocks[h]
            else:
                assert e["type"] == "AllBlocksCleared"
                self.blocks.clear()


def test_a_subscriber_from_vllms_schema_sees_the_engines_prefix_cache(tiny_llama):
    """Requests sharing a prompt in a pool small enough to evict: what the subscriber holds is
    the engine's registry of full blocks; sequence numbers count from 0; a replay from 0 gives
    the very batches the subscriber took."""
    config = tiny_config(kv_blocks=20, block_size=4)
    endpoints = dict(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*")
    with serving(tiny_llama, config, **endpoints) as s:
        publisher = s.state.loop.kv_events
        sub = Subscriber(publisher.endpoint)
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        shared = "one two three four five six seven eight nine ten eleven"
        for k in range(8):
            body = {"model": "tiny", "prompt": f"{shared} {k} " * (1 + k % 3), "max_tokens": 4}
            assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
        s.wait_idle()
        sub.drain()
        assert (
            sub.blocks.keys() == registry(s.engine).keys() and sub.gone
        )  # some were evicted, and said so
        assert [seq for seq, _ in sub.batches] == list(range(len(sub.batches)))
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        again = []
        while True:
            assert replay.poll(5000)
            _, topic, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            again.append((int.from_bytes(seq, "big"), payload))
        assert again == sub.batches


# -- the watcher's side: `pagechat watch URL --kv-events` ----------------------------------------
def caught_up(feed: EventFeed, publisher, timeout: float = 10.0) -> CacheView:
    """The feed's view once it holds every batch the publisher has sent, and nothing is left to
    send (asked twice, 0.1 s apart: a batch is taken from the queue before it is numbered)."""
    end, settled = time.monotonic() + timeout, 0
    while settled < 2:
        view = feed.view()
        done = publisher._queue.empty() and view.last_seq == publisher._seq - 1
        settled = settled + 1 if done else 0
        assert time.monotonic() < end, f"the feed is at {view.last_seq}, not {publisher._seq - 1}"
        time.sleep(0.1)
    return view


def test_the_watchers_map_is_the_engines_prefix_cache(tiny_llama):
    """The feed joins after some requests (it catches up from the replay socket and says so),
    then follows evictions live: each time checked, its blocks are the engine's full cached
    blocks with their tokens; each chain agrees with a prompt sent as far as both go (a chain
    may run on into the reply), and its shared blocks are those another chain holds too."""
    config = tiny_config(kv_blocks=20, block_size=4)
    endpoints = dict(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*")
    with serving(tiny_llama, config, **endpoints) as s:
        publisher = s.state.loop.kv_events
        sent = []

        def ask(prompt: str) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
            sent.append(s.state.encoder.prompts(prompt)[0])

        shared = "one two three four five six seven eight nine ten eleven"
        for k in range(3):
            ask(f"{shared} {k} " * (1 + k))
        s.wait_idle()
        feed = EventFeed(publisher.endpoint, publisher.replay_endpoint).start()
        try:
            first = caught_up(feed, publisher)
            assert any(c.shared for c in first.chains)  # the three prompts' common start
            for k in range(3, 9):
                view = caught_up(feed, publisher)
                by_key = {k: b.token_ids for k, b in feed.cache.blocks.items()}
                assert by_key == registry(s.engine)
                ask(f"{shared} {k} " * (1 + k % 3))
                s.wait_idle()
            view = caught_up(feed, publisher)
        finally:
            feed.stop()
        assert {k: b.token_ids for k, b in feed.cache.blocks.items()} == registry(s.engine)
        assert view.removed  # evictions were followed live
        assert view.notices[0].split(" ", 1)[1].startswith("joined at batch ")
        held = Counter(k for c in view.chains for k in c.keys)
        for chain in view.chains:
            assert chain.rooted
            n = len(chain.token_ids)
            assert any(ids[:n] == list(chain.token_ids)[: len(ids)] for ids in sent)
            assert chain.shared == sum(held[k] > 1 for k in chain.keys)


def test_a_gap_is_filled_from_the_replay_a_lost_batch_and_a_restart_are_said():
    """A publisher of the test's own, on vLLM's wire, drops batches on the stream: the feed asks
    the replay socket from the first one it missed and applies what comes back; what the replay
    no longer holds leaves a chain whose start is unknown, and a stream that starts again at 0
    starts the map afresh. Each is a notice."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, replay_port = (s.bind_to_random_port("tcp://127.0.0.1") for s in (pub, router))

    def batch(i: int, parent: int | None) -> bytes:
        stored = BlockEvent("stored", key=100 + i, parent=parent, token_ids=(i, i))
        return encode_batch([stored], 2, float(i))

    chain = {i: batch(i, 100 + i - 1 if i else None) for i in range(8)}

    def answer(held: dict[int, bytes]) -> None:
        """One replay request: the held batches from the asked number on, then the end."""
        assert router.poll(5000), "the feed did not ask for a replay"
        client, _, start = router.recv_multipart()
        for seq in sorted(held):
            if seq >= int.from_bytes(start, "big"):
                router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), held[seq]))
        router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def wait_for(seq: int) -> CacheView:
        end = time.monotonic() + 5
        while (view := feed.view()).last_seq != seq:
            assert time.monotonic() < end, f"the feed is at {view.last_seq}, not {seq}"
            time.sleep(0.02)
        return view

    feed = EventFeed(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}").start()
    try:
        answer({})  # on joining it asks for everything kept: nothing yet
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        for seq in (0, 1, 4):  # 2 and 3 lost on the way
            pub.send_multipart((b"", seq.to_bytes(8, "big"), chain[seq]))
        answer(chain)
        view = wait_for(4)
        assert set(feed.cache.blocks) == {100, 101, 102, 103, 104}
        assert view.notices[-1].endswith(
            f"missed batches 2-3; replayed batches 2-3 from tcp://127.0.0.1:{replay_port}"
        )
        assert [c.keys for c in view.chains] == [(100, 101, 102, 103, 104)]
        pub.send_multipart((b"", (7).to_bytes(8, "big"), chain[7]))  # 5 and 6 lost
        answer({6: chain[6], 7: chain[7]})  # the buffer has dropped 5
        view = wait_for(7)
        assert view.notices[-1].endswith(
            "missed batches 5-6; the replay buffer no longer holds batch 5: not drawn as it was"
        )
        assert [(c.keys, c.rooted) for c in view.chains] == [
            ((106, 107), False),  # 106's parent was stored by the lost batch
            ((100, 101, 102, 103, 104), True),
        ]
        pub.send_multipart((b"", (8).to_bytes(8, "big"), b"not a batch"))
        view = wait_for(8)
        note = view.notices[-1]  # msgpack's own words in the middle
        assert "batch 8 is not a KV-event batch (not msgpack: " in note
        assert note.endswith("): skipped")
        pub.send_multipart((b"", (0).to_bytes(8, "big"), batch(0, None)))  # a new publisher
        view = wait_for(0)
        assert set(feed.cache.blocks) == {100}
        assert view.notices[-1].endswith(
            "the server's events started again (batch 0): the map starts afresh"
        )
    finally:
        feed.stop()
        pub.close(linger=0)
        router.close(linger=0)


# -- a real vLLM's stream (tests/fixtures/vllm/kv_events, recorded by record.py vllm-kv-events) --
RECORDED = Path(__file__).parent / "fixtures" / "vllm" / "kv_events"


def recorded_prompt(label: str) -> list[int]:
    """The prompt's token ids, as vLLM's own /tokenize gave them."""
    return json.loads((RECORDED / f"tokenize_{label}.json").read_text())["tokens"]


def agrees(chain, prompt: list[int]) -> bool:
    """The chain spells the prompt as far as both go (a chain runs on into the reply)."""
    n = min(len(chain.token_ids), len(prompt))
    return n > 0 and list(chain.token_ids[:n]) == prompt[:n]


def test_a_real_vllms_stream_draws_its_prefix_cache():
    """vLLM 0.32.0 with 32-token blocks: three questions under one system prompt share its five
    full blocks and branch; the repeated question stores its last block a second time, so the
    first removal of that hash leaves it held and the second takes it; the reset clears the map;
    and the replay socket's answer builds the very same map as the stream."""
    stream = [json.loads(line) for line in (RECORDED / "events.jsonl").open()]
    cache = PrefixCache()
    seen: dict[str, list] = {}
    held: dict[int, set] = {}  # the hashes held after each batch
    for entry in stream:
        cache.apply(entry["seq"], bytes.fromhex(entry["payload_hex"]))
        seen[entry["after"]] = cache.chains()
        held[entry["seq"]] = set(cache.blocks)
    three = seen["shared_q3"]
    questions = [recorded_prompt(f"shared_q{i}") for i in (1, 2, 3)]
    assert len(three) == 3 and [c.shared for c in three] == [5, 5, 5]
    assert all(any(agrees(c, q) for c in three) for q in questions)
    assert all(c.rooted and len(c.token_ids) == 32 * len(c.keys) for c in three)
    assert seen["repeat_q1"] == three  # a hit, and a second copy of a block held already
    recomputed = next(c for c in three if agrees(c, questions[0])).leaf
    assert cache.counts["removed"] == 48
    assert recomputed in held[12] and recomputed not in held[13]  # removed at seq 10 and 13
    longs = [recorded_prompt(f"long_{i}") for i in range(1, 6)]
    assert all(any(agrees(c, p) for p in longs) for c in seen["long_5"])
    final = cache.chains()
    assert cache.counts["cleared"] == 1 and len(final) == 1 and agrees(final[0], questions[0])
    again = PrefixCache()
    for line in (RECORDED / "replay.jsonl").open():
        frames = [bytes.fromhex(f) for f in json.loads(line)["frames_hex"]]
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq >= 0:
            again.apply(seq, frames[-1])
    assert again.blocks == cache.blocks and again.last_seq == 20


@pytest.mark.anyio
async def test_the_console_draws_each_cached_prefix_with_its_own_text(tiny_llama, monkeypatch):
    """`pagechat watch URL --kv-events` on a pagechat server: the map heads the console, a row a
    cached prefix, its shared blocks marked, and the text the server's /detokenize gives for the
    tokens of its own blocks."""
    from drive import wait_until
    from pagechat.tui import peer_app

    monkeypatch.setattr(peer_app, "POLL_S", 0.2)
    config = tiny_config(kv_blocks=64, block_size=4)
    endpoints = dict(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*")
    with serving(tiny_llama, config, **endpoints) as s:
        publisher = s.state.loop.kv_events
        shared = "one two three four five six seven eight nine ten eleven"
        for tail in ("alpha beta gamma delta", "red green blue yellow"):
            body = {"model": "tiny", "prompt": f"{shared} {tail}", "max_tokens": 2}
            assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
        s.wait_idle()
        feed = EventFeed(publisher.endpoint, publisher.replay_endpoint)
        app = peer_app.PeerApp(s.url, "pagechat", "tiny", events=feed)
        async with app.run_test(size=(180, 50)) as pilot:

            def named() -> bool:
                v = app.cache_view
                return bool(v and v.chains and all(app.texts.get(c.leaf) for c in v.chains))

            await wait_until(pilot, named, 10, "every prefix named")
            view = app.cache_view
            shown = str(app.query_one("#events").content)
            assert f"{view.blocks} blocks of 4 tokens · {len(view.chains)} prefixes" in shown
            assert any(c.shared for c in view.chains)
            for chain in view.chains:
                own = s.state.encoder.text(list(chain.token_ids[4 * chain.shared :]))
                assert own and own.replace("\n", "⏎") in shown
            assert "joined at batch" in shown  # it caught up from the replay, and says so


@pytest.mark.anyio
async def test_the_console_draws_a_real_vllms_prefix_cache(monkeypatch):
    """A server answering as the recorded vLLM did (its models, version and metrics), publishing
    the recording's first five batches as vLLM published them: the console draws its three
    cached prefixes (the system prompt's five blocks shared, each question's own after them) of
    its 80 blocks, and names each from the server's /detokenize."""
    from drive import listening, wait_until
    from pagechat.tui import peer_app
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    monkeypatch.setattr(peer_app, "POLL_S", 0.2)
    asked = []

    async def detokenize(request):
        asked.append((await request.json())["tokens"])
        return Response(f'{{"prompt": "question {len(asked)}"}}', media_type="application/json")

    def file(name: str):
        return lambda request: Response((RECORDED / name).read_text())

    app = Starlette(
        routes=[
            Route("/v1/models", file("models.json")),
            Route("/version", file("version.json")),
            Route("/metrics", file("metrics_after.txt")),
            Route("/detokenize", detokenize, methods=["POST"]),
        ]
    )
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, replay_port = (s.bind_to_random_port("tcp://127.0.0.1") for s in (pub, router))
    stream = [json.loads(line) for line in (RECORDED / "events.jsonl").open()][:5]
    try:
        with listening(app) as url:
            feed = EventFeed(
                f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv"
            )
            console = peer_app.PeerApp(url, "vllm", "smollm2", events=feed)
            async with console.run_test(size=(180, 50)) as pilot:
                assert router.poll(5000)  # the feed asks for what it missed: nothing yet
                client, _, _ = router.recv_multipart()
                router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
                await pilot.pause(0.3)  # the SUB socket joins
                for e in stream:
                    pub.send_multipart(
                        (b"kv", e["seq"].to_bytes(8, "big"), bytes.fromhex(e["payload_hex"]))
                    )
                await wait_until(
                    pilot,
                    lambda: console.cache_view and len(console.texts) == 3 and console.history,
                    10,
                    "three prefixes, named",
                )
                await pilot.pause(0.3)
                shown = str(console.query_one("#events").content)
    finally:
        pub.close(linger=0)
        router.close(linger=0)
    view = console.cache_view
    assert [c.shared for c in view.chains] == [5, 5, 5] and view.last_seq == 4
    assert f"{view.blocks} blocks of 80 of 32 tokens · 3 prefixes · batch 4" in shown
    assert shown.count("▓" * 5 + "█") == 3 and all(f"…question {i}" in shown for i in (1, 2, 3))
    own = {tuple(tokens) for tokens in asked}  # each prefix's own blocks, past the shared five
    assert own == {c.token_ids[5 * 32 :] for c in view.chains}


def test_a_batch_that_is_not_one_changes_nothing_and_the_feed_reads_on():
    """What a stream may carry that is not a KV-event batch is refused whole (ValueError naming
    it, the map untouched); events as arrays (vLLM's structs encoded array_like, as its example
    subscriber's schema has them) are read as maps are; a parent chain that loops ends."""
    good = msgpack.packb([0.0, [["BlockStored", [1], None, [5, 6], 2, None, "GPU"]], 0])
    cache = PrefixCache()
    cache.apply(0, good)
    assert [c.token_ids for c in cache.chains()] == [(5, 6)]
    stored = {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1}
    bad = [
        b"not msgpack",
        msgpack.packb({"ts": 0}),
        msgpack.packb([0.0, "events", 0]),
        msgpack.packb([0.0, ["BlockStored"], 0]),
        msgpack.packb([0.0, [{"type": "Nothing"}], 0]),
        msgpack.packb([0.0, [{**stored, "token_ids": [7, 8]}], 0]),  # no block_size
        msgpack.packb([0.0, [{**stored, "token_ids": [7, 8], "block_size": "2"}], 0]),
        msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [[1]]}], 0]),
        good + b"x",
    ]
    for payload in bad:
        with pytest.raises(ValueError):
            cache.apply(1, payload)
    assert cache.last_seq == 0 and list(cache.blocks) == [1]
    loop = [
        {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p, "token_ids": [h, h]}
        for h, p in ((5, 7), (7, 5), (9, 5))
    ]
    cache.apply(1, msgpack.packb([0.0, [{**e, "block_size": 2} for e in loop], 0]))
    assert {c.keys for c in cache.chains()} >= {(7, 5, 9)}  # ends, each block once


def test_a_stream_that_never_speaks_is_said(monkeypatch):
    """An endpoint where nothing publishes (a wrong port, a wrong topic): after QUIET_S the map
    says so, once."""
    from pagechat.tools import kv_events

    monkeypatch.setattr(kv_events, "QUIET_S", 0.3)
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    feed = EventFeed(f"tcp://127.0.0.1:{port}", topic="kv").start()
    try:
        time.sleep(1.0)
        notices = feed.view().notices
    finally:
        feed.stop()
        pub.close(linger=0)
    assert len(notices) == 1
    assert notices[0].endswith(
        f"no batch from tcp://127.0.0.1:{port} in 0 s: is it the server's KV-events endpoint, "
        "and its topic 'kv'?"
    )
