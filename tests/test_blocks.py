"""BlockManager: unit tests for each rule, and a stateful property test over random operation
mixes."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagechat.core.blockmap import BlockMap
from pagechat.core.blocks import _ROOT, BlockEvent, BlockManager


def run(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Allocate and 'compute' a whole prompt, registering its full blocks; return hit tokens."""
    hit = bm.allocate(seq_id, tokens)
    bm.commit(seq_id, tokens, len(tokens))
    return hit


# ---- unit tests -----------------------------------------------------------------------------


def watched(*args, **kwargs) -> BlockManager:
    """A BlockManager with a BlockMap built from its events (bm.map), as the engine keeps one."""
    bm = BlockManager(*args, **kwargs)
    bm.map = BlockMap.watching(bm)
    return bm


def test_allocate_append_free_arithmetic():
    bm = watched(num_blocks=8, block_size=4)
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2
    assert bm.allocate(1, list(range(6))) == 0
    assert len(bm.table(1)) == 2 and bm.length(1) == 6 and bm.num_free_blocks() == 6
    assert bm.append(1, 2) == [] and len(bm.table(1)) == 2  # slots 6, 7 fit the second block
    assert bm.append(1, 1) == [] and len(bm.table(1)) == 3 and bm.length(1) == 9
    t = bm.table(1)
    assert bm.slot(1, 0) == t[0] * 4 and bm.slot(1, 5) == t[1] * 4 + 1 and bm.slot(1, 8) == t[2] * 4
    assert bm.can_append(1, 23) and not bm.can_append(1, 24)  # 5 free blocks + 3 slots left
    bm.free(1)
    assert bm.num_free_blocks() == 8 and bm.map.snapshot().num_used == 0


def test_allocate_errors():
    bm = watched(num_blocks=2, block_size=4)
    assert not bm.can_allocate(list(range(9)))
    with pytest.raises(ValueError):
        bm.allocate(1, list(range(9)))
    bm.allocate(1, [1, 2])
    with pytest.raises(ValueError):
        bm.allocate(1, [3])
    with pytest.raises(ValueError):
        bm.append(1, 7)  # would need 2 more blocks, only 1 left


def test_prefix_hit_after_commit_and_free_reuses_blocks():
    bm = watched(num_blocks=8, block_size=4)
    prompt = list(range(10))
    run(bm, 1, prompt)
    first = bm.table(1)
    bm.free(1)
    assert (
        bm.map.snapshot().num_cached == 2
    )  # the two full blocks; the partial third went to the free list
    assert bm.allocate(2, prompt + [99]) == 8
    assert bm.table(2)[:2] == first[:2]
    snap = bm.map.snapshot()
    assert (snap.prefix_queried_tokens, snap.prefix_hit_tokens) == (21, 8)
    assert snap.hit_rate == pytest.approx(8 / 21)


def test_live_sequences_share_prefix_blocks():
    bm = watched(num_blocks=8, block_size=4)
    run(bm, 1, list(range(9)))
    assert bm.allocate(2, list(range(8)) + [42]) == 8
    assert bm.table(1)[:2] == bm.table(2)[:2] and bm.table(1)[2] != bm.table(2)[2]
    assert bm.map.snapshot().num_shared == 2


def test_no_hit_for_uncommitted_blocks():
    bm = watched(num_blocks=8, block_size=4)
    prompt = list(range(12))
    bm.allocate(1, prompt)
    bm.commit(1, prompt, 7)  # only block 0 lies entirely in the computed tokens
    assert bm.allocate(2, prompt) == 4
    bm.free(2)
    bm.free(1)
    assert bm.allocate(3, prompt) == 4


def test_hit_requires_same_chain():
    bm = watched(num_blocks=8, block_size=2)
    run(bm, 1, [1, 2, 3, 4, 5])
    assert (
        bm.allocate(2, [9, 9, 3, 4, 5]) == 0
    )  # block [3, 4] matches, but after a different prefix


