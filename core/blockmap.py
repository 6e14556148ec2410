"""BlockMap: the pool as the app draws it, built from the allocator's BlockEvents alone.

It keeps which sequences hold each block and how many slots each sequence reserves, and turns them
into a BlockSnapshot on demand. A snapshot costs O(blocks touched since the last one): a 100k-block
pool is snapshotted every step, and a decode step touches one tail block per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagechat.core.blocks import BlockEvent, BlockManager


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One physical block as the UI sees it."""

    block_id: int
    state: str  # "used" | "cached" (ref 0 but holds a registered prefix) | "free"
    ref_count: int
    owners: tuple[int, ...]  # seq ids holding it, sorted
    filled: int  # slots holding tokens
    mark: int = 0  # the map's serial of the last copy-on-write copy into it or prefix hit on it
    marked: str = ""  # what that was: "copied" | "hit"


@dataclass(frozen=True, slots=True)
class BlockSnapshot:
    """The whole pool at one moment: per-block records plus totals and prefix-cache counters."""

    block_size: int
    blocks: tuple[BlockInfo, ...]  # index = block id
    num_used: int
    num_cached: int
    num_free: int
    num_shared: int  # used blocks with ref_count > 1
    tokens_stored: int  # sum of `filled` over used blocks
    slots_reserved: int  # num_used * block_size
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    # copies and hits marked so far: a block whose mark is above an earlier snapshot's serial was
    # copied into or hit since that snapshot, however many snapshots a view skipped
    serial: int = 0

    @property
    def fragmentation(self) -> float:
        """Share of reserved slots that hold no token (0 when nothing is used)."""
        return 1 - self.tokens_stored / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over queried tokens (0 when nothing was queried)."""
        if not self.prefix_queried_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens


class BlockMap:
    """An observer of one BlockManager that answers snapshot() from the events it has seen."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._holders: list[set[int]] = [set() for _ in range(num_blocks)]
        self._index = [0] * num_blocks  # the block's position in its holders' tables
        self._kept = [-1] * num_blocks  # tokens a cached block keeps; -1 for a free block
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._queried = self._hit = 0
        self._serial = 0
        self._marks: dict[int, tuple[int, str]] = {}  # block -> (serial, "copied" | "hit")
        self._infos = [BlockInfo(b, "free", 0, (), 0) for b in range(num_blocks)]
        self._num_used = self._num_cached = self._num_shared = self._tokens_stored = 0
        self._touched: set[int] = set()
        self._snap: BlockSnapshot | None = None

    @classmethod
    def watching(cls, blocks: BlockManager) -> BlockMap:
        """A map of a fresh BlockManager, subscribed to its events."""
        view = cls(blocks.num_blocks, blocks.block_size)
        blocks.observers.append(view.apply)
        return view

    def apply(self, event: BlockEvent) -> None:
        """Take one event into the map."""
        kind, seq, block = event.kind, event.seq_id, event.block
        if kind in ("allocated", "hit", "shared"):
            self._hold(seq, block)
        elif kind == "copied":
            self._drop(seq, event.source)
            self._hold(seq, block)
        elif kind == "released":
            self._drop(seq, block)
        elif kind in ("freed", "cached"):
            self._drop(seq, block)
            self._kept[block] = event.tokens if kind == "cached" else -1
        elif kind == "evicted":
            self._kept[block] = -1
            self._touched.add(block)
        elif kind == "resized":
            self._resize(seq, event.tokens)
        elif kind == "lookup":
            self._queried += event.queried
            self._hit += event.tokens
        if kind in ("hit", "copied"):
            self._serial += 1
            self._marks[block] = (self._serial, kind)
        self._snap = None

    def _hold(self, seq: int, block: int) -> None:
        table = self._tables.setdefault(seq, [])
        self._index[block] = len(table)
        table.append(block)
        self._holders[block].add(seq)
        self._touched.add(block)

    def _drop(self, seq: int, block: int) -> None:
        table = self._tables[seq]
        if table[-1] == block:  # rollback and free drop from the end
            table.pop()
        else:
            table.remove(block)
        if not table:
            del self._tables[seq]
            self._lengths.pop(seq, None)
        self._holders[block].discard(seq)
        self._touched.add(block)

    def _resize(self, seq: int, length: int) -> None:
        """A sequence's reserved slots changed: its blocks from the shorter length's block on
        refill."""
        old = self._lengths.get(seq, 0)
        self._lengths[seq] = length
        self._touched.update(self._tables.get(seq, [])[min(old, length) // self.block_size :])

    def held(self, seq: int) -> tuple[int, int]:
        """(blocks the sequence holds, how many of them another sequence holds too)."""
        table = self._tables.get(seq, ())
        return len(table), sum(len(self._holders[b]) > 1 for b in table)

    def snapshot(self) -> BlockSnapshot:
        """The pool now; the same object until the next event, so polling is cheap."""
        if self._snap is None:
            for b in self._touched:
                self._refresh(b)
            self._touched = set()
            self._snap = self._build()
        return self._snap

    def _info(self, b: int) -> BlockInfo:
        """The block's record from its holders, their lengths, and what a cached block keeps."""
        holders, mark = self._holders[b], self._marks.get(b, (0, ""))
        if not holders:
            kept = self._kept[b]
            return BlockInfo(b, "free" if kept < 0 else "cached", 0, (), max(kept, 0), *mark)
        start = self._index[b] * self.block_size
        filled = max(min(self.block_size, self._lengths[s] - start) for s in holders)
        return BlockInfo(b, "used", len(holders), tuple(sorted(holders)), filled, *mark)

    def _refresh(self, b: int) -> None:
        """Replace a touched block's record, keeping the totals up to date."""
        new, old = self._info(b), self._infos[b]
        if new == old:
            return
        self._num_used += (new.state == "used") - (old.state == "used")
        self._num_shared += (new.ref_count > 1) - (old.ref_count > 1)
        self._num_cached += (new.state == "cached") - (old.state == "cached")
        self._tokens_stored += (new.filled if new.ref_count else 0) - (
            old.filled if old.ref_count else 0
        )
        self._infos[b] = new

    def _build(self) -> BlockSnapshot:
        num_used = self._num_used
        return BlockSnapshot(
            block_size=self.block_size,
            blocks=tuple(self._infos),
            num_used=num_used,
            num_cached=self._num_cached,
            num_free=self.num_blocks - num_used - self._num_cached,
            num_shared=self._num_shared,
            tokens_stored=self._tokens_stored,
            slots_reserved=num_used * self.block_size,
            prefix_queried_tokens=self._queried,
            prefix_hit_tokens=self._hit,
            serial=self._serial,
        )
