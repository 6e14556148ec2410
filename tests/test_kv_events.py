"""`pagechat serve --kv-events`: the prefix cache's block events on vLLM's wire. The oracles are
vLLM's own encoder (a batch it encoded, recorded in tests/fixtures/vllm/kv_events_batch.hex) and
a subscriber written here from vLLM's published schema (ZMQ frames topic / 8-byte big-endian
sequence / msgpack [ts, events, data_parallel_rank], events tagged by "type"), not pagechat's code:
what it decodes must be the engine's own prefix cache, and a replay must give the same batches."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgpack
import zmq
from pagechat.core.blocks import BlockEvent
from pagechat.server.kv_events import encode_batch
from test_server import serving, tiny_config

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "kv_events_batch.hex"


def test_a_batch_is_byte_for_byte_what_vllms_encoder_writes():
    """vLLM 0.32.0's msgspec encoder, given the same two BlockStored and one BlockRemoved, wrote
    the fixture (its command is in tests/fixtures/README.md)."""
    events = [
        BlockEvent("stored", block=0, key=-7, parent=None, token_ids=(1, 2)),
        BlockEvent("allocated", 1, 3),  # not a prefix-cache event: not published
        BlockEvent("stored", block=1, key=9, parent=-7, token_ids=(3, 4)),
        BlockEvent("removed", block=0, key=-7),
    ]
    assert encode_batch(events, 2, 1.5) == bytes.fromhex(FIXTURE.read_text().strip())


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
                ]
                size = e["block_size"]
                assert len(e["token_ids"]) == size * len(e["block_hashes"])
                parent = e["parent_block_hash"]
                assert parent is None or parent in self.blocks or parent in self.gone
                for h in e["block_hashes"]:
                    self.blocks[h] = e
            elif e["type"] == "BlockRemoved":
                assert list(e) == ["type", "block_hashes", "medium"]
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
        blocks = s.engine.blocks
        registry = {hash(key) for key in blocks._registry if len(key[1]) == blocks.block_size}
        assert sub.blocks.keys() == registry and sub.gone  # some were evicted, and said so
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