def test_hits_leave_the_last_token_to_compute():
    bm = watched(num_blocks=8, block_size=4)
    prompt = list(range(8))
    run(bm, 1, prompt)
    bm.free(1)
    assert bm.allocate(2, prompt) == 4  # (8 - 1) // 4 = 1 hit block, even though both are cached
    assert bm.length(2) == 8 and len(bm.table(2)) == 2


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = watched(num_blocks=5, block_size=2)
    run(bm, 1, [1, 1, 1, 2, 0])  # a0 a1 registered + a partial block
    run(bm, 2, [2, 2, 0])  # b0 registered + a partial block -> pool full
    a, b = bm.table(1), bm.table(2)
    bm.free(1)
    bm.free(2)
    assert list(bm._cached) == [a[1], a[0], b[0]]  # a's tail before its head, then b
    bm.allocate(3, [7] * 6)  # 3 fresh blocks: the 2 free ones, then evict a1
    assert a[1] in bm.table(3) and bm.num_free_blocks() == 2
    assert bm.allocate(4, [1, 1, 9]) == 2 and bm.table(4)[0] == a[0]  # a0 hit; b0 evicted
    bm.free(3)
    assert bm.allocate(5, [2, 2, 9]) == 0


def test_hit_moves_block_out_of_lru():
    bm = watched(num_blocks=3, block_size=2)
    run(bm, 1, [1, 1, 0])
    bm.free(1)
    assert bm.num_free_blocks() == 3
    assert bm.can_allocate([1, 1, 0, 0, 0])  # hit revives block 0; two fresh blocks remain
    assert not bm.can_allocate([1, 1, 0, 0, 0, 0, 0])  # the revived block is not evictable too
    assert bm.allocate(2, [1, 1, 0]) == 2
    assert bm.map.snapshot().blocks[bm.table(2)[0]].state == "used" and not bm._cached


def test_cow_after_fork():
    bm = watched(num_blocks=8, block_size=4)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    assert bm.table(1) == bm.table(2) and bm.length(2) == 6
    old = bm.table(1)[1]
    pairs = bm.append(2, 1)
    assert pairs == [(old, bm.table(2)[1])] and bm.table(2)[1] != old
    assert bm.table(2)[0] == bm.table(1)[0] and bm.table(1)[1] == old
    assert bm.append(1, 1) == []  # the parent is now the only holder of the old block
    assert bm.append(1, 2) == []  # a block boundary: the new slots go to a fresh block, no copy


def test_fork_at_block_boundary_needs_no_copy():
    bm = watched(num_blocks=8, block_size=4)
    bm.allocate(1, list(range(8)))
    bm.fork(1, 2)
    assert bm.append(1, 1) == [] and bm.append(2, 1) == []
    assert bm.table(1)[2] != bm.table(2)[2]


def test_rollback_across_block_boundary_frees_emptied_block():
    bm = watched(num_blocks=8, block_size=4)
    bm.allocate(1, list(range(3)))
    bm.append(1, 4)  # 7 slots, 2 blocks
    second = bm.table(1)[1]
    bm.rollback(1, 4)
    assert bm.length(1) == 3 and len(bm.table(1)) == 1 and bm.num_free_blocks() == 7
    assert bm.map.snapshot().blocks[second].state == "free"


def test_rollback_into_registered_block_unregisters_it():
    bm = watched(num_blocks=8, block_size=4)
    run(bm, 1, list(range(9)))  # blocks 0 and 1 registered
    bm.rollback(1, 2)  # length 7: block 1 is partial again and only ours
    assert bm.allocate(2, list(range(9))) == 4  # block 0 still hits, block 1 no longer


def test_rollback_into_shared_registered_block_keeps_it_and_cows():
    bm = watched(num_blocks=8, block_size=4)
    run(bm, 1, list(range(9)))
    assert bm.allocate(2, list(range(9))) == 8
    shared = bm.table(1)[1]
    bm.rollback(1, 2)  # seq 2 still holds block 1 whole
    pairs = bm.append(1, 1)
    assert pairs == [(shared, bm.table(1)[1])]
    assert bm.allocate(3, list(range(9))) == 8 and bm.table(3)[1] == shared


