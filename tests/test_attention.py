"""Attention metadata against a plain-Python reading of the block tables, random ragged batches;
paged attention over them against softmax(q k^T / sqrt(d)) v written out in float64: gathered,
through ops.cpp's decode attention, and through core/paged_triton.py's kernels (the GPU's path),
which Triton's interpreter runs on CPU tensors here."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from pagechat.core import ops, paged_triton
from pagechat.core.attention import build_metadata, paged_attention

if not torch.cuda.is_available():  # read when the kernels are first compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


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
    "path",
    [
        "gather",
        pytest.param(
            "fused",
            marks=pytest.mark.skipif(
                not ops.fused(torch.device("cpu"), torch.float32), reason="needs the fused ops"
            ),
        ),
        pytest.param("paged", marks=needs_triton),
    ],
)
def test_ragged_steps_attend_each_sequence_to_its_own_context(window, path):
    """Prompts from their start, chunks after cached tokens and decodes in one step, GQA (6 query
    heads on 2 KV heads): each query's output is its own sequence's keys up to its position (within
    the window) weighed by softmax, as the definition computes it in float64; fused and paged: the
    decodes beside the chunks in one decode attention call (ops.cpp's, paged_triton's); fused: a
    few new tokens on ops.cpp's decode attention, more than IN_PLACE_ROWS on its prefill one."""
    rng = random.Random(7)
    torch.manual_seed(7)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    for _ in range(20):
        starts, counts, tables, used = [], [], [], set()
        for _ in range(rng.randint(1, 4)):
            s = rng.choice([0, 0, rng.randint(1, 20)])
            c = rng.choice([1, rng.randint(2, 12), rng.randint(17, 40)])
            table = rng.sample(sorted(set(range(64)) - used), -(-(s + c) // bs))
            used |= set(table)
            starts.append(s)
            counts.append(c)
            tables.append(table)
        meta = build_metadata(starts, counts, tables, bs, torch.device("cpu"), path == "paged")
        k_cache = torch.randn(64 * bs, kv_heads, d)
        v_cache = torch.randn(64 * bs, kv_heads, d)
        t = sum(counts)
        q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, window, path == "fused")
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


@needs_triton
@pytest.mark.parametrize(
    "heads, kv_heads, d, bs, cache_dtype, window",
    [
        (4, 4, 64, 16, torch.float32, None),
        (9, 3, 64, 16, torch.bfloat16, None),  # SmolLM2's grouping, a 16-bit cache
        (8, 1, 40, 4, torch.float16, 7),  # a head size that is no power of two
        (6, 2, 32, 16, torch.bfloat16, 100),
    ],
)
def test_paged_decode_reads_long_contexts_through_the_block_table(
    heads, kv_heads, d, bs, cache_dtype, window
):
    """core/paged_triton.py's decode attention as a captured step calls it: contexts of 1 to 700
    tokens (several partitions each, merged), scattered blocks, a table wider than any context
    (a graph's static one), and padding rows whose slot is -1: each real row's output is the
    float64 definition over its context, its K/V land at its slot, and nothing else in the caches
    changes."""
    rng = random.Random(heads * d)
    torch.manual_seed(heads * d)
    starts = [0, 1, rng.randint(2, 60), rng.randint(200, 400), 699]
    num_blocks = 2 * sum(s // bs + 1 for s in starts)
    free = rng.sample(range(num_blocks), num_blocks)
    tables = [[free.pop() for _ in range(s // bs + 1)] for s in starts]
    width = 800 // bs
    table = torch.zeros(len(starts) + 2, width, dtype=torch.int32)  # two padding rows
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks)
    slots = [t[s // bs] * bs + s % bs for t, s in zip(tables, starts)]
    slot_mapping = torch.tensor(slots + [-1, -1])
    q_pos = torch.tensor(starts + [0, 0]).unsqueeze(1)
    k_cache = torch.randn(num_blocks * bs, kv_heads, d).to(cache_dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, d).to(cache_dtype)
    # new K/V the cache's dtype holds exactly, so the written rows compare bit for bit
    q = torch.randn(len(starts) + 2, heads, d)
    k = torch.randn(len(starts) + 2, kv_heads, d).to(cache_dtype).float()
    v = torch.randn(len(starts) + 2, kv_heads, d).to(cache_dtype).float()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[slots], want_v[slots] = (
        k[: len(starts)].to(cache_dtype),
        v[: len(starts)].to(cache_dtype),
    )
    out = paged_triton.decode_attention(
        q, k, v, k_cache, v_cache, slot_mapping, table, q_pos, bs, window or 0
    )
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    for row, (s, blocks) in enumerate(zip(starts, tables)):
        ctx = [blocks[p // bs] * bs + p % bs for p in range(s + 1)]
        seen = ctx[-window:] if window else ctx
        keys, values = k_cache[seen].double(), v_cache[seen].double()
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[:, g] @ q[row, h].double() / d**0.5
            want = torch.softmax(scores, 0) @ values[:, g]
            torch.testing.assert_close(out[row, h].double(), want, rtol=1e-4, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral's tiny model slides a window
def test_an_engine_decoding_through_the_paged_kernel_matches_the_gathered_one(
    tiny_models, arch, monkeypatch
):
    """A GPU engine's attention path on the CPU: the same prompts, decoded eagerly with the
    decode rows (alone, and beside a later prompt's prefill) read through block tables by
    paged_triton, give the gathered path's tokens and logits."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.core.params import SamplingParams

    def run(paged: bool):
        engine = Engine(
            tiny_models[arch], EngineConfig(device="cpu", dtype="float32", graphs=False, max_seqs=4)
        )
        engine.runner.paged = paged
        logits, run = [], engine.runner.run
        engine.runner.run = lambda items, rows: logits.append(run(items, rows)) or logits[-1]
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        ids = []
        for prompt in ("Hi", "Blocks hold keys and values, block by block."):
            ids.append(engine.requests.add(prompt, greedy))
            engine.step()  # the second prompt's prefill then runs beside the first's decode
        while engine.has_unfinished():
            engine.step()
        return [engine.requests[i].output_ids for i in ids], logits

    kernel, rows = paged_triton.decode_attention, []
    monkeypatch.setattr(
        paged_triton, "decode_attention", lambda q, *a: rows.append(len(q)) or kernel(q, *a)
    )
    (want, want_logits), (got, got_logits) = run(False), run(True)
    assert got == want
    assert 1 in rows and 2 in rows  # one decode beside the prefill, then both decoding
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
