"""Attention metadata against a plain-Python reading of the block tables, random ragged batches."""

from __future__ import annotations

import random

import pytest
import torch
from pagechat.core.attention import build_metadata


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
        [
            [
                (k <= q and (window is None or q - k < window)) or (q < 0 and k == 0)
                for k in range(max_ctx)
            ]
            for q in row
        ]
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
            mask = meta.mask(window)
            want = torch.tensor(allowed).unsqueeze(1)
            assert torch.equal(mask, want) if mask is not None else bool(want.all())
        rows = [b * max(counts) + i for b, c in enumerate(counts) for i in range(c)]
        assert (meta.q_rows is None) == (len(rows) == len(starts) * max(counts))
        assert meta.q_rows is None or meta.q_rows.tolist() == rows