def test_sole_holder_append_into_registered_partial_block_unregisters():
    bm = watched(num_blocks=8, block_size=4)
    run(bm, 1, list(range(9)))
    bm.allocate(2, list(range(9)))
    bm.rollback(1, 2)  # shared: stays registered
    bm.free(2)  # now seq 1 alone holds it, partially
    assert bm.append(1, 1) == []
    assert bm.allocate(3, list(range(9))) == 4


def test_rollback_then_regrowth_registers_the_new_content():
    bm = watched(num_blocks=8, block_size=2)
    run(bm, 1, [1, 2, 3, 4, 5])
    bm.rollback(1, 3)  # back to [1, 2]; block [3, 4] is emptied
    bm.append(1, 3)
    bm.commit(1, [1, 2, 7, 8, 9], 5)
    assert bm.allocate(2, [1, 2, 7, 8, 0]) == 4  # [7, 8] registered, chained after [1, 2]
    assert bm.allocate(3, [1, 2, 3, 4, 0]) == 4  # the old [3, 4] block still answers too


def test_finished_tail_is_a_partial_hit_for_the_next_turn():
    bm = watched(num_blocks=8, block_size=4)
    turn1 = list(range(10))  # two full blocks and a tail of 2
    run(bm, 1, turn1)
    first = bm.table(1)
    bm.free(1, turn1, 10)
    snap = bm.map.snapshot()
    assert sorted(b.filled for b in snap.blocks if b.state == "cached") == [2, 4, 4]
    assert bm.allocate(2, turn1 + [50, 51]) == 10  # only the new tokens are left to compute
    assert bm.table(2) == first
    assert bm.map.snapshot().prefix_hit_tokens == 10


def test_partial_tail_held_by_a_live_sequence_is_no_hit():
    bm = watched(num_blocks=8, block_size=4)
    turn1 = list(range(10))
    run(bm, 1, turn1)
    bm.free(1, turn1, 10)
    run(bm, 2, turn1 + [50])  # revives the tail and writes slot 3 of it
    assert bm.allocate(3, turn1 + [60, 61]) == 8  # sharing it would overwrite seq 2's slot 3
    assert bm.table(3)[:2] == bm.table(2)[:2] and bm.table(3)[2] != bm.table(2)[2]


def test_tail_of_a_shared_block_is_not_registered_until_its_last_holder_frees():
    bm = watched(num_blocks=8, block_size=4)
    turn1 = list(range(10))
    run(bm, 1, turn1)
    bm.fork(1, 2)
    bm.free(1, turn1, 10)
    assert bm.allocate(3, turn1 + [50]) == 8
    bm.free(3)
    bm.free(2, turn1, 10)
    assert bm.allocate(4, turn1 + [50]) == 10


def test_revived_tail_once_full_answers_under_its_full_key():
    bm = watched(num_blocks=8, block_size=4)
    turn1, turn2 = list(range(10)), list(range(10)) + [50, 51, 52]
    run(bm, 1, turn1)
    bm.free(1, turn1, 10)
    assert run(bm, 2, turn2) == 10  # fills the tail block: committed under (chain, 8, 9, 50, 51)
    bm.free(2, turn2, 13)
    assert bm.allocate(3, turn2 + [7]) == 13  # three full blocks and the new tail [52]
    bm.free(3)
    assert bm.allocate(4, turn1 + [70, 71]) == 8  # the 2-token tail key gave way to the full key


def test_disabled_prefix_cache_never_hits():
    bm = watched(num_blocks=8, block_size=2, enable_prefix_cache=False)
    run(bm, 1, [1, 2, 3, 4, 5])
    bm.free(1)
    assert bm.allocate(2, [1, 2, 3, 4, 5]) == 0
    snap = bm.map.snapshot()
    assert snap.num_cached == 0 and snap.prefix_queried_tokens == 0 and snap.hit_rate == 0.0


