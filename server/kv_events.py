"""The engine's prefix-cache changes as vLLM publishes its KV events (`--kv-events-config`), so a
KV-aware router (llm-d's) or a console reads pagechat's server as it reads vLLM's.

The wire, as vLLM's ZmqEventPublisher writes it: a ZMQ PUB socket sends each batch as three frames,
the topic, an 8-byte big-endian sequence number and the batch in msgpack: `[ts, [event, ...],
data_parallel_rank]`, each event a map tagged by `type` with vLLM's fields in vLLM's order
(BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys, group_idx, kv_cache_spec_kind; BlockRemoved: block_hashes, medium, group_idx;
AllBlocksCleared), hashes unsigned 64-bit as a real vLLM 0.32 server sends them. A ROUTER replay
socket answers a request for the batches from a sequence number (8 bytes, big-endian) with each
buffered batch, then an end marker (sequence -1, empty frames). The events come from the
allocator's own BlockEvents ("stored" and "removed" of full blocks): one source, no second
bookkeeping.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import msgpack
import zmq
from pagechat.core.blocks import BlockEvent

MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (its CPU build says GPU too)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wire_hash(h: int | None) -> int | None:
    """A chained block hash as vLLM sends one: unsigned 64-bit (Python's hash() is signed)."""
    return None if h is None else h & 0xFFFF_FFFF_FFFF_FFFF


def encode_batch(events: list[BlockEvent], block_size: int, ts: float) -> bytes:
    """A batch of the allocator's stored/removed events in vLLM's msgpack shape."""
    out = []
    for e in events:
        if e.kind == "stored":
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [wire_hash(e.key)],
                    "parent_block_hash": wire_hash(e.parent),
                    "token_ids": list(e.token_ids),
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": MEDIUM,
                    "lora_name": None,
                    "extra_keys": [None],  # no LoRA, images or cache salt in a block's hash
                    "group_idx": 0,  # one KV cache group: every layer full attention
                    "kv_cache_spec_kind": "full_attention",
                }
            )
        elif e.kind == "removed":
            out.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [wire_hash(e.key)],
                    "medium": MEDIUM,
                    "group_idx": 0,
                }
            )
    return msgpack.packb([ts, out, 0])


class KVEventPublisher:
    """Publishes batches from the engine's thread; a thread of its own owns the sockets (ZMQ
    sockets are not thread-safe), sends in order and serves replays from its buffer."""

    def __init__(
        self, endpoint: str, replay: str | None = None, topic: str = "", buffer: int = 10_000
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._replay = self.replay_endpoint = None
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        # as bound: tcp://127.0.0.1:* takes a free port, named here
        self.endpoint, self._topic = self._pub.getsockopt_string(zmq.LAST_ENDPOINT), topic.encode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="pagechat-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[BlockEvent], block_size: int) -> None:
        """Queue the stored/removed events among these as one batch (none: nothing is sent)."""
        if any(e.kind in ("stored", "removed") for e in events):
            self._queue.put(encode_batch(events, block_size, time.time()))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if payload is None:
                    return
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._sent.append((self._seq, payload))
                self._seq += 1
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        """A subscriber that missed batches asks for them from a sequence number."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._sent:
            if seq >= first:
                out = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(out)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
