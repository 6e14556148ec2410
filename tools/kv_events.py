"""A server's prefix cache as its KV events tell it: the stream vLLM publishes with
`--kv-events-config`, and `pagechat serve --kv-events` the same way (server/kv_events.py says the
wire). Read by `pagechat watch URL --kv-events ENDPOINT` and by tools/route_probe.py (a router's
view of a fleet). PrefixCache applies the batches in sequence order; EventFeed reads them on a
thread of its own and, where numbers are missing (it joined late, or the socket dropped some),
asks the replay socket for them and notes that it had to.

Hashes are what the server sends (vLLM: unsigned 64-bit ints, or bytes); a block's tokens are its
own block_size tokens, so a chain of blocks from a first one (no parent) spells the start of a
prompt. A prefix may live in several blocks at once (vLLM recomputes a tail it already holds):
each copy is stored and removed, and the prefix leaves the map with its last copy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import msgpack
import zmq

Hash = int | bytes
MEDIA = (None, "GPU")  # the engine's own pool (vLLM's CPU build names it GPU too); others offload
REPLAY_WAIT_S = 2.0  # a replay socket silent this long is taken to have nothing more
NOTICES = 8  # the latest things the feed had to do, kept for the panel
QUIET_S = 10.0  # a stream silent this long from the start is said to be (a wrong endpoint?)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    key: Hash
    parent: Hash | None
    token_ids: tuple[int, ...]
    seq: int  # the batch that stored it


@dataclass(frozen=True, slots=True)
class Chain:
    """A cached prefix: blocks from a first one to one no cached block extends."""

    keys: tuple[Hash, ...]
    token_ids: tuple[int, ...]
    shared: int  # leading blocks other chains hold too
    rooted: bool  # False when its first block's parent is not held (stored unseen, or dropped)
    seq: int  # the batch of its newest block

    @property
    def leaf(self) -> Hash:
        return self.keys[-1]


@dataclass(frozen=True, slots=True)
class CacheView:
    """What the panel draws, copied out under the feed's lock."""

    chains: tuple[Chain, ...]  # newest first
    blocks: int
    block_size: int | None
    stored: int  # events since the watcher started
    removed: int
    cleared: int
    batches: int
    bytes: int  # of the batches received
    last_seq: int | None
    elsewhere: int  # events for other media (offloaded copies), not drawn
    notices: tuple[str, ...]


# vLLM's events as maps (0.32 on), or from structs encoded array_like (vLLM's example
# subscriber's schema) as arrays [tag, field, ...] in the structs' field order
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _is_hash(h) -> bool:
    return isinstance(h, (int, bytes)) and not isinstance(h, bool)


def events_of(payload: bytes) -> list[dict]:
    """A batch's events as maps, each checked for what applying it reads; ValueError saying what
    is wrong otherwise."""
    try:
        batch = msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not [ts, [event, ...], rank]")
    out = []
    for e in batch[1]:
        if isinstance(e, list) and e and e[0] in FIELDS:
            e = {"type": e[0], **dict(zip(FIELDS[e[0]], e[1:]))}
        if not isinstance(e, dict) or e.get("type") not in FIELDS:
            raise ValueError(f"an event that is not {', '.join(FIELDS)}")
        hashes = e.get("block_hashes", [])
        if not isinstance(hashes, list) or not all(map(_is_hash, hashes)):
            raise ValueError(f"{e['type']} whose block_hashes are not ints or bytes")
        if e["type"] == "BlockStored":
            size, parent = e.get("block_size"), e.get("parent_block_hash")
            if not isinstance(size, int) or size < 1 or not isinstance(e.get("token_ids"), list):
                raise ValueError("BlockStored without a block_size and token_ids")
            if parent is not None and not _is_hash(parent):
                raise ValueError("BlockStored whose parent_block_hash is not an int or bytes")
        out.append(e)
    return out