def test_snapshot_totals():
    bm = watched(num_blocks=8, block_size=4)
    empty = bm.map.snapshot()
    assert empty.fragmentation == 0.0 and empty.num_free == 8 and empty.hit_rate == 0.0
    run(bm, 1, list(range(5)))  # one full block, one holding 1 slot
    bm.fork(1, 2)
    bm.append(2, 2)  # COW: seq 2's copy holds 3 slots
    run(bm, 3, [7, 7, 7, 7, 7])
    bm.free(3)  # one cached block, one freed
    snap = bm.map.snapshot()
    assert (snap.num_used, snap.num_cached, snap.num_free, snap.num_shared) == (3, 1, 4, 1)
    assert snap.tokens_stored == 4 + 1 + 3 and snap.slots_reserved == 12
    assert snap.fragmentation == pytest.approx(1 - 8 / 12)
    t1, t2 = bm.table(1), bm.table(2)
    assert snap.blocks[t1[0]].owners == (1, 2) and snap.blocks[t1[0]].ref_count == 2
    assert snap.blocks[t2[1]].filled == 3 and snap.blocks[t2[1]].owners == (2,)
    assert [b.block_id for b in snap.blocks] == list(range(8))
    assert sum(b.state == "cached" and b.filled == 4 for b in snap.blocks) == 1
    assert bm.map.snapshot() is snap  # unchanged pool: the UI's polling gets the same object
    bm.append(1, 1)
    new = bm.map.snapshot()
    assert new is not snap and new.tokens_stored == 9
    assert new.blocks[t1[1]].filled == 2 and new.blocks[t1[0]] is snap.blocks[t1[0]]


# ---- stateful property test -----------------------------------------------------------------

TOKENS = st.integers(0, 1)  # a tiny vocabulary, so prompts share and collide on prefixes
PICK = st.integers(0, 10**6)


def test_events_name_each_change():
    bm = BlockManager(num_blocks=3, block_size=2)
    events: list[BlockEvent] = []
    bm.observers.append(events.append)
    run(bm, 1, [5, 6, 7])  # blocks 0 (full, committed) and 1 (one token)
    bm.fork(1, 2)
    assert bm.append(2, 1) == [(1, 2)]  # the child writes into the shared partial block: a copy
    bm.free(1)
    bm.commit(2, [5, 6, 7, 9], 4)
    bm.free(2)
    prefix = ("resized", "lookup", "stored", "removed")  # the prefix cache's own: below
    kinds = [(e.kind, e.seq_id, e.block) for e in events if e.kind not in prefix]
    assert kinds == [
        ("allocated", 1, 0),
        ("allocated", 1, 1),
        ("shared", 2, 0),
        ("shared", 2, 1),
        ("copied", 2, 2),
        ("freed", 1, 1),
        ("released", 1, 0),
        ("cached", 2, 2),
        ("cached", 2, 0),
    ]
    assert [e.tokens for e in events if e.kind == "cached"] == [2, 2]
    assert next(e for e in events if e.kind == "copied").source == 1
    assert bm.allocate(3, [8, 8, 8, 8, 8]) == 0  # needs 3 blocks: both cached ones are evicted
    assert [e.block for e in events if e.kind == "evicted"] == [2, 0]
    cache = [e for e in events if e.kind in ("stored", "removed")]
    assert [(e.kind, e.block) for e in cache] == [
        ("stored", 0),
        ("stored", 2),
        ("removed", 2),
        ("removed", 0),
    ]
    first, second = cache[0], cache[1]
    assert first.parent is None and first.token_ids == (5, 6) and second.token_ids == (7, 9)
    assert second.parent == first.key and {e.key for e in cache[2:]} == {first.key, second.key}


