"""BlockManager: which physical KV blocks each sequence holds, shared prefixes and copy-on-write."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

# A block's prefix-cache key is (chained hash of the blocks before it, its tokens); the next
# block chains on hash(key). Keying the registry by the whole key, not by hash(key) alone, makes
# the dict compare the tokens on every lookup, so colliding hashes never alias two blocks.
# Python's hash of ints and tuples is unsalted, so keys are stable across processes too.
# A key holding fewer than block_size tokens is a partial tail: a finished sequence's last block,
# kept so that a chat's next turn, whose prompt extends it, need not recompute those tokens. A
# key claims only its first len(tokens) slots; whoever holds the block may write after them.
_Key = tuple[int, tuple[int, ...]]
_ROOT = 0  # the "previous hash" of a sequence's first block


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One physical block as the UI sees it."""

    block_id: int
    state: str  # "used" | "cached" (ref 0 but holds a registered prefix) | "free"
    ref_count: int
    owners: tuple[int, ...]  # seq ids holding it, sorted
    filled: int  # slots holding tokens


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

    @property
    def fragmentation(self) -> float:
        """Share of reserved slots that hold no token (0 when nothing is used)."""
        return 1 - self.tokens_stored / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over queried tokens (0 when nothing was queried)."""
        return (
            self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens
            else 0.0
        )


class BlockManager:
    """Free list, ref counts, prefix cache, copy-on-write and rollback over a pool of KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 registered blocks, LRU first
        self._registry: dict[_Key, int] = {}  # prefix key -> block
        self._block_key: dict[int, _Key] = {}  # block -> its prefix key (the inverse)
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._hashes: dict[
            int, list[int]
        ] = {}  # chained hashes of each seq's committed full blocks
        self._queried = self._hit = 0
        self._snap: BlockSnapshot | None = None  # cached until the next mutation
        self._infos = [
            BlockInfo(b, "free", 0, (), 0) for b in range(num_blocks)
        ]  # as last snapshotted
        self._touched: set[int] = set()  # blocks taken, released or evicted since the last snapshot
        self._num_shared = self._tokens_stored = 0  # totals over self._infos, kept up to date

    # ---- queries -------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks obtainable now: the free list plus evictable cached-free blocks."""
        return len(self._free) + len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover num_tokens slots."""
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._tables[seq_id])

    def length(self, seq_id: int) -> int:
        """Slots reserved for the sequence."""
        return self._lengths[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        """Flat pool slot of a token position of the sequence."""
        bs = self.block_size
        return self._tables[seq_id][position // bs] * bs + position % bs

    # ---- allocate / append / fork ----------------------------------------------------------

    def can_allocate(self, token_ids: list[int]) -> bool:
        """Would allocate() succeed now for these tokens."""
        hits, _ = self._match(token_ids)
        revived = sum(
            1 for b in hits if self._ref[b] == 0
        )  # a cached-free hit is no longer evictable
        return self.blocks_needed(len(token_ids)) - len(hits) <= self.num_free_blocks() - revived

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        """Create the sequence's table, reusing cached prefix blocks; return the number of hit tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(token_ids):
            raise ValueError(f"not enough free KV blocks for sequence {seq_id}")
        hits, hashes = self._match(token_ids)
        hit_tokens = len(hashes) * self.block_size
        if len(hits) > len(hashes):  # the last hit is a partial tail
            hit_tokens += len(self._block_key[hits[-1]][1])
        # Take the hits before popping fresh blocks, so eviction cannot reclaim a block we just matched.
        for b in hits:
            self._take(b)
        fresh = [self._pop_free() for _ in range(self.blocks_needed(len(token_ids)) - len(hits))]
        self._tables[seq_id], self._lengths[seq_id] = hits + fresh, len(token_ids)
        self._hashes[seq_id] = hashes
        if self.enable_prefix_cache:
            self._queried += len(token_ids)
            self._hit += hit_tokens
        self._snap = None
        return hit_tokens

    def can_append(self, seq_id: int, num_slots: int) -> bool:
        """Would append(seq_id, num_slots) succeed now."""
        grow = self.blocks_needed(self._lengths[seq_id] + num_slots) - len(self._tables[seq_id])
        return grow + self._needs_cow(seq_id, num_slots) <= self.num_free_blocks()

    def append(self, seq_id: int, num_slots: int) -> list[tuple[int, int]]:
        """Reserve num_slots more slots; return (old, new) block pairs whose KV the engine must copy."""
        if num_slots < 0 or not self.can_append(seq_id, num_slots):
            raise ValueError(f"cannot append {num_slots} slots to sequence {seq_id}")
        table, length = self._tables[seq_id], self._lengths[seq_id]
        pairs = []
        if self._needs_cow(seq_id, num_slots):
            old, new = table[-1], self._pop_free()
            self._ref[old] -= 1  # stays >= 1: the other holders keep it
            table[-1] = new
            pairs.append((old, new))
        elif (
            num_slots
            and length % self.block_size
            and self._claims_from(table[-1], length % self.block_size)
        ):
            # Sole holder writing into slots a registered block's key claims (it was left partial by a
            # rollback while shared): their content is about to change, so it no longer answers for its prefix.
            self._unregister(table[-1])
        table.extend(
            self._pop_free() for _ in range(self.blocks_needed(length + num_slots) - len(table))
        )
        self._lengths[seq_id] = length + num_slots
        self._snap = None
        return pairs

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give child_id the parent's table and length, sharing every block (ref +1)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self._tables[parent_id]
        for b in table:
            self._ref[b] += 1
        self._tables[child_id], self._lengths[child_id] = list(table), self._lengths[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])
        self._snap = None

    # ---- shrink / release --------------------------------------------------------------------

    def rollback(self, seq_id: int, num_slots: int) -> None:
        """Drop the last num_slots slots of the sequence (rejected speculative tokens)."""
        length = self._lengths[seq_id] - num_slots
        if num_slots < 0 or length < 0:
            raise ValueError(f"cannot roll back {num_slots} slots of sequence {seq_id}")
        table, bs = self._tables[seq_id], self.block_size
        keep = self.blocks_needed(length)
        for b in reversed(table[keep:]):
            self._release(b)
        del table[keep:]
        del self._hashes[seq_id][length // bs :]
        self._lengths[seq_id] = length
        if length % bs and self._ref[table[-1]] == 1 and self._claims_from(table[-1], length % bs):
            # We alone hold it and will overwrite slots its key claims; a shared one stays registered
            # because the next append copies it first (COW), leaving the registered content intact.
            self._unregister(table[-1])
        self._snap = None

    def free(self, seq_id: int, token_ids: list[int] | None = None, num_computed: int = 0) -> None:
        """Drop the sequence; blocks reaching ref 0 become cached-free if registered, else free.

        Given the sequence's tokens and how many have KV, a partly filled last computed block that
        only this sequence holds is registered as a partial tail first, so a prompt extending those
        tokens (the next turn of a chat) finds them; full blocks are committed by commit() as they fill.
        """
        if token_ids is not None and self.enable_prefix_cache:
            self._register_tail(seq_id, token_ids, num_computed)
        table = self._tables.pop(seq_id)
        del self._lengths[seq_id], self._hashes[seq_id]
        # Release the tail first: it enters the LRU first and so is evicted first, because a tail
        # block can only ever be hit together with the prefix blocks before it.
        for b in reversed(table):
            self._release(b)
        self._snap = None

    # ---- prefix cache ------------------------------------------------------------------------

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register every full block within the first num_computed tokens that is not registered yet."""
        if not self.enable_prefix_cache:
            return
        table, hashes, bs = self._tables[seq_id], self._hashes[seq_id], self.block_size
        full = min(num_computed, self._lengths[seq_id], len(token_ids)) // bs
        prev = hashes[-1] if hashes else _ROOT
        for i in range(len(hashes), full):
            key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
            old = self._block_key.get(table[i])
            if (
                old is not None and len(old[1]) < bs
            ):  # a revived partial tail, now full: its full key says more
                self._unregister(table[i])
            # An existing mapping wins: the same prefix may already live in another block.
            if key not in self._registry and table[i] not in self._block_key:
                self._register(table[i], key)
            prev = hash(key)
            hashes.append(prev)
        self._snap = None

    def snapshot(self) -> BlockSnapshot:
        """The pool as the UI shows it; rebuilt only after a mutation, so polling is cheap."""
        if self._snap is None:
            self._snap = self._build_snapshot()
        return self._snap

    # ---- private helpers -----------------------------------------------------------------------

    def _match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Registered blocks matching a prefix of token_ids, and the chained hashes of the full ones.

        After the full blocks, a cached-free partial tail may match the next few tokens (the longest
        one wins); it is the last hit, and has no hash. One held by a live sequence is no hit: that
        sequence writes after the tail's tokens, where this one would write its own.
        """
        hits: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_cache:
            return hits, hashes
        bs, prev = self.block_size, _ROOT
        # Stop one token short: the engine must compute at least the last token to get its logits.
        last = len(token_ids) - 1
        for i in range(last // bs):
            key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._registry.get(key)
            if block is None:
                break  # hits are a prefix only: block i's KV depends on every token before it
            prev = hash(key)
            hits.append(block)
            hashes.append(prev)
        start = len(hits) * bs
        for n in range(min(bs - 1, last - start), 0, -1):
            block = self._registry.get((prev, tuple(token_ids[start : start + n])))
            if block is not None and block in self._cached:
                hits.append(block)
                break
        return hits, hashes

    def _register_tail(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register the sequence's partly filled last computed block under a partial key (see free)."""
        table, hashes, bs = self._tables[seq_id], self._hashes[seq_id], self.block_size
        computed = min(num_computed, self._lengths[seq_id], len(token_ids))
        full, n = divmod(computed, bs)
        if not n or len(hashes) != full or self._ref[table[full]] != 1:
            return  # nothing partial, its full blocks not all committed, or shared with another holder
        key = (hashes[-1] if hashes else _ROOT, tuple(token_ids[full * bs : computed]))
        old = self._block_key.get(table[full])
        if key in self._registry or (old is not None and len(old[1]) == bs):
            return  # the same tail lives in a block already, or this block answers for a full prefix
        if old is not None:
            self._unregister(table[full])  # a shorter tail this sequence revived and extended
        self._register(table[full], key)

    def _claims_from(self, block: int, slot: int) -> bool:
        """Whether the block is registered under a key claiming slot `slot` or later (writing there breaks it)."""
        key = self._block_key.get(block)
        return key is not None and len(key[1]) > slot

    def _needs_cow(self, seq_id: int, num_slots: int) -> bool:
        """Whether the first new slot lands in a shared block that already holds our slots."""
        length = self._lengths[seq_id]
        return bool(
            num_slots and length % self.block_size and self._ref[self._tables[seq_id][-1]] > 1
        )

    def _take(self, block: int) -> None:
        """Add a holder to a hit block, reviving it from the LRU if it was cached-free."""
        if self._ref[block] == 0:
            del self._cached[block]
        self._ref[block] += 1
        self._touched.add(block)

    def _pop_free(self) -> int:
        """A fresh block with ref 1: from the free list, else by evicting the LRU cached block."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
        self._ref[block] = 1
        self._touched.add(block)
        return block

    def _release(self, block: int) -> None:
        """Drop one holder; at ref 0 keep a registered block as cached-free (newest in LRU)."""
        self._ref[block] -= 1
        self._touched.add(block)
        if self._ref[block] == 0:
            if block in self._block_key:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _register(self, block: int, key: _Key) -> None:
        """Let the block answer for the prefix key."""
        self._registry[key], self._block_key[block] = block, key

    def _unregister(self, block: int) -> None:
        """Forget the prefix a block answered for."""
        del self._registry[self._block_key.pop(block)]

    def _build_snapshot(self) -> BlockSnapshot:
        """Build the BlockSnapshot in O(blocks in use), not O(pool): a 100k-block pool is snapshotted every step.

        A block's fields change only while it is in a table or as it enters or leaves one (_take,
        _pop_free, _release mark it touched), so every other block's BlockInfo is still true; the
        totals are updated by the changed blocks only.
        """
        bs = self.block_size
        owners: dict[int, list[int]] = {}
        filled: dict[int, int] = {}
        for sid in sorted(self._tables):  # sorted ids make every owners list sorted for free
            left = self._lengths[sid]
            for b in self._tables[sid]:
                owners.setdefault(b, []).append(sid)
                filled[b] = max(filled.get(b, 0), min(bs, left))
                left -= bs
        for b in self._touched.union(owners):
            ref = self._ref[b]
            state = "used" if ref else "cached" if b in self._cached else "free"
            kept = len(self._block_key[b][1]) if state == "cached" else 0
            info = (state, ref, tuple(owners.get(b, ())), filled[b] if ref else kept)
            old = self._infos[b]
            if info != (old.state, old.ref_count, old.owners, old.filled):
                self._num_shared += (ref > 1) - (old.ref_count > 1)
                self._tokens_stored += (info[3] if ref else 0) - (
                    old.filled if old.ref_count else 0
                )
                self._infos[b] = BlockInfo(b, *info)
        self._touched = set()
        num_cached, num_free = len(self._cached), len(self._free)
        num_used = self.num_blocks - num_cached - num_free
        return BlockSnapshot(
            block_size=bs,
            blocks=tuple(self._infos),
            num_used=num_used,
            num_cached=num_cached,
            num_free=num_free,
            num_shared=self._num_shared,
            tokens_stored=self._tokens_stored,
            slots_reserved=num_used * bs,
            prefix_queried_tokens=self._queried,
            prefix_hit_tokens=self._hit,
        )
