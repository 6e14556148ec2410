"""BlockManager: which physical KV blocks each sequence holds, shared prefixes and copy-on-write.

Every change is announced as a BlockEvent to the observers (the block map the app draws, a step's
event list); the manager itself keeps only what allocation needs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

# A block's prefix-cache key is (chained hash of the blocks before it, its tokens); the next block
# chains on hash(key). Keying the registry by the whole key, not by hash(key) alone, makes the dict
# compare the tokens on every lookup, so colliding hashes never alias two blocks. Python's hash of
# ints and tuples is unsalted, so keys are stable across processes too. A key holding fewer than
# block_size tokens is a partial tail: a finished sequence's last block, kept so that a chat's next
# turn, whose prompt extends it, need not recompute those tokens. A key claims only its first
# len(tokens) slots; whoever holds the block may write after them.
_Key = tuple[int, tuple[int, ...]]
_ROOT = 0  # the "previous hash" of a sequence's first block


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change to the pool, as the allocator makes it; observers build their views from these.

    kinds: "allocated" (a fresh block for seq_id), "hit" (a prefix-cache block taken by seq_id),
    "shared" (a block forked to seq_id), "copied" (copy-on-write: seq_id's last block `source`
    replaced by the fresh `block`), "released" (seq_id dropped `block`, others still hold it),
    "freed" / "cached" (seq_id dropped the block's last reference; a cached block keeps `tokens`
    tokens for the prefix cache), "evicted" (a cached block reclaimed), "resized" (seq_id now
    reserves `tokens` slots), "lookup" (an admission looked `queried` tokens up, `tokens` hit),
    "swapped_out" / "swapped_in" (seq_id's `tokens` tokens of KV left for the host pool, before
    its blocks are dropped / came back, into the blocks allocated next), "stored" / "removed" (a
    full block's prefix entered / left the prefix cache: its chained hash `key`, the `parent`
    block's hash (None for a first block) and its `token_ids`: what vLLM's KV events carry).
    """

    kind: str
    seq_id: int = -1
    block: int = -1
    tokens: int = 0
    queried: int = 0
    source: int = -1
    key: int | None = None
    parent: int | None = None
    token_ids: tuple[int, ...] = ()


Observer = Callable[[BlockEvent], None]