class BlockMachine(RuleBasedStateMachine):
    """Drives a BlockManager like an engine would, with a fake KV pool to catch data corruption.

    The fake pool maps each slot to the token prefix whose KV it holds; a prefix hit, a missed
    copy-on-write or a bad rollback would leave a computed position reading someone else's KV.
    """

    @initialize(
        num_blocks=st.integers(6, 12),
        block_size=st.integers(2, 3),
        cache=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, cache):
        self.bm = watched(num_blocks, block_size, enable_prefix_cache=cache)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.pool: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[list[int], int, list]] = {}  # swapped out: tokens, computed, KV
        self.next_id = 0

    def pick(self, i: int) -> int:
        """A live sequence id chosen by a drawn integer."""
        return sorted(self.tokens)[i % len(self.tokens)]

    def start(self, tokens: list[int], prefill: bool) -> None:
        """Allocate a new sequence if the pool allows, checking the hit arithmetic; maybe prefill
        it."""
        bm, sid = self.bm, self.next_id
        self.next_id += 1
        if not bm.can_allocate(tokens):
            free_before = bm.num_free_blocks()
            with pytest.raises(ValueError):
                bm.allocate(sid, tokens)
            assert bm.num_free_blocks() == free_before
            return
        hit = bm.allocate(sid, tokens)
        assert hit <= max(0, len(tokens) - 1)  # the last token is always computed
        assert hit == 0 or bm.enable_prefix_cache
        self.tokens[sid], self.computed[sid] = list(tokens), hit
        if prefill:
            self.compute(sid, len(tokens))

    def compute(self, sid: int, k: int) -> None:
        """Write KV for up to k more tokens of the sequence, then commit them."""
        toks, done = self.tokens[sid], self.computed[sid]
        upto = min(len(toks), done + k)
        for p in range(done, upto):
            self.pool[self.bm.slot(sid, p)] = tuple(toks[: p + 1])
        self.computed[sid] = upto
        self.bm.commit(sid, toks, upto)

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12), prefill=st.booleans())
    def allocate(self, tokens, prefill):
        self.start(tokens, prefill)

    @precondition(lambda self: self.tokens)
    @rule(
        i=PICK,
        cut=st.integers(0, 12),
        extra=st.lists(TOKENS, min_size=1, max_size=4),
        prefill=st.booleans(),
    )
    def allocate_sharing_prefix(self, i, cut, extra, prefill):
        self.start(self.tokens[self.pick(i)][:cut] + extra, prefill)

    def extend(self, sid: int, new: list[int], step: bool) -> None:
        """Reserve slots for new tokens, doing the engine's KV copies; with step, also compute
        them."""
        bm = self.bm
        if not bm.can_append(sid, len(new)):
            with pytest.raises(ValueError):
                bm.append(sid, len(new))
            return
        pairs = bm.append(sid, len(new))
        assert len(pairs) <= 1
        bs = bm.block_size
        for old, fresh in pairs:
            assert bm.table(sid)[(bm.length(sid) - len(new)) // bs] == fresh
            for j in range(bs):
                if old * bs + j in self.pool:
                    self.pool[fresh * bs + j] = self.pool[old * bs + j]
        self.tokens[sid] += new
        if step:
            self.compute(sid, len(self.tokens[sid]))

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, new=st.lists(TOKENS, min_size=1, max_size=4), step=st.booleans())
    def append(self, i, new, step):
        """Decode (1 slot) or speculative verify (k+1 slots) on one sequence."""
        self.extend(self.pick(i), new, step)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, k=st.integers(1, 8))
    def commit(self, i, k):
        """A step: compute (write KV for) up to k more tokens of a sequence, then commit them."""
        self.compute(self.pick(i), k)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, sample=st.booleans())
    def fork(self, i, sample):
        """Fork a sequence (n > 1 samples); with sample, each side then decodes its own token."""
        parent, child = self.pick(i), self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        if sample:  # different tokens into the same slot: only copy-on-write keeps both intact
            self.extend(parent, [0], step=True)
            self.extend(child, [1], step=True)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    @precondition(lambda self: self.tokens)
    @rule(
        members=st.lists(PICK, min_size=1, max_size=4),
        picks=st.lists(st.tuples(PICK, TOKENS), min_size=1, max_size=4),
        step=st.booleans(),
    )
    def beam_step(self, members, picks, step):
        """One step of a beam search over a group of sequences, as the engine takes it: each pick
        (a parent in the group, a token) goes on as the parent itself the first time the parent
        is picked, else as a fork of the parent as it was; every pick then gets its token; the
        group's sequences no pick named are freed."""
        group = sorted({self.pick(i) for i in members})
        chosen = [(group[i % len(group)], token) for i, token in picks]
        beams, reused = [], set()
        for parent, token in chosen:
            beam = parent
            if parent in reused:  # forked before any pick's token is appended
                beam = self.new_id()
                self.bm.fork(parent, beam)
                self.tokens[beam] = list(self.tokens[parent])
                self.computed[beam] = self.computed[parent]
            reused.add(parent)
            beams.append((beam, token))
        for beam, token in beams:
            self.extend(beam, [token], step)
        for sid in group:
            if sid not in reused:
                self.drop(sid, tail=True)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, at=st.integers(0, 12), token=TOKENS)
    def branch(self, i, at, token):
        """Branch a sequence at a token: a new one made of its first tokens, then another token.
        Every full block the source computed before the cut and holds registered is a hit: the
        shared history is not computed again. (A block whose content another block registered
        first is not registered itself, so a branch after that one's eviction recomputes it.)"""
        src, bs = self.pick(i), self.bm.block_size
        self.bm.commit(src, self.tokens[src], self.computed[src])  # as each step of it did
        at = min(at, len(self.tokens[src]))
        full = min(at, self.computed[src]) // bs
        own = all(b in self.bm._block_key for b in self.bm.table(src)[:full])
        sid = self.next_id
        self.start(self.tokens[src][:at] + [token], prefill=False)
        if sid in self.tokens and own:
            assert self.computed[sid] >= full * bs

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, back=st.booleans())
    def swap_out(self, i, back):
        """Preemption by swapping: the KV of the sequence's computed tokens is copied out of the
        blocks swap_out names before anything else writes them; maybe straight back in."""
        sid, bs = self.pick(i), self.bm.block_size
        toks, computed = self.tokens.pop(sid), self.computed.pop(sid)
        blocks = self.bm.swap_out(sid, toks, computed)
        assert len(blocks) == self.bm.blocks_needed(computed)
        kv = [self.pool.get(b * bs + j) for b in blocks for j in range(bs)]
        self.host[sid] = (toks, computed, kv)
        if back:
            self.swap_in(sid)

    @precondition(lambda self: self.host)
    @rule(i=PICK)
    def swap_back(self, i):
        self.swap_in(sorted(self.host)[i % len(self.host)])

    def swap_in(self, sid: int) -> None:
        """Resume a swapped-out sequence when the pool can hold all its tokens (the scheduler's
        test): a fresh table for its computed tokens, their KV copied in, slots for the rest."""
        toks, computed, kv = self.host[sid]
        if not self.bm.can_swap_in(len(toks)):
            return
        del self.host[sid]
        bs = self.bm.block_size
        for k, b in enumerate(self.bm.swap_in(sid, computed)):
            for j in range(bs):
                self.pool[b * bs + j] = kv[k * bs + j]
        self.tokens[sid], self.computed[sid] = toks[:computed], computed
        if len(toks) > computed:
            self.extend(sid, toks[computed:], step=False)
        assert self.tokens[sid] == toks

    def drop(self, sid: int, tail: bool) -> list[int]:
        """Free a sequence, with tail keeping its partly filled last block as a partial prefix; its
        tokens."""
        toks, computed = self.tokens.pop(sid), self.computed.pop(sid)
        if tail:
            self.bm.free(sid, toks, computed)
        else:
            self.bm.free(sid)
        return toks

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, tail=st.booleans())
    def free(self, i, tail):
        self.drop(self.pick(i), tail)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, extra=st.lists(TOKENS, min_size=1, max_size=4))
    def next_turn(self, i, extra):
        """A chat's next turn: a sequence computed to its last token finishes, and its tokens plus
        more
        come back under a new id (the partial tail, if the sequence held it alone, is a hit)."""
        sid = self.pick(i)
        self.compute(sid, max(0, len(self.tokens[sid]) - 1 - self.computed[sid]))
        self.start(self.drop(sid, tail=True) + extra, prefill=True)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, tail=st.booleans())
    def preempt(self, i, tail):
        """Free a sequence and re-admit its tokens under a new id (preemption by recompute)."""
        self.start(self.drop(self.pick(i), tail), prefill=True)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, k=st.integers(0, 5))
    def rollback(self, i, k):
        sid = self.pick(i)
        k = min(k, len(self.tokens[sid]))
        self.bm.rollback(sid, k)
        del self.tokens[sid][len(self.tokens[sid]) - k :]
        self.computed[sid] = min(self.computed[sid], len(self.tokens[sid]))

    @invariant()
    def blocks_are_consistent(self):
        bm, n = self.bm, self.bm.num_blocks
        free, cached = list(bm._free), list(bm._cached)
        used = [b for b in range(n) if bm._ref[b] > 0]
        assert sorted(free + cached + used) == list(range(n))  # each block in exactly one state
        refs = Counter(b for sid in self.tokens for b in bm.table(sid))
        assert all(bm._ref[b] == refs[b] for b in range(n))
        for sid, toks in self.tokens.items():
            assert bm.length(sid) == len(toks)
            assert len(bm.table(sid)) == bm.blocks_needed(len(toks))
            assert len(set(bm.table(sid))) == len(bm.table(sid))
            assert (
                len(bm._hashes[sid]) <= self.computed[sid] // bm.block_size
            )  # only computed blocks
        assert len(bm._registry) == len(bm._block_key)
        for key, b in bm._registry.items():
            assert bm._block_key[b] == key and (bm._ref[b] > 0 or b in bm._cached)
        assert all(b in bm._block_key for b in cached)
        assert bm.enable_prefix_cache or not bm._registry

    @invariant()
    def snapshot_adds_up(self):
        snap, n = self.bm.map.snapshot(), self.bm.num_blocks
        assert snap.num_used + snap.num_cached + snap.num_free == n
        assert snap.tokens_stored <= snap.slots_reserved == snap.num_used * snap.block_size
        assert snap.num_cached + snap.num_free == self.bm.num_free_blocks()
        states = Counter(b.state for b in snap.blocks)
        assert [states["used"], states["cached"], states["free"]] == [
            snap.num_used,
            snap.num_cached,
            snap.num_free,
        ]
        assert sum(b.ref_count > 1 for b in snap.blocks) == snap.num_shared
        assert [b.ref_count for b in snap.blocks] == self.bm._ref
        holders = {b: sorted(s for s in self.tokens if b in self.bm.table(s)) for b in range(n)}
        assert all(info.owners == tuple(holders[info.block_id]) for info in snap.blocks)
        bs, fill = self.bm.block_size, [0] * n  # slots holding tokens, from the tables and lengths
        for s in self.tokens:
            for i, b in enumerate(self.bm.table(s)):
                fill[b] = max(fill[b], min(bs, self.bm.length(s) - i * bs))
        kept = [
            len(self.bm._block_key[b.block_id][1]) if b.state == "cached" else fill[b.block_id]
            for b in snap.blocks
        ]
        assert [b.filled for b in snap.blocks] == kept
        assert snap.tokens_stored == sum(fill)
        assert snap.prefix_hit_tokens <= snap.prefix_queried_tokens

    @invariant()
    def computed_positions_hold_their_own_kv(self):
        for sid, toks in self.tokens.items():
            for p in range(self.computed[sid]):
                assert self.pool.get(self.bm.slot(sid, p)) == tuple(toks[: p + 1]), (sid, p)

    @invariant()
    def registered_blocks_hold_their_prefix(self):
        """Each registered block's KV is exactly the chain its key claims, so a hit reads true
        KV."""
        bs = self.bm.block_size
        for key, b in self.bm._registry.items():
            n = len(key[1])  # bs, or fewer for a partial tail
            prefix = self.pool.get(b * bs + n - 1)
            assert prefix is not None and len(prefix) % bs == n % bs
            prev, start = _ROOT, len(prefix) - n
            for i in range(0, start, bs):
                prev = hash((prev, prefix[i : i + bs]))
            assert (prev, prefix[start:]) == key
            assert all(self.pool.get(b * bs + j) == prefix[: start + j + 1] for j in range(n))

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.tokens):
            self.bm.free(sid)
        snap = self.bm.map.snapshot()
        assert snap.num_used == 0 and self.bm.num_free_blocks() == self.bm.num_blocks


BlockMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockMachine = BlockMachine.TestCase