class PrefixCache:
    """The blocks a server holds in its prefix cache, from its events."""

    def __init__(self) -> None:
        self.blocks: dict[Hash, CachedBlock] = {}
        self.children: dict[Hash, set[Hash]] = {}
        # (parent, tokens) -> block: a prompt's blocks found by their tokens (prefix_of)
        self.by_tokens: dict[tuple[Hash | None, tuple[int, ...]], Hash] = {}
        # vLLM may hold one prefix in two blocks (a recomputed tail): stored and removed twice
        self.copies: Counter[Hash] = Counter()
        self.block_size: int | None = None
        self.counts: Counter[str] = Counter()
        self.last_seq: int | None = None
        self.notices: deque[str] = deque(maxlen=NOTICES)

    def note(self, text: str) -> None:
        self.notices.append(f"{time.strftime('%H:%M:%S')} {text}")

    def apply(self, seq: int, payload: bytes) -> None:
        """One batch, `[ts, [event, ...], data_parallel_rank]`, its events in order; ValueError
        (and nothing changed) when it is not such a batch."""
        events = events_of(payload)
        for e in events:
            kind = e["type"]
            if e.get("medium") not in MEDIA and kind != "AllBlocksCleared":
                self.counts["elsewhere"] += 1
            elif kind == "BlockStored":
                self._store(seq, e)
            elif kind == "BlockRemoved":
                for key in e["block_hashes"]:
                    self._remove(key)
                self.counts["removed"] += 1
            else:
                self.clear()
                self.counts["cleared"] += 1
        self.counts["batches"] += 1
        self.counts["bytes"] += len(payload)
        self.last_seq = seq

    def skip(self, seq: int, why: str) -> None:
        """A batch that could not be read: passed over, and said."""
        self.counts["skipped"] += 1
        self.last_seq = seq
        self.note(f"batch {seq} is not a KV-event batch ({why}): skipped")

    def _store(self, seq: int, e: dict) -> None:
        size = self.block_size = e["block_size"]
        parent, tokens = e["parent_block_hash"], e["token_ids"]
        for i, key in enumerate(e["block_hashes"]):
            self.copies[key] += 1
            if key not in self.blocks:
                block = CachedBlock(key, parent, tuple(tokens[i * size : (i + 1) * size]), seq)
                self.blocks[key] = block
                self.by_tokens[(parent, block.token_ids)] = key
                if parent is not None:
                    self.children.setdefault(parent, set()).add(key)
            parent = key
        self.counts["stored"] += 1

    def _remove(self, key: Hash) -> None:
        """One copy of the block gone; the prefix is gone with its last copy."""
        self.copies[key] -= 1
        if self.copies[key] > 0:
            return
        del self.copies[key]
        block = self.blocks.pop(key, None)
        if block is not None and self.by_tokens.get((block.parent, block.token_ids)) == key:
            del self.by_tokens[(block.parent, block.token_ids)]
        if block is not None and block.parent is not None:
            siblings = self.children.get(block.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self.children[block.parent]

    def clear(self) -> None:
        self.blocks.clear()
        self.children.clear()
        self.by_tokens.clear()
        self.copies.clear()

    def chains(self) -> list[Chain]:
        """Every cached prefix, newest first: one per block that no held block extends."""
        paths = []
        for key, block in self.blocks.items():
            if self.children.get(key):
                continue
            path, seen = [block], {key}
            while path[-1].parent in self.blocks and path[-1].parent not in seen:
                seen.add(path[-1].parent)  # a parent chain that loops (a bad stream) ends
                path.append(self.blocks[path[-1].parent])
            paths.append(path[::-1])
        through: Counter[Hash] = Counter(b.key for path in paths for b in path)
        out = [
            Chain(
                tuple(b.key for b in path),
                tuple(t for b in path for t in b.token_ids),
                sum(1 for b in path if through[b.key] > 1),
                path[0].parent is None,
                max(b.seq for b in path),
            )
            for path in paths
        ]
        return sorted(out, key=lambda c: -c.seq)

    def prefix_of(self, ids: list[int]) -> int:
        """How many of these tokens' leading full blocks the cache holds, matched by tokens (a
        router that cannot compute the server's hashes matches so)."""
        size = self.block_size
        if not size:
            return 0
        parent, n = None, 0
        while (n + 1) * size <= len(ids):
            parent = self.by_tokens.get((parent, tuple(ids[n * size : (n + 1) * size])))
            if parent is None:
                break
            n += 1
        return n

    def holds(self, ids: list[int]) -> bool:
        """Whether every full block of these tokens is held."""
        size = self.block_size
        return bool(size) and self.prefix_of(ids) >= len(ids) // size

    def view(self) -> CacheView:
        c = self.counts
        return CacheView(
            tuple(self.chains()),
            len(self.blocks),
            self.block_size,
            c["stored"],
            c["removed"],
            c["cleared"],
            c["batches"],
            c["bytes"],
            self.last_seq,
            c["elsewhere"],
            tuple(self.notices),
        )


def _batches(first: int, end: int) -> str:
    """Batch numbers first..end-1 as a notice names them."""
    return f"batch {first}" if end - first == 1 else f"batches {first}-{end - 1}"


class EventFeed:
    """Subscribes to a server's KV events on a thread of its own (ZMQ sockets stay on the thread
    that made them) and keeps a PrefixCache of them; view() is safe from any thread."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "") -> None:
        self.endpoint, self.replay, self.topic = endpoint, replay, topic
        self.cache = PrefixCache()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagechat-kv-feed", daemon=True)
        self._caught_up: set[int] = set()  # batches the joining replay gave, the stream may too

    def start(self) -> EventFeed:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def view(self) -> CacheView:
        with self._lock:
            return self.cache.view()

    def prefix_of(self, ids: list[int]) -> int:
        with self._lock:
            return self.cache.prefix_of(ids)

    def holds(self, ids: list[int]) -> bool:
        with self._lock:
            return self.cache.holds(ids)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        replay = ctx.socket(zmq.DEALER) if self.replay is not None else None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
            if replay is not None:
                replay.connect(self.replay)
                with self._lock:  # what the server did before the watcher came, as kept
                    self._catch_up(replay)
            started, heard = time.monotonic(), False
            while not self._stop.is_set():
                if not sub.poll(100):
                    if not heard and time.monotonic() - started > QUIET_S:
                        heard = True  # said once
                        with self._lock:
                            self.cache.note(
                                f"no batch from {self.endpoint} in {QUIET_S:.0f} s: is it the "
                                f"server's KV-events endpoint, and its topic {self.topic!r}?"
                            )
                    continue
                heard = True
                frames = sub.recv_multipart()
                if len(frames) == 3:
                    with self._lock:
                        self.take(int.from_bytes(frames[1], "big"), frames[2], replay)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def take(self, seq: int, payload: bytes, replay) -> None:
        """A batch from the stream: first what is missing before it, if the replay has it. The
        stream repeats no number, except those the joining replay gave already: any other number
        not above the last is a new publisher's (the server restarted)."""
        cache, last = self.cache, self.cache.last_seq
        if seq in self._caught_up:
            self._caught_up.discard(seq)
            return
        self._caught_up.clear()  # the stream has passed what the joining replay gave
        if last is not None and seq <= last:
            cache.clear()
            cache.last_seq = last = None
            cache.note(f"the server's events started again (batch {seq}): the map starts afresh")
        expected = 0 if last is None else last + 1
        if seq > expected:
            self._recover(expected, seq, replay)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.cache.apply(seq, payload)
        except ValueError as e:
            self.cache.skip(seq, str(e))

    def _catch_up(self, replay) -> None:
        """On joining: every batch the replay buffer still has."""
        got = self._ask(replay, 0)
        for seq, payload in got or ():
            self._apply(seq, payload)
            self._caught_up.add(seq)
        if got:
            lost = f"; {_batches(0, got[0][0])} are gone from it" if got[0][0] else ""
            self.cache.note(f"joined at batch {got[-1][0] + 1}: replayed {len(got)}{lost}")

    def _ask(self, replay, first: int) -> list[tuple[int, bytes]] | None:
        """The batches from `first` on that the replay socket answers with, in order; None (and
        a notice) when it does not answer to the end."""
        replay.send_multipart((b"", first.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        while replay.poll(int(REPLAY_WAIT_S * 1000)):
            frames = replay.recv_multipart()
            if len(frames) < 2:
                continue  # not a batch, nor the end: not what a replay socket sends
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq < 0:  # the end marker
                return sorted(got)
            got.append((seq, frames[-1]))
        self.cache.note(f"the replay endpoint {self.replay} did not answer in {REPLAY_WAIT_S} s")
        return None

    def _recover(self, first: int, upto: int, replay) -> None:
        """Ask the replay socket for batches first..upto-1 and apply those it still has."""
        cache = self.cache
        span = _batches(first, upto)
        what = f"joined at batch {upto}" if cache.last_seq is None else f"missed {span}"
        if replay is None:
            cache.note(f"{what}; with no replay endpoint, what {span} did is not drawn")
            return
        got = [(seq, payload) for seq, payload in self._ask(replay, first) or () if seq < upto]
        for seq, payload in got:
            self._apply(seq, payload)
        start = got[0][0] if got else upto
        if start > first:
            lost = _batches(first, start)
            cache.note(f"{what}; the replay buffer no longer holds {lost}: not drawn as it was")
        else:
            cache.note(f"{what}; replayed {span} from {self.replay}")
