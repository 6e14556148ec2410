"""The decoder's fused small ops against the torch code they replace: ops.cpp's (a CPU's) in
float32 and bf16, and core/fused_triton.py's (a GPU's; Triton's interpreter runs them on CPU tensors
here) in float16 too; and the model's choice of them.

Oracle: core/model.py's own torch path (RMSNorm._norm, rotate, silu(gate) * up), which the HF
parity tests pin to transformers. float32 results may differ by the order of a row's sum of
squares (a few ulps); bf16 results round where torch's bf16 ops round, so they agree but for a
rare last-bit tie.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pagechat.core import fused_triton, native, ops
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.model import RMSNorm, rotate

if not torch.cuda.is_available():  # read when the kernels are first compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")
CPU = torch.device("cpu")
needs_ops = pytest.mark.skipif(
    not ops.fused(CPU, torch.float32), reason="needs an AVX2 CPU, g++ and ninja"
)
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (backend, dtype): ops.cpp takes float32 and bf16, Triton float16 too
CASES = [
    pytest.param(backend, dtype, marks=needs_ops if backend == "ops.cpp" else needs_triton)
    for backend, dtypes in (
        ("ops.cpp", (torch.float32, torch.bfloat16)),
        ("triton", (torch.float32, torch.bfloat16, torch.float16)),
    )
    for dtype in dtypes
]


NAMES = ("rms_norm", "add_rms_norm", "rope", "silu_mul")


def small(backend: str) -> ops.SmallOps:
    return torch.ops.pagechat if backend == "ops.cpp" else fused_triton


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within the dtype's rounding; bf16: at most one in a thousand elements a level apart."""
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=TOL[dtype], atol=1e-6)
    off = ~torch.isclose(a.float(), b.float(), rtol=TOL[dtype], atol=1e-3)
    return off.float().mean().item() <= 1e-3


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_norms_match_torch(backend, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h = 580  # 8 at a time, then 4 alone; not a power of two
    x = (torch.randn(rows, h, generator=g) * 3).to(dtype)
    res = torch.randn(rows, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    fused, plain = RMSNorm(w, 1e-5, small(backend)), RMSNorm(w, 1e-5)
    assert close(fused(x), plain(x), dtype)
    (y, s), (y_ref, s_ref) = fused(x, res), plain(x, res)
    assert torch.equal(s, s_ref)  # one rounded add either way
    assert close(y, y_ref, dtype)


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("d", [16, 64, 12, 40])  # halves of 8 at a time, in scalars, or both
def test_rope_on_a_slice_of_qkv_matches_rotate(backend, dtype, d):
    """The fused qkv's q and k heads are a strided view: the op reads them in place."""
    t, heads, kv_heads = 5, 4, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    assert not qk.is_contiguous()
    ang = torch.randn(t, 1, d // 2)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    got = small(backend).rope(qk, cos, sin)
    assert got.is_contiguous() and close(got, rotate(qk, cos, sin), dtype)


@pytest.mark.parametrize("backend,dtype", CASES)
def test_silu_mul_matches_torch(backend, dtype):
    op = small(backend).silu_mul
    gate_up = (torch.randn(7, 2 * 1540) * 4).to(dtype)  # 1540: 8 at a time, then 4 alone
    gate, up = gate_up.split(1540, dim=-1)
    assert close(op(gate_up), F.silu(gate) * up, dtype)
    # the vectorised exp saturates where torch's does and passes NaN on
    edge = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0] + [3.0] * 4)
    gate_up = torch.cat([edge, torch.ones(10)]).to(dtype)[None]
    want = F.silu(edge.to(dtype))
    torch.testing.assert_close(op(gate_up)[0], want, equal_nan=True)


@needs_ops
@pytest.mark.parametrize("vocab", [1, 5, 8, 9, 23, 49152 + 3])
def test_row_max_is_torchs_max_and_first_argmax(vocab):
    """Values as torch's max; the index torch's argmax gives (the first of tied maxima), with
    ties inside a lane, across lanes and in the tail; a row all -inf gives index 0, a NaN the
    value NaN."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-4, 5, (7, vocab), generator=g).float()  # few values: many ties
    x[1] = torch.randn(vocab, generator=g)
    x[2] = float("-inf")
    x[3, -1] = 100.0  # the maximum in the last (tail) column
    x[4, vocab // 2] = float("nan")
    x[5] = torch.where(torch.arange(vocab) % 3 == 0, 7.0, -1.0)  # tied maxima in every lane
    values, indices = torch.ops.pagechat.row_max(x)
    assert values.shape == (7, 1) and indices.dtype == torch.long
    assert torch.equal(indices[[0, 1, 2, 3, 5, 6]], x.argmax(dim=-1)[[0, 1, 2, 3, 5, 6]])
    torch.testing.assert_close(values, x.amax(dim=-1, keepdim=True), equal_nan=True)
    assert indices[2] == 0 and values[4].isnan()
    assert ops.row_max(x[:0])[0].shape == (0, 1)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_ops), False])
@pytest.mark.parametrize(
    "rows,vocab,k", [(1, 49152 + 3, 8), (3, 8192 + 5, 5), (2, 7, 7), (5, 40, 1)]
)
def test_candidates_are_the_topk_and_their_softmax(
    kernel, rows, vocab, k, eight_threads, monkeypatch
):
    """ops.candidates (ops.cpp's, and torch's where it is not built) against torch's topk and
    softmax(x / t): the k largest ids best first, then the chosen id, with their probabilities;
    masked (-inf) logits, a temperature too small to divide by (the maxima share), rows cut into
    a part a thread (8 threads: fewer rows than threads, a wide row alone)."""
    if not kernel:
        monkeypatch.setattr(ops, "fused", lambda device, dtype: False)
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[0, : vocab // 3] = float("-inf")  # what a grammar forbids
    temps = torch.linspace(0.3, 1.7, rows)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    ids, probs = ops.candidates(x, temps, chosen, k)
    top = x.topk(k, dim=-1)
    assert ids.shape == probs.shape == (rows, k + 1)
    assert torch.equal(ids[:, :k], top.indices) and torch.equal(ids[:, k], chosen)
    want = (x / temps[:, None]).softmax(dim=-1).gather(1, ids)
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)
    tiny = torch.full((rows,), 1e-39)
    x[:, 3] = x[:, 5] = x.amax(dim=-1) + 1  # two maxima: each half under the smallest t
    ids, probs = ops.candidates(x, tiny, chosen, k)
    assert set(ids[:, : min(k, 2)].flatten().tolist()) <= {3, 5}
    expect = torch.where((ids == 3) | (ids == 5), 0.5, 0.0)
    torch.testing.assert_close(probs, expect)


@needs_ops
def test_candidates_ties_go_to_the_lower_id(eight_threads):
    """Equal logits rank by id, across the parts a row is cut into; NaN logits are refused."""
    x = torch.zeros(1, 16384)
    x[0, [9000, 12, 16000, 300]] = 2.0
    ids, _ = torch.ops.pagechat.candidates(x, torch.ones(1), torch.tensor([1]), 6)
    assert ids.tolist() == [[12, 300, 9000, 16000, 0, 1, 1]]
    x[0, 5] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        torch.ops.pagechat.candidates(x[:, :6], torch.ones(1), torch.tensor([1]), 6)


@needs_ops
def test_ops_refuse_what_they_cannot_take():
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        torch.ops.pagechat.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.pagechat.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="row_max: float32"):
        torch.ops.pagechat.row_max(torch.randn(2, 8).bfloat16())


def test_model_uses_them_only_where_they_run(tiny_llama, monkeypatch):
    e = Engine(tiny_llama, EngineConfig(kv_blocks=8, dtype="float32"))
    layer = e.model.layers[0]
    want = torch.ops.pagechat if ops.fused(CPU, torch.float32) else None
    assert layer.input_layernorm.small is layer.mlp.small is layer.self_attn.small is want
    assert layer.self_attn.fused == (want is not None)  # and decode attention
    monkeypatch.setenv("PAGECHAT_KERNELS", "0")
    native.library.cache_clear()
    try:
        off = Engine(tiny_llama, EngineConfig(kv_blocks=8, dtype="float32"))
        assert off.model.layers[0].input_layernorm.small is None
        prompt, n = [5, 6, 7, 8, 9], 8
        from pagechat.core.params import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert (
            e.generate([prompt], params)[0].output_ids
            == off.generate([prompt], params)[0].output_ids
        )
    finally:
        native.library.cache_clear()


def test_a_model_for_a_gpu_is_built_with_tritons_not_ops_cpps(tiny_llama):
    """A dense checkpoint loads on the CPU and moves to its device after: which fused ops its
    layers run follows the device it will run on (a GPU engine ran ops.cpp's on CUDA tensors)."""
    from pagechat.core.loader import open_weights, read_spec
    from pagechat.core.model import DecoderModel

    spec = read_spec(tiny_llama)
    weights = open_weights(tiny_llama, spec)
    try:
        model = DecoderModel(spec, weights, torch.float32, 64, torch.device("cuda"))
    finally:
        weights.close()
    assert not any(m.fused for m in model.modules() if hasattr(m, "fused"))
    want = fused_triton if HAS_TRITON else None
    assert all(m.small is want for m in model.modules() if hasattr(m, "small"))
    assert next(model.parameters()).device == CPU  # built where it loads; moved later


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_running_tritons_small_ops_matches_torchs(tiny_llama, dtype, monkeypatch):
    """A GPU engine's small ops on the CPU: greedy tokens as torch's ops give them, logits within
    the dtype's rounding, and every op ran."""
    from pagechat.core.params import SamplingParams

    calls = set()

    def counted(name):
        op = getattr(fused_triton, name)
        return lambda *a: calls.add(name) or op(*a)

    spy = type("Spy", (), {n: staticmethod(counted(n)) for n in NAMES})

    def run(chosen):
        monkeypatch.setattr(ops, "small_ops", lambda device, dtype: chosen)
        # the KV in the model's dtype: a float32 model's default fp16 cache turns the ops' last-bit
        # differences into a K or V rounded the other way now and then (~2e-5 in the logits)
        cfg = EngineConfig(kv_blocks=16, dtype=dtype, kv_dtype=dtype, graphs=False)
        e = Engine(tiny_llama, cfg)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        out = e.generate([[5, 6, 7, 8, 9], [3, 4]], params)
        return [o.output_ids for o in out], e.runner.score([5, 9, 3, 77, 120])

    (want, want_logits), (got, got_logits) = run(None), run(spy)
    assert calls == set(NAMES)
    assert got == want
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)


@pytest.fixture
def eight_threads():
    """torch on 8 threads, then as it was: the op's split into pieces follows the thread count."""
    was = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(was)


@needs_ops
@pytest.mark.parametrize(
    "dtype,cache",
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("window", [None, 5, 20, 700])
# query heads per kv head 2, 4, 10 (the kernel's chunks of 3 scored and 4 weighed heads and their
# tails) and head sizes 16, 40 and 96 (chunks of 32 and 16 values and their tails); contexts of 3
# to 38 keys (scored 4 rows at a time, then one by one), and of 600 and 2,500, attended in pieces
# where 4 sequences' kv heads are too few tasks for the threads (8 here: 2 and 8 pieces, merged; a
# window of 700 cuts the longest to 2)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (8, 2, 96), (10, 1, 40)])
@pytest.mark.parametrize("contexts", [(6, 13, 2, 37), (600, 13, 2499, 37)])
def test_decode_attention_matches_the_gathering_path(
    dtype, cache, window, heads, kv_heads, d, contexts, eight_threads
):
    """Four sequences of different contexts decode one token each, query heads sharing kv heads,
    with the qkv rows strided as the model's are: the cache written as paged_attention's torch path
    writes it (gather, then scaled_dot_product_attention), and the output as close to the same
    attention in float64 as that path's (float32: equal to rounding; bf16 rounds the output)."""
    from pagechat.core.attention import build_metadata, paged_attention

    g = torch.Generator().manual_seed(0)
    block = 4
    need = [c // block + 1 for c in contexts]  # each context and its new token
    order = torch.randperm(sum(need) + 2, generator=g).tolist()  # blocks anywhere in the pool
    tables = [[order.pop() for _ in range(n)] for n in need]
    meta = build_metadata(list(contexts), [1] * 4, tables, block, CPU)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * d, generator=g)
    pool = torch.randn(2, (sum(need) + 2) * block, kv_heads, d, generator=g).to(cache)

    def attend(rows: torch.Tensor, kv: torch.Tensor, fused: bool = False) -> torch.Tensor:
        q = rows[:, : heads * d].view(4, heads, d)
        k = rows[:, heads * d : (heads + kv_heads) * d].view(4, kv_heads, d)
        v = rows[:, (heads + kv_heads) * d :].view(4, kv_heads, d)
        return paged_attention(q, k, v, kv[0], kv[1], meta, window, fused)

    fused_pool, torch_pool = pool.clone(), pool.clone()
    out = attend(qkv.to(dtype), fused_pool, fused=True)
    plain = attend(qkv.to(dtype), torch_pool)
    rows = qkv.to(dtype).double()
    rows[:, heads * d :] = qkv[:, heads * d :].to(dtype).to(cache).double()  # K, V as cached
    exact = attend(rows, pool.double())
    assert torch.equal(fused_pool, torch_pool)  # the new tokens' K and V written alike
    assert out.dtype == dtype and out.shape == (4, heads, d)
    err, torch_err = ((t.double() - exact).abs().max().item() for t in (out, plain))
    assert err <= max(torch_err, 1e-6)


@needs_ops
@pytest.mark.parametrize(
    "dtype,cache",
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("window", [None, 5])
def test_qkv_decode_attention_is_rope_then_decode_attention(dtype, cache, window):
    """A decode step's attention from the fused qkv rows in one op: the same output, bit for bit,
    and the same caches as ops.cpp's rope then decode_attention on the split rows; the output as
    close to torch's rotate then gathered attention in float64 as that path in dtype."""
    from pagechat.core.attention import build_metadata, paged_attention

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, block = 6, 2, 32, 4
    contexts = (9, 2, 17)
    tables = [[i, i + 3, i + 6, i + 9, i + 12] for i in range(3)]  # interleaved in the pool
    meta = build_metadata(list(contexts), [1] * 3, tables, block, CPU)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angle = torch.rand(3, 1, d, generator=g) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    pool = torch.randn(2, 15 * block, kv_heads, d, generator=g).to(cache)

    def split(rows):
        qk = rows[:, : (heads + kv_heads) * d].view(3, heads + kv_heads, d)
        return qk, rows[:, (heads + kv_heads) * d :].view(3, kv_heads, d)

    one, two = pool.clone(), pool.clone()
    args = (meta.slot_mapping, meta.gather, meta.q_pos, window or 0)
    out = torch.ops.pagechat.qkv_decode_attention(qkv, cos, sin, one, *args, heads)
    qk, v = split(qkv)
    q, k = torch.ops.pagechat.rope(qk, cos, sin).split((heads, kv_heads), dim=1)
    apart = torch.ops.pagechat.decode_attention(q, k, v, two[0], two[1], *args)
    assert out.shape == (3, heads * d) and out.dtype == dtype
    assert torch.equal(out, apart.flatten(1)) and torch.equal(one, two)

    def torch_path(rows, cos, sin, kv):
        qk, v = split(rows)
        q, k = rotate(qk, cos, sin).split((heads, kv_heads), dim=1)
        return paged_attention(q, k, v, kv[0], kv[1], meta, window).flatten(1)

    plain = torch_path(qkv, cos, sin, pool.clone())
    exact = torch_path(qkv.double(), cos.double(), sin.double(), pool.double())
    err, torch_err = ((t.double() - exact).abs().max().item() for t in (out, plain))
    assert err <= max(2 * torch_err, 1e-6)
    with pytest.raises(RuntimeError, match=r"qkv_decode_attention: qkv \[B, \(heads \+ 2 KV\)"):
        torch.ops.pagechat.qkv_decode_attention(qkv, cos, sin, one, *args, heads + 1)
    bad = (meta.slot_mapping + 15 * block, *args[1:])
    with pytest.raises(
        RuntimeError, match=f"qkv_decode_attention: a slot outside the caches' {15 * block}"
    ):
        torch.ops.pagechat.qkv_decode_attention(qkv, cos, sin, one, *bad, heads)


@needs_ops
@pytest.mark.parametrize(
    "dtype,cache",
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("window", [None, 7])
# a prompt from its start, and a chunk after 21 cached tokens (a long prompt's second chunk, or a
# cached prefix); 2 and 5 query heads per kv head
@pytest.mark.parametrize("start,count", [(0, 19), (21, 12)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (5, 1)])
def test_decode_attention_of_a_chunk_matches_the_gathering_path(
    dtype, cache, window, start, count, heads, kv_heads
):
    """One sequence's chunk of new tokens (q_pos [1, n]) against its context in one op: the caches
    written as index_copy_ writes them, the output as close to the same attention in float64 as
    torch's path (the context gathered, then SDPA, causal or masked by position)."""
    from pagechat.core.attention import _attend_one

    g = torch.Generator().manual_seed(2)
    d, ctx = 32, start + count
    slots = torch.randperm(ctx + 9, generator=g)[:ctx]  # the context anywhere in the pool
    q = torch.randn(count, heads, d, generator=g).to(dtype)
    k, v = (torch.randn(count, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    pool = torch.randn(2, ctx + 9, kv_heads, d, generator=g).to(cache)
    new = slots[start:]
    positions = torch.arange(start, ctx).unsqueeze(0)
    ours = pool.clone()
    out = torch.ops.pagechat.decode_attention(
        q, k, v, ours[0], ours[1], new, slots, positions, window or 0
    )
    theirs = pool.clone()
    theirs[0].index_copy_(0, new, k.to(cache))
    theirs[1].index_copy_(0, new, v.to(cache))
    assert torch.equal(ours, theirs)
    plain = _attend_one(q, theirs[0], theirs[1], slots, start, window)
    exact = _attend_one(q.double(), theirs[0].double(), theirs[1].double(), slots, start, window)
    err, torch_err = ((t.double() - exact).abs().max().item() for t in (out, plain))
    assert out.dtype == dtype and out.shape == q.shape
    assert err <= max(torch_err, 1e-6)
    with pytest.raises(RuntimeError, match="decode_attention: a position outside its sequence's"):
        torch.ops.pagechat.decode_attention(
            q, k, v, ours[0], ours[1], new, slots[:-1], positions, window or 0
        )
    # a slot outside the pool, where a row's K and V go or among the context it reads: an error,
    # and nothing written
    unread = torch.cat([torch.tensor([-1]), slots[1:]])
    for bad_new, bad_slots in ((new + ctx + 9, slots), (new, unread)):
        before = ours.clone()
        with pytest.raises(
            RuntimeError, match=f"decode_attention: a slot outside the caches' {ctx + 9}"
        ):
            torch.ops.pagechat.decode_attention(
                q, k, v, *ours, bad_new, bad_slots, positions, window or 0
            )
        assert torch.equal(ours, before)
    # a V cache shorter than the K cache, whose size the slots are checked against: refused
    with pytest.raises(RuntimeError, match=r"decode_attention: caches \[slots, KV, D\]"):
        torch.ops.pagechat.decode_attention(
            q, k, v, ours[0], ours[1][:-1], new, slots, positions, window or 0
        )


def prefill_case(seed, heads, kv_heads, d, start, count, dtype=torch.float32, cache=torch.float32):
    """q [count, H, D] strided as the qkv projection's rows, a pool of K and V [2, slots, KV, D] and
    the context's slots [start + count], anywhere in the pool."""
    g = torch.Generator().manual_seed(seed)
    ctx = start + count
    rows = torch.randn(count, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = rows[:, : heads * d].view(count, heads, d)
    pool = torch.randn(2, ctx + 40, kv_heads, d, generator=g).to(cache)
    return q, pool, torch.randperm(ctx + 40, generator=g)[:ctx]


@needs_ops
@pytest.mark.parametrize(
    "dtype,cache",
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
@pytest.mark.parametrize("window", [None, 7, 300])
# a prompt from its start (several tasks of 96 rows; 600 keys: chunks of 256 and a tail), a chunk
# after cached tokens (a long prompt's later chunk, a cached prefix), and a row or two
@pytest.mark.parametrize("start,count", [(0, 600), (0, 19), (500, 70), (3, 1)])
# query heads per kv head 2, 5 and 3 (SmolLM2's); head sizes 32, 24 (no multiple of 16) and 64
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 32), (5, 1, 24), (9, 3, 64)])
def test_prefill_attention_matches_the_gathering_path(
    dtype, cache, window, start, count, heads, kv_heads, d
):
    """One sequence's new tokens against its whole context in the paged pool, causal by position
    and within the window, with no mask: within 3x torch's path's distance from the same attention
    in float64 (the context gathered, then SDPA, causal or masked; its blocked sums round less
    than these in order over a chunk's keys: 1.4-2.5x in float32, 1.2e-6 at most); the pool
    untouched."""
    from pagechat.core.attention import _attend_one

    q, pool, slots = prefill_case(4, heads, kv_heads, d, start, count, dtype, cache)
    before = pool.clone()
    out = torch.ops.pagechat.prefill_attention(q, pool[0], pool[1], slots, start, window or 0)
    plain = _attend_one(q, pool[0], pool[1], slots, start, window)
    exact = _attend_one(q.double(), pool[0].double(), pool[1].double(), slots, start, window)
    err, torch_err = ((t.double() - exact).abs().max().item() for t in (out, plain))
    assert out.dtype == dtype and out.shape == q.shape and torch.equal(pool, before)
    assert err <= max(3 * torch_err, 2e-6)


@needs_ops
@pytest.mark.parametrize(
    "dtype,cache",
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
def test_write_kv_writes_what_index_copy_writes(dtype, cache):
    """A prompt's K and V (strided views of the qkv rows, as the model's are) land in the caches
    as torch's cast then index_copy_ puts them, bit for bit (float16 and bf16 round to nearest,
    ties to even, as torch's casts), the other slots untouched; a slot outside the pool is an
    error that writes nothing."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, t = 9, 3, 64, 300  # more rows than one thread's grain
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 40).to(dtype)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    pool = torch.randn(2, 700, kv_heads, d, generator=g).to(cache)
    slots = torch.randperm(700, generator=g)[:t]
    ours, theirs = pool.clone(), pool.clone()
    torch.ops.pagechat.write_kv(k, v, ours[0], ours[1], slots)
    theirs[0].index_copy_(0, slots, k.to(cache))
    theirs[1].index_copy_(0, slots, v.to(cache))
    assert torch.equal(ours, theirs)
    bad = slots.clone()
    bad[-1] = 700
    with pytest.raises(RuntimeError, match="write_kv: a slot outside the caches' 700"):
        torch.ops.pagechat.write_kv(k, v, ours[0], ours[1], bad)
    assert torch.equal(ours, theirs)
    with pytest.raises(RuntimeError, match="write_kv: int64 slot_mapping"):
        torch.ops.pagechat.write_kv(k, v, ours[0], ours[1], slots[:-1])


PREFILL_BITS = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_ops import prefill_case
from pagechat.core import ops
ops.fused(torch.device("cpu"), torch.float32)
q, pool, slots = prefill_case(5, 9, 3, 64, 40, 700)
torch.save(torch.ops.pagechat.prefill_attention(q, pool[0], pool[1], slots, 40, 0), {path!r})
"""


@needs_ops
def test_prefill_attention_gives_the_same_bits_on_any_threads_and_on_avx2(tmp_path):
    """Each output is the same sums in the same order whoever computes it: one thread or eight,
    and PAGECHAT_KERNELS=avx2's 8-float tiles or AVX512's 16-float ones (where the CPU has them)."""
    q, pool, slots = prefill_case(5, 9, 3, 64, 40, 700)
    outs = []
    was = torch.get_num_threads()
    try:
        for threads in (1, 8):
            torch.set_num_threads(threads)
            outs.append(torch.ops.pagechat.prefill_attention(q, pool[0], pool[1], slots, 40, 0))
    finally:
        torch.set_num_threads(was)
    assert torch.equal(outs[0], outs[1])
    path = tmp_path / "avx2.pt"
    code = PREFILL_BITS.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "PAGECHAT_KERNELS": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(torch.load(path), outs[0])


@needs_ops
def test_prefill_attention_refuses_what_it_cannot_read():
    q, pool, slots = prefill_case(6, 4, 2, 32, 10, 20)
    attend = torch.ops.pagechat.prefill_attention
    with pytest.raises(RuntimeError, match=r"prefill_attention: int64 slots \[start \+ count\]"):
        attend(q, pool[0], pool[1], slots[:-1], 10, 0)
    with pytest.raises(RuntimeError, match="int64 slots"):
        attend(q, pool[0], pool[1], slots.int(), 10, 0)
    with pytest.raises(RuntimeError, match="prefill_attention: a slot outside the caches' 70"):
        attend(q, pool[0], pool[1], torch.cat([slots[:-1], torch.tensor([70])]), 10, 0)
    with pytest.raises(RuntimeError, match="KV dividing H"):
        attend(q[:, :3], pool[0], pool[1], slots, 10, 0)
    with pytest.raises(RuntimeError, match="D a multiple of 8"):
        attend(q[..., :12], pool[0][..., :12], pool[1][..., :12], slots, 10, 0)


@needs_ops
def test_decode_attention_of_several_sequences_equals_one_call_each(eight_threads):
    """Three sequences' three new tokens each (a step graph's verification) in one call give each
    row the sums that one call per sequence (the eager step's) gives, bit for bit, contexts of
    600-1,300 keys included (where one row a sequence would be cut into pieces)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, n = 6, 2, 32, 3
    starts = (5, 600, 1300)
    ctx = max(starts) + n
    gather = torch.stack([torch.randperm(2 * ctx, generator=g)[:ctx] for _ in starts])
    positions = torch.tensor([[s + i for i in range(n)] for s in starts])
    slot_mapping = gather.gather(1, positions).flatten()
    q = torch.randn(3 * n, heads, d, generator=g).bfloat16()
    k, v = (torch.randn(3 * n, kv_heads, d, generator=g).bfloat16() for _ in range(2))
    pool = torch.randn(2, 2 * ctx, kv_heads, d, generator=g).bfloat16()
    together = torch.ops.pagechat.decode_attention(
        q, k, v, pool[0], pool[1], slot_mapping, gather.flatten(), positions, 0
    )
    for s in range(3):
        rows = slice(s * n, s * n + n)
        alone = torch.ops.pagechat.decode_attention(
            q[rows], k[rows], v[rows], pool[0], pool[1], slot_mapping[rows], gather[s],
            positions[s : s + 1], 0,
        )  # fmt: skip
        assert torch.equal(alone, together[rows])
