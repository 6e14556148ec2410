"""Attention metadata against a plain-Python reading of the block tables, random ragged batches;
paged attention over them against softmax(q k^T / sqrt(d)) v written out in float64."""

from __future__ import annotations

import random

import pytest
import torch
from pagechat.core import ops
from pagechat.core.attention import build_metadata, paged_attention


def reference(starts, counts, tables, bs, window):
    """(slot_mapping, gather rows, q_pos rows, allowed[b][q][k]) straight from the definitions."""

    def slot(table, p):
        return table[p // bs] * bs + p % bs

    max_q, max_ctx = max(counts), max(s + c for s, c in zip(starts, counts))
    slots = [slot(t, s + i) for s, c, t in zip(starts, counts, tables) for i in range(c)]
    gather = [
        [slot(t, p) if p < s + c else 0 for p in range(max_ctx)]
        for s, c, t in zip(starts, counts, tables)
    ]
    q_pos = [[s + i if i < c else -1 for i in range(max_q)] for s, c in zip(starts, counts)]
    allowed = [
        [[k <= q and (window is None or q - k < window) for k in range(max_ctx)] for q in row]
        for row in q_pos
    ]
    return slots, gather, q_pos, allowed


@pytest.mark.parametrize("decode", [True, False])
def test_metadata_matches_the_block_tables(decode):
    rng = random.Random(int(decode))
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 16])
        starts, counts, tables = [], [], []
        for _ in range(rng.randint(1, 4)):
            s, c = rng.randint(0, 40), 1 if decode else rng.randint(1, 9)
            starts.append(s)
            counts.append(c)
            tables.append(
                rng.sample(range(300), -(-(s + c) // bs) + rng.randint(0, 2))
            )  # spare blocks too
        meta = build_metadata(starts, counts, tables, bs, torch.device("cpu"))
        for window in (None, 3, 64):
            slots, gather, q_pos, allowed = reference(starts, counts, tables, bs, window)
            assert meta.slot_mapping.tolist() == slots
            assert meta.gather.view(len(starts), -1).tolist() == gather
            assert meta.q_pos.tolist() == q_pos
            assert meta.uniform == (len(set(counts)) == 1)
            if meta.uniform:  # the padded path's mask; a ragged step attends per sequence
                mask = meta.mask(window)
                want = torch.tensor(allowed).unsqueeze(1)
                assert torch.equal(mask, want) if mask is not None else bool(want.all())
        assert (meta.spans is None) == (max(counts) == 1)
        assert meta.spans is None or list(meta.spans) == list(zip(starts, counts))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "fused",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not ops.fused(torch.device("cpu"), torch.float32), reason="needs the fused ops"
            ),
        ),
    ],
)
def test_ragged_steps_attend_each_sequence_to_its_own_context(window, fused):
    """Prompts from their start, chunks after cached tokens and decodes in one step, GQA (6 query
    heads on 2 KV heads): each query's output is its own sequence's keys up to its position (within
    the window) weighed by softmax, as the definition computes it in float64; fused: the decodes
    beside the chunks in one decode_attention call."""
    rng = random.Random(7)
    torch.manual_seed(7)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    for _ in range(20):
        starts, counts, tables, used = [], [], [], set()
        for _ in range(rng.randint(1, 4)):
            s, c = rng.choice([0, 0, rng.randint(1, 20)]), rng.choice([1, rng.randint(2, 12)])
            table = rng.sample(sorted(set(range(64)) - used), -(-(s + c) // bs))
            used |= set(table)
            starts.append(s)
            counts.append(c)
            tables.append(table)
        meta = build_metadata(starts, counts, tables, bs, torch.device("cpu"))
        k_cache = torch.randn(64 * bs, kv_heads, d)
        v_cache = torch.randn(64 * bs, kv_heads, d)
        t = sum(counts)
        q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, window, fused)
        row = 0
        for s, c, table in zip(starts, counts, tables):
            slots = [table[p // bs] * bs + p % bs for p in range(s + c)]
            keys, values = k_cache[slots].double(), v_cache[slots].double()
            # this step's own keys and values were written through the slot mapping
            assert torch.equal(k_cache[slots[s:]], k[row : row + c])
            for i in range(c):
                pos = s + i
                seen = [p for p in range(pos + 1) if window is None or pos - p < window]
                for h in range(heads):
                    g = h // (heads // kv_heads)
                    scores = keys[seen, g] @ q[row + i, h].double() / d**0.5
                    want = torch.softmax(scores, 0) @ values[seen, g]
                    torch.testing.assert_close(out[row + i, h].double(), want, rtol=1e-4, atol=1e-5)
            row += c