class BlockManager:
    """Free list, ref counts, prefix cache, copy-on-write and rollback over a pool of KV blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        observers: tuple[Observer, ...] = (),
    ) -> None:
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
        self.observers = list(observers)

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
        """Create the sequence's table, reusing cached prefix blocks; return the number of hit
        tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(token_ids):
            raise ValueError(f"not enough free KV blocks for sequence {seq_id}")
        hits, hashes = self._match(token_ids)
        hit_tokens = len(hashes) * self.block_size
        if len(hits) > len(hashes):  # the last hit is a partial tail
            hit_tokens += len(self._block_key[hits[-1]][1])
        # Take the hits before popping fresh blocks, so eviction cannot reclaim a block we just
        # matched.
        for b in hits:
            self._take(b, seq_id, "hit")
        fresh = [
            self._pop_free(seq_id) for _ in range(self.blocks_needed(len(token_ids)) - len(hits))
        ]
        self._tables[seq_id], self._lengths[seq_id] = hits + fresh, len(token_ids)
        self._hashes[seq_id] = hashes
        self._emit(BlockEvent("resized", seq_id, tokens=len(token_ids)))
        if self.enable_prefix_cache:
            self._emit(BlockEvent("lookup", seq_id, tokens=hit_tokens, queried=len(token_ids)))
        return hit_tokens

    def can_append(self, seq_id: int, num_slots: int) -> bool:
        """Would append(seq_id, num_slots) succeed now."""
        grow = self.blocks_needed(self._lengths[seq_id] + num_slots) - len(self._tables[seq_id])
        return grow + self._needs_cow(seq_id, num_slots) <= self.num_free_blocks()

    def append(self, seq_id: int, num_slots: int) -> list[tuple[int, int]]:
        """Reserve num_slots more slots; return (old, new) block pairs whose KV the engine must
        copy."""
        if num_slots < 0 or not self.can_append(seq_id, num_slots):
            raise ValueError(f"cannot append {num_slots} slots to sequence {seq_id}")
        table, length = self._tables[seq_id], self._lengths[seq_id]
        pairs = []
        if self._needs_cow(seq_id, num_slots):
            old, new = table[-1], self._pop_free(seq_id, announce=False)
            self._ref[old] -= 1  # stays >= 1: the other holders keep it
            table[-1] = new
            pairs.append((old, new))
            self._emit(BlockEvent("copied", seq_id, new, source=old))
        elif (
            num_slots
            and length % self.block_size
            and self._claims_from(table[-1], length % self.block_size)
        ):
            # Sole holder writing into slots a registered block's key claims (it was left partial by
            # a rollback while shared): their content is about to change, so it no longer answers
            # for its prefix.
            self._unregister(table[-1])
        table.extend(
            self._pop_free(seq_id)
            for _ in range(self.blocks_needed(length + num_slots) - len(table))
        )
        self._resize(seq_id, length + num_slots)
        return pairs

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give child_id the parent's table and length, sharing every block (ref +1)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self._tables[parent_id]
        for b in table:
            self._take(b, child_id, "shared")
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])
        self._resize(child_id, self._lengths[parent_id])

    # ---- shrink / release --------------------------------------------------------------------

    def rollback(self, seq_id: int, num_slots: int) -> None:
        """Drop the last num_slots slots of the sequence (rejected speculative tokens)."""
        length = self._lengths[seq_id] - num_slots
        if num_slots < 0 or length < 0:
            raise ValueError(f"cannot roll back {num_slots} slots of sequence {seq_id}")
        table, bs = self._tables[seq_id], self.block_size
        keep = self.blocks_needed(length)
        for b in reversed(table[keep:]):
            self._release(b, seq_id)
        del table[keep:]
        del self._hashes[seq_id][length // bs :]
        self._resize(seq_id, length)
        if length % bs and self._ref[table[-1]] == 1 and self._claims_from(table[-1], length % bs):
            # We alone hold it and will overwrite slots its key claims; a shared one stays
            # registered because the next append copies it first (COW), leaving the registered
            # content intact.
            self._unregister(table[-1])

    def free(self, seq_id: int, token_ids: list[int] | None = None, num_computed: int = 0) -> None:
        """Drop the sequence; blocks reaching ref 0 become cached-free if registered, else free.

        Given the sequence's tokens and how many have KV, a partly filled last computed block that
        only this sequence holds is registered as a partial tail first, so a prompt extending those
        tokens (the next turn of a chat) finds them; full blocks are committed by commit() as they
        fill.
        """
        if token_ids is not None and self.enable_prefix_cache:
            self._register_tail(seq_id, token_ids, num_computed)
        table = self._tables.pop(seq_id)
        del self._lengths[seq_id], self._hashes[seq_id]
        # Release the tail first: it enters the LRU first and so is evicted first, because a tail
        # block can only ever be hit together with the prefix blocks before it.
        for b in reversed(table):
            self._release(b, seq_id)

    # ---- swap --------------------------------------------------------------------------------

    def swap_out(self, seq_id: int, token_ids: list[int], num_computed: int) -> list[int]:
        """Drop the sequence as free() does; return the blocks holding its first num_computed
        tokens' KV, which the caller copies out before anything writes them."""
        saved = self._tables[seq_id][: self.blocks_needed(num_computed)]
        self._emit(BlockEvent("swapped_out", seq_id, tokens=num_computed))
        self.free(seq_id, token_ids, num_computed)
        return saved

    def can_swap_in(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks()

    def swap_in(self, seq_id: int, num_tokens: int) -> list[int]:
        """A fresh table for a swapped-out sequence's num_tokens computed tokens; the caller
        copies their KV in."""
        if seq_id in self._tables or not self.can_swap_in(num_tokens):
            raise ValueError(f"cannot swap sequence {seq_id} in")
        table = [self._pop_free(seq_id) for _ in range(self.blocks_needed(num_tokens))]
        self._tables[seq_id], self._hashes[seq_id] = table, []
        self._emit(BlockEvent("swapped_in", seq_id, tokens=num_tokens))
        self._resize(seq_id, num_tokens)
        return table

    # ---- prefix cache ------------------------------------------------------------------------

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register every full block within the first num_computed tokens that is not registered
        yet."""
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

    # ---- private helpers -----------------------------------------------------------------------

    def _match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Registered blocks matching a prefix of token_ids, and the chained hashes of the full
        ones.

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
        """Register the sequence's partly filled last computed block under a partial key (see
        free)."""
        table, hashes, bs = self._tables[seq_id], self._hashes[seq_id], self.block_size
        computed = min(num_computed, self._lengths[seq_id], len(token_ids))
        full, n = divmod(computed, bs)
        if not n or len(hashes) != full or self._ref[table[full]] != 1:
            # nothing partial, its full blocks not all committed, or shared with another holder
            return
        key = (hashes[-1] if hashes else _ROOT, tuple(token_ids[full * bs : computed]))
        old = self._block_key.get(table[full])
        if key in self._registry or (old is not None and len(old[1]) == bs):
            # the same tail lives in a block already, or this block answers for a full prefix
            return
        if old is not None:
            self._unregister(table[full])  # a shorter tail this sequence revived and extended
        self._register(table[full], key)

    def _claims_from(self, block: int, slot: int) -> bool:
        """Whether the block is registered under a key claiming slot `slot` or later (writing there
        breaks it)."""
        key = self._block_key.get(block)
        return key is not None and len(key[1]) > slot

    def _needs_cow(self, seq_id: int, num_slots: int) -> bool:
        """Whether the first new slot lands in a shared block that already holds our slots."""
        length = self._lengths[seq_id]
        return bool(
            num_slots and length % self.block_size and self._ref[self._tables[seq_id][-1]] > 1
        )

    def _emit(self, event: BlockEvent) -> None:
        for observer in self.observers:
            observer(event)

    def _resize(self, seq_id: int, length: int) -> None:
        self._lengths[seq_id] = length
        self._emit(BlockEvent("resized", seq_id, tokens=length))

    def _take(self, block: int, seq_id: int, kind: str) -> None:
        """Add seq_id as a holder of a block with content (a hit, or a fork), reviving a cached
        one."""
        if self._ref[block] == 0:
            del self._cached[block]
        self._ref[block] += 1
        self._emit(BlockEvent(kind, seq_id, block))

    def _pop_free(self, seq_id: int, announce: bool = True) -> int:
        """A fresh block with ref 1 for seq_id: from the free list, else by evicting the LRU cached
        block.

        A copy-on-write target is announced by its own "copied" event (announce=False)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
            self._emit(BlockEvent("evicted", block=block))
        self._ref[block] = 1
        if announce:
            self._emit(BlockEvent("allocated", seq_id, block))
        return block

    def _release(self, block: int, seq_id: int) -> None:
        """Drop seq_id's hold; at ref 0 keep a registered block as cached-free (newest in LRU)."""
        self._ref[block] -= 1
        if self._ref[block]:
            self._emit(BlockEvent("released", seq_id, block))
        elif block in self._block_key:
            self._cached[block] = None
            self._emit(BlockEvent("cached", seq_id, block, tokens=len(self._block_key[block][1])))
        else:
            self._free.append(block)
            self._emit(BlockEvent("freed", seq_id, block))

    def _register(self, block: int, key: _Key) -> None:
        """Let the block answer for the prefix key (a full one is announced as stored)."""
        self._registry[key], self._block_key[block] = block, key
        if len(key[1]) == self.block_size:
            parent = None if key[0] == _ROOT else key[0]
            self._emit(
                BlockEvent("stored", block=block, key=hash(key), parent=parent, token_ids=key[1])
            )

    def _unregister(self, block: int) -> None:
        """Forget the prefix a block answered for (a full one is announced as removed)."""
        key = self._block_key.pop(block)
        del self._registry[key]
        if len(key[1]) == self.block_size:
            self._emit(BlockEvent("removed", block=block, key=hash(key)))
