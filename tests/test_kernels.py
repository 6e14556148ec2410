"""pagechat's matmul kernels (quant/kernels.cpp: int8, AWQ int4, float32/bf16) against a
dequantise-then-matmul reference, their place in the layers and the engine, and the fallback to
torch's kernels.

The kernel is built once per machine and source (10.6 s with g++ here) into the user cache, and
loaded from there in milliseconds by every later session. Tolerances: against a float64 reference
computed from the same int16-quantised activations the kernel sums exactly in integers, so only its
float32 block sums differ (rel <= 1e-6); against the float activations each output may move by the
activations' rounding, at most half a level (1/32767 of its block's max) times |weight| summed
(`rounding_bound`; over a whole output row that is rel ~2e-5, torch's bf16 activations ~3e-3).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from pagechat.core import native
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.quant import kernels
from pagechat.quant.checkpoint import quantize_checkpoint
from pagechat.quant.layers import INT4_KERNEL_PATH, Int4Linear, Int8WOLinear
from pagechat.quant.pack import quantize_groups

CPU = torch.device("cpu")
CAN_BUILD = (
    native.enabled()
    and native._cpu_ok()
    and shutil.which("c++") is not None
    and (shutil.which("ninja") is not None or native._has_ninja_module())
)
needs_kernel = pytest.mark.skipif(
    not CAN_BUILD, reason="needs an AVX2 CPU, g++ and ninja, and PAGECHAT_KERNELS unset"
)

# the int8 kernel's layouts: both where the CPU runs both (panels: AVX512-VNNI); int4 is in
# panels on every CPU
INT8_LAYOUTS = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(not kernels.INT8_PANELS, reason="needs AVX512-VNNI"),
    ),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 rows [N, K] and bf16 row scales, as Int8WOLinear quantises them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    layer = Int8WOLinear.from_float(w, None, CPU)  # in either layout
    return kernels.int8_rows(layer.weight)[:n], layer.scales[:n]


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32, round(x * 32767 / max|x|) * (max|x| / 32767),
    with the same float32 operations (so the same roundings)."""
    b = x.float().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    return (torch.round(b * inv).double() * (amax / 32767.0).double()).reshape(x.shape)


def rounding_bound(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The most each output can move when x is rounded per block: sum |w| * half a level."""
    b = x.double().reshape(x.shape[0], -1, 32)
    half_level = (b.abs().amax(-1, keepdim=True) / 32767 / 2).expand_as(b).reshape(x.shape)
    return half_level @ (q.double().abs() * scales.double().unsqueeze(1)).t()


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scales.double().unsqueeze(1)).t()


@pytest.fixture(scope="module")
def kernel():
    op = kernels.op("int8_linear")
    assert op is not None, "the kernel did not build on a host that can build it (see the log)"
    return op


# odd n (tails of the 4-row tiles and of each thread's range), k odd multiples of 32
@needs_kernel
@pytest.mark.parametrize("panels", INT8_LAYOUTS)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (13, 160), (48, 64), (257, 544), (1000, 288)])
def test_kernel_matches_dequantised_matmul_at_every_batch_size(kernel, n, k, panels):
    q, s = int8_weight(n, k, seed=n)
    packed = kernels.int8_pack(q, s, panels)
    assert torch.equal(kernels.int8_rows(packed[0])[:n], q)
    ids = torch.tensor([n - 1, 0, n // 2])  # a tied embedding's lookups
    assert torch.equal(kernels.int8_rows(packed[0], ids), q[ids])
    for dtype in (torch.float32, torch.bfloat16):  # prefill's GEMM weights, exact
        rows = kernels.int8_rows(packed[0], dtype=dtype)
        assert rows.dtype == dtype and torch.equal(rows[:n], q.to(dtype))
    g = torch.Generator().manual_seed(k)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
        y = kernel(x, *packed)
        assert y.shape == (m, n + (-n % 16 if panels else 0)) and y.dtype == torch.float32
        assert torch.all(y[:, n:] == 0)  # the panels' padding rows
        y = y[:, :n]
        assert rel(y, reference(quantised_activations(x), q, s)) <= 1e-6, (m, n, k)
        err = (y.double() - reference(x, q, s)).abs()
        assert torch.all(err <= rounding_bound(x, q, s) * 1.001 + 1e-6), (m, n, k)
        if n >= 13:  # enough outputs for a norm
            assert rel(y, reference(x, q, s)) <= 1e-4, (m, n, k)


@needs_kernel
def test_kernel_takes_bf16_activations_and_rows_with_outliers_or_zeros(kernel):
    q, s = int8_weight(64, 128, seed=1)
    x = torch.randn(5, 128)
    x[0, 3] = 1e4  # an outlier costs precision only to its own block of 32
    x[1, 32:64] = 0  # a block of zeros: scale 0, no division by it
    x[2] = 0
    y = kernel(x, q, s)
    assert rel(y, reference(quantised_activations(x), q, s)) <= 1e-6
    assert rel(y[1:], reference(x[1:], q, s)) <= 1e-4 and torch.all(y[2] == 0)
    xb = x.bfloat16()  # the same sums, rounded once to the activations' dtype
    for xl in (xb, x.half()):
        y = kernel(xl, q, s)
        assert y.dtype == xl.dtype and torch.equal(y, kernel(xl.float(), q, s).to(xl.dtype))


@needs_kernel
def test_kernel_passes_on_nan_and_inf(kernel):
    """A broken activation must not come out as a finite number: the engine checks logits."""
    q, s = int8_weight(16, 64, seed=2)
    x = torch.randn(3, 64)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    y = kernel(x, q, s)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[1]).any()
    assert torch.isfinite(y[2]).all()


@needs_kernel
def test_kernel_refuses_shapes_it_cannot_take(kernel):
    q, s = int8_weight(8, 64, seed=3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(1, 48), q[:, :48].contiguous(), s)
    with pytest.raises(RuntimeError, match="int8 weight"):
        kernel(torch.randn(1, 64), q.float(), s)


@needs_kernel
@pytest.mark.skipif(not kernels.BF16_DOT, reason="needs AVX512-BF16")
@pytest.mark.parametrize("n,k", [(1, 8), (7, 40), (13, 200), (257, 576), (1000, 296), (64, 1536)])
def test_bf16_dot_kernel_matches_matmul_at_every_batch_size(kernel, n, k):
    """vdpbf16ps's products of bf16 values are exact and its sums float32: each output is the
    exact dot product rounded once to bf16, give or take the float32 sums' error, at every row
    count up to the rows the layers give it and past (a tile of 4, 3, 2 or 1 rows, a K tail of 8,
    16 or 24)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    rows = [*range(1, 18), 31, 32, 33, kernels.DOT_ROWS]
    x = torch.randn(max(rows), k, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    for m in rows:
        y = kernels.float_linear(x[:m], w)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # one bf16 rounding of the exact value: within half a bf16 step (2^-8 relative), plus the
        # float32 sums' error
        bound = exact[:m].abs() * 2**-8 + 1e-5 * (x[:m].double().abs() @ w.double().abs().t())
        assert ((y.double() - exact[:m]).abs() <= bound).all(), (m, n, k)
        assert torch.equal(y, torch.ops.pagechat.float_linear(x[:m], w, True))
    # float32 activations (a bf16-wo layer of a float32 model) keep the exact AVX2 tile
    x32 = x[:5].float()
    assert rel(kernels.float_linear(x32, w), x32.double() @ w.double().t()) <= 1e-6


@needs_kernel
@pytest.mark.parametrize("panels", INT8_LAYOUTS)
@pytest.mark.parametrize("n", [96, 37])  # 37: panels padded to 48 rows, cut off again
def test_layer_runs_the_kernel_for_up_to_16_rows_and_a_float32_matmul_beyond(kernel, panels, n):
    q, s = int8_weight(n, 256, seed=7)
    layer = Int8WOLinear(q, s, None, CPU, panels=panels)
    assert layer.path == f"{kernels.INT8_PATH} <= 16 rows, else GEMM" and layer.kernel is kernel
    assert (layer.weight.dim() == 3) == panels
    torch_only = Int8WOLinear(q, s, None, CPU, path="int8pack-cpu")
    assert torch_only.kernel is None and torch_only.path == "int8pack-cpu"
    x = torch.randn(17, 256)
    deq = reference(x, q, s)
    assert layer(x[:16]).shape == (16, n) and rel(layer(x[:16]), deq[:16]) <= 1e-4  # the kernel
    assert layer(x[:16]).is_contiguous()  # as the fused ops after it take rows
    assert rel(torch_only(x[:16]), deq[:16]) > 1e-4  # torch's, with bf16 activations
    assert layer(x).shape == (17, n) and rel(layer(x), deq) <= 1e-6  # 17 rows: a float32 GEMM
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(x[:3].reshape(1, 3, 256)).shape == (1, 3, n)


def int4_weight(n: int, k: int, group: int, seed: int):
    """Random AWQ-style groups in the kernel's panels of 16 rows (N padded), and the dequantised
    weight [N, K]."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, z, s = quantize_groups(w, group)
    s = s.half().float()  # AWQ's scales are fp16
    deq = (
        q.double().reshape(n, k // group, group) - z.double().unsqueeze(-1)
    ) * s.double().unsqueeze(-1)
    return *kernels.int4_pack(q, s, z), deq.reshape(n, k)


# odd n (panels: padded), groups of 1-4 blocks (96: three), batch sizes 1-16
@needs_kernel
@pytest.mark.parametrize(
    "n,k,group",
    [(1, 32, 32), (7, 96, 32), (13, 192, 64), (48, 64, 32), (257, 576, 96), (1000, 512, 128)],
)
def test_int4_kernel_matches_dequantised_matmul_at_every_batch_size(kernel, n, k, group):
    packed, s, z, deq = int4_weight(n, k, group, seed=n)
    op = kernels.op("int4_linear")
    g = torch.Generator().manual_seed(k)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
        y = op(x, packed, s, z, group)
        assert y.shape == (m, n + -n % 16) and y.dtype == torch.float32
        assert torch.all(y[:, n:] == 0)  # the panels' padding rows
        y = y[:, :n]
        # the zero's share is taken off in float: a few float32 roundings of the larger sums
        assert rel(y, quantised_activations(x) @ deq.t()) <= 1e-5, (m, n, k)
        if n >= 13:
            assert rel(y, x.double() @ deq.t()) <= 1e-4, (m, n, k)
    dequantize = kernels.op("int4_dequantize")
    assert torch.equal(dequantize(packed, s, z, group)[:n], deq.float())
    bf16 = dequantize(packed, s, z, group, dtype=torch.bfloat16)[:n]  # prefill's bf16 GEMM
    assert torch.equal(bf16, deq.float().bfloat16())  # rounded as torch rounds
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])  # a tied embedding's lookups
    assert torch.equal(dequantize(packed, s, z, group, ids), deq.float()[ids])


@needs_kernel
def test_int4_kernel_passes_on_nan_and_refuses_bad_shapes(kernel):
    packed, s, z, _ = int4_weight(16, 64, 32, seed=2)
    op = kernels.op("int4_linear")
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    y = op(x, packed, s, z, 32)
    assert not torch.isfinite(y[0]).any() and torch.isfinite(y[1]).all()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x, packed, s, z, 16)
    with pytest.raises(RuntimeError, match="float32 or fp16 scales"):
        op(x, packed, s.double(), z, 32)
    with pytest.raises(RuntimeError, match="in panels"):
        op(x, packed.reshape(16, 32), s, z, 32)  # a weight in rows, as the old layout was
    with pytest.raises(RuntimeError, match="K inputs"):
        op(torch.randn(2, 96), packed, s, z, 32)
    with pytest.raises(RuntimeError, match="within the weight's 16 rows"):
        kernels.op("int4_dequantize")(packed, s, z, 32, torch.tensor([16]))


def within_higham_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y = x @ w^T as float32 sums of k products in any order: each output within gamma_k * sum
    |x_i w_i| of the exact product (Higham's bound), which holds for a single output under
    cancellation, as rel does not."""
    ku = x.shape[1] * 2.0**-24
    exact = x.double() @ w.double().t()
    bound = ku / (1 - ku) * (x.double().abs() @ w.double().abs().t())
    return y.shape == exact.shape and bool(torch.all((y.double() - exact).abs() <= bound))


# k: tails of 8 (every k here but 576), 16 (48) and 24 (56) past the AVX512 tile's 32 bf16 inputs
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,k", [(1, 8), (7, 40), (13, 200), (257, 576), (1000, 296), (9, 48), (5, 56)]
)
def test_float_kernel_matches_matmul_at_every_batch_size(kernel, dtype, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    op = kernels.op("float_linear")
    g = torch.Generator().manual_seed(k)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=g)
        assert within_higham_bound(op(x, w), x, w), (m, n, k)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(torch.randn(1, k + 1), torch.randn(n, k + 1).to(dtype))


# prefill's GEMM: whole tiles of 6 (AVX2) and 8 rows (AVX512), and the rest; more rows than the
# decode kernels take
GEMM_ROWS = (1, 6, 8, 17, 130)


# n: one AVX512 panel (48), tails of both ISAs' panels; k: tails of their 16- and 8-wide blocks
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(48, 16), (37, 40), (5, 9), (960, 576), (100, 333), (3, 1536)])
def test_float_gemm_within_higham_bound_of_the_exact_product(kernel, dtype, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    g = torch.Generator().manual_seed(k)
    for m in GEMM_ROWS:
        x = torch.randn(m, k, generator=g)
        y = kernels.float_gemm(x, w)
        assert y.dtype == torch.float32 and within_higham_bound(y, x, w), (m, n, k)


@needs_kernel
@pytest.mark.parametrize("panels", INT8_LAYOUTS)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("n,k", [(5, 32), (37, 64), (96, 576)])
def test_int8_gemm_within_higham_bound_of_the_dequantised_product(kernel, panels, grouped, n, k):
    g = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    # a row's bf16 scale (int8-wo), or Q8_0's fp16 one per group of 32
    s = (
        torch.rand(n, k // 32, generator=g).half()
        if grouped
        else torch.rand(n, generator=g).bfloat16()
    )
    w, scales = kernels.int8_pack(q, s, panels)
    deq = kernels.int8_dequantize(w, scales)  # exact: an int8 times an fp16 or bf16 scale
    for m in GEMM_ROWS:
        x = torch.randn(m, k, generator=g)
        assert within_higham_bound(kernels.op("int8_gemm")(x, w, scales), x, deq), m


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(7, 96, 32), (48, 64, 32), (257, 576, 96)])
def test_int4_gemm_within_higham_bound_of_the_dequantised_product(kernel, n, k, group):
    packed, s, z, deq = int4_weight(n, k, group, seed=n)
    rows = kernels.stored_rows(n, True)  # the padded rows' outputs are 0
    padded = torch.cat([deq, deq.new_zeros(rows - n, k)])
    g = torch.Generator().manual_seed(k)
    for m in GEMM_ROWS:
        x = torch.randn(m, k, generator=g)
        y = kernels.op("int4_gemm")(x, packed, s, z, group)
        assert within_higham_bound(y, x, padded), m


@needs_kernel
def test_gemm_gives_the_same_bits_on_any_number_of_threads(kernel):
    """Threads take panels, and parts of the rows where there are few panels: each output is
    still one sum over k in order."""
    x, w = torch.randn(300, 64), torch.randn(40, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.float_gemm(x, w)
        torch.set_num_threads(7)  # more threads than the one panel: the rows in parts
        assert torch.equal(kernels.float_gemm(x, w), one)
    finally:
        torch.set_num_threads(threads)
    assert kernels.float_gemm(x[:0], w).shape == (0, 40)
    assert kernels.float_gemm(x, w[:0]).shape == (300, 0)


@needs_kernel
def test_gemms_refuse_what_they_do_not_multiply(kernel):
    gemm = kernels.float_gemm
    with pytest.raises(RuntimeError, match="float_gemm: float32 activations"):
        gemm(torch.randn(4, 16).to(torch.bfloat16), torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="float32 or bf16 weight"):
        gemm(torch.randn(4, 16), torch.randn(8, 16).half())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemm(torch.randn(4, 16), torch.randn(8, 24))
    w, scales = kernels.int8_pack(torch.ones(16, 64, dtype=torch.int8), torch.ones(16))
    with pytest.raises(RuntimeError, match="int8_gemm: float32 activations"):
        kernels.op("int8_gemm")(torch.randn(4, 64).half(), w, scales)
    with pytest.raises(RuntimeError, match="int8_gemm: weight"):
        kernels.op("int8_gemm")(torch.randn(4, 96), w, scales)
    packed, s, z, _ = int4_weight(16, 64, 32, seed=1)
    with pytest.raises(RuntimeError, match="int4_gemm: x \\[M, K\\] and weights of K inputs"):
        kernels.op("int4_gemm")(torch.randn(4, 96), packed, s, z, 32)


@needs_kernel
@pytest.mark.parametrize("n", [96, 37])  # 37: panels padded to 48 rows, cut off again
def test_awq_layer_runs_the_int4_kernel_for_up_to_16_rows_and_float32_beyond(kernel, n):
    *_, deq = int4_weight(n, 256, 64, seed=4)
    q, zt, st = quantize_groups(deq.float(), 64)  # already on the grid: the same groups again
    layer = Int4Linear(q.t(), zt.t(), st.t(), None, 64, CPU)
    assert layer.path == INT4_KERNEL_PATH and layer.weight_packed.dim() == 3
    x = torch.randn(17, 256)
    ref = x.double() @ deq.t()
    assert layer(x[:16]).shape == (16, n) and rel(layer(x[:16]), ref[:16]) <= 1e-4  # the kernel
    assert layer(x[:16]).is_contiguous()  # as the fused ops after it take rows
    assert layer(x).shape == (17, n) and rel(layer(x), ref) <= 1e-6  # 17 rows: float32 GEMM
    assert layer(x[:2].bfloat16()).dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("native_bf16", [False, True])
def test_prefill_rows_of_bf16_activations_run_a_bf16_gemm_only_where_the_cpu_has_bf16(
    kernel, monkeypatch, native_bf16
):
    F = torch.nn.functional
    monkeypatch.setattr("pagechat.quant.layers.cpu_has_native_bf16", lambda: native_bf16)
    int8 = Int8WOLinear.from_float(torch.randn(96, 256), None, CPU)
    packed, s, z, deq = int4_weight(96, 256, 64, seed=5)
    q, zt, st = quantize_groups(deq.float(), 64)
    awq = Int4Linear(q.t(), zt.t(), st.t(), None, 64, CPU)
    x = torch.randn(17, 256).bfloat16()  # more rows than the kernels take: a GEMM
    w8, s8, w4 = kernels.int8_rows(int8.weight).float(), int8.scales.float(), deq.float()
    if native_bf16:  # AMX's bf16 GEMM on the dequantised weights (int8 values exact in bf16)
        want8 = F.linear(x, w8.bfloat16()) * s8.bfloat16()
        want4 = F.linear(x, w4.bfloat16())
    else:  # pagechat's float32 GEMM on the weights as stored, rounded to bf16 once
        ops = torch.ops.pagechat
        want8 = ops.int8_gemm(x.float(), int8.weight, int8.scales).bfloat16()
        want4 = ops.int4_gemm(x.float(), awq.weight_packed, awq.scales, awq.offsets, 64).bfloat16()

    assert torch.equal(int8(x), want8) and torch.equal(awq(x), want4)
    assert int8(x.float()).dtype == awq(x.float()).dtype == torch.float32  # float32: float32's


@needs_kernel
def test_engine_with_the_int4_kernel_decodes_as_the_exact_dequantised_model(
    kernel, tiny_llama, tmp_path
):
    """An AWQ (RTN) checkpoint: greedy tokens with the kernel (traced steps record it) equal those
    of the same weights dequantised in float32; the logits differ by the head's roundings of
    slightly different inputs (seen: 1.7e-3 with a bf16 head)."""
    awq = quantize_checkpoint(tiny_llama, tmp_path / "awq", "rtn", 32).out_dir
    e = Engine(awq, EngineConfig(kv_blocks=64, dtype="float32"))
    assert {m.path for m in e.model.modules() if isinstance(m, Int4Linear)} == {INT4_KERNEL_PATH}
    ref = Engine(awq, EngineConfig(kv_blocks=64, dtype="float32", graphs=False))
    for name, m in list(ref.model.named_modules()):
        if isinstance(m, Int4Linear):
            parent, _, attr = name.rpartition(".")
            deq = kernels.op("int4_dequantize")(m.weight_packed, m.scales, m.offsets, m.group)
            deq = deq[: m.out_features]  # in panels, padded to a multiple of 16 rows
            layer = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            layer.weight.data, layer.bias = deq, m.bias
            setattr(ref.model.get_submodule(parent), attr, layer)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    assert [o.output_ids for o in e.generate(prompts, params)] == [
        o.output_ids for o in ref.generate(prompts, params)
    ]
    ids = [5, 9, 3, 77, 120, 6, 7]
    assert rel(e.runner.score(ids), ref.runner.score(ids)) <= 3e-3


@needs_kernel
@pytest.mark.parametrize("nbytes", [128, 128 * 4097, 128 * 70001])  # the threads' split and tails
def test_stream_read_reads_every_byte(kernel, nbytes):
    """The bench's bandwidth figure reads every byte: one bit anywhere shows in the result."""
    op = kernels.op("stream_read")
    t = torch.zeros(nbytes, dtype=torch.uint8)
    assert op(t) == 0
    for at in (0, nbytes // 3, nbytes - 1):
        t.zero_()
        t[at] = 1 << (at % 7)  # not bit 63 of a word: the result is a signed int64
        assert op(t) == 1 << (8 * (at % 8) + at % 7), at


def test_a_layer_whose_k_is_no_multiple_of_32_keeps_torch_path():
    # 48, not an odd k: torch 2.13's int8pack kernel crashes at k = 24 or 40 on an AVX512 host
    layer = Int8WOLinear.from_float(torch.randn(16, 48), None, CPU)
    assert layer.kernel is None and layer.path == "int8pack-cpu"
    x = torch.randn(2, 48)
    assert rel(layer(x), reference(x, layer.weight, layer.scales)) <= 5e-3


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """native.library() decided again in this test, with an empty cache and PAGECHAT_KERNELS
    unset; as before after."""
    monkeypatch.setenv("PAGECHAT_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGECHAT_KERNELS", raising=False)
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def test_pagechat_kernels_0_forces_torch_path(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setenv("PAGECHAT_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="pagechat.core.native"):
        layer = Int8WOLinear.from_float(torch.randn(32, 64), None, CPU)
        Int8WOLinear.from_float(torch.randn(32, 64), None, CPU)
    assert layer.kernel is None and layer.path == "int8pack-cpu"
    assert [r.message for r in caplog.records] == [
        "pagechat matmul kernels off: PAGECHAT_KERNELS=0; torch's ops run instead"
    ]  # once per process, not once per layer


@pytest.mark.parametrize(
    "broken,why",
    [
        ("cpu", "this CPU lacks AVX2/FMA/F16C"),
        ("compiler", "no C++ compiler and ninja to build them"),
        ("source", "the build failed"),
    ],
)
def test_no_kernel_falls_back_to_torch_and_says_why_once(
    fresh_kernels, monkeypatch, tmp_path, caplog, broken, why
):
    if broken == "cpu":
        monkeypatch.setattr(native, "_cpu_ok", lambda: False)
    elif broken == "compiler":
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
        monkeypatch.setattr(native, "_has_ninja_module", lambda: False)
    else:
        bad = tmp_path / "kernels.cpp"
        bad.write_text("#error a source that does not compile\n")
        monkeypatch.setattr(kernels, "SOURCE", bad)
    with caplog.at_level(logging.WARNING, logger="pagechat.core.native"):
        layers = [Int8WOLinear.from_float(torch.randn(32, 64), None, CPU) for _ in range(2)]
    assert all(la.kernel is None and la.path == "int8pack-cpu" for la in layers)
    assert len(caplog.records) == 1 and why in caplog.records[0].message
    x = torch.randn(2, 64)
    assert rel(layers[0](x), reference(x, layers[0].weight, layers[0].scales)) <= 5e-3


def _torch_engine(model_dir, path: str) -> Engine:
    """int8-wo with every layer on torch's path (eager: no trace recorded the kernel)."""
    e = Engine(
        model_dir, EngineConfig(kv_blocks=64, dtype="float32", quant="int8-wo", graphs=False)
    )
    for m in e.model.modules():
        if isinstance(m, Int8WOLinear):
            m.kernel, m.torch_path, m.path, m.padded = None, path, path, False
            m.weight = kernels.int8_rows(m.weight)[: m.out_features]  # from panels, if in them
            m.scales = m.scales[: m.out_features]
            m.scales = m.scales.float() if path == "dequant" else m.scales
    return e


@needs_kernel
def test_engine_with_the_kernel_decodes_as_the_exact_dequantised_model(kernel, tiny_llama):
    """Traced decode steps record the kernel (torch.ops.pagechat), and greedy tokens equal those of
    the same int8 weights dequantised in float32. The logits differ by the bf16 lm_head's roundings
    of slightly different inputs, less than torch's int8pack path (bf16 activations) differs."""
    e = Engine(tiny_llama, EngineConfig(kv_blocks=64, dtype="float32", quant="int8-wo"))
    paths = {m.path for m in e.model.modules() if isinstance(m, Int8WOLinear)}
    assert paths == {f"{kernels.INT8_PATH} <= 16 rows, else GEMM"}
    ref = _torch_engine(tiny_llama, "dequant")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    got = [o.output_ids for o in e.generate(prompts, params)]
    assert got == [o.output_ids for o in ref.generate(prompts, params)]
    ids = [5, 9, 3, 77, 120, 6, 7]
    exact = ref.runner.score(ids)
    kernel_err = rel(e.runner.score(ids), exact)
    torch_err = rel(_torch_engine(tiny_llama, "int8pack-cpu").runner.score(ids), exact)
    assert kernel_err <= 2e-3 and kernel_err < torch_err / 2


@needs_kernel
def test_a_float_models_dense_layers_run_the_float_kernel_for_decode_rows(kernel):
    from pagechat.core.model import linear
    from pagechat.quant.layers import FloatLinear, on_kernel

    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    layer = on_kernel(linear(w, b))
    assert isinstance(layer, FloatLinear) and layer.weight is not None
    assert type(on_kernel(linear(w.half()))) is torch.nn.Linear  # float16 stays torch's
    assert type(on_kernel(linear(torch.randn(96, 60)))) is torch.nn.Linear  # K not in 8s
    # bf16 activations: up to DOT_ROWS where the CPU has AVX512-BF16, else MAX_ROWS
    rows = kernels.float_rows(torch.bfloat16, torch.bfloat16)
    assert rows == (kernels.DOT_ROWS if kernels.BF16_DOT else kernels.MAX_ROWS)
    x = torch.randn(rows + 1, 64).bfloat16()
    exact = x.double() @ w.double().t() + b.double()
    # the kernel's rows: float32 sums of the same products, rounded to bf16 once, then the bias
    assert rel(layer(x[:rows]), exact[:rows]) <= 1e-2 and layer(x[:rows]).dtype == torch.bfloat16
    assert torch.equal(layer(x[:rows]), kernels.float_linear(x[:rows], w) + b)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b))  # one more: torch's matmul
    w32, b32, x32 = w.float(), b.float(), x[:17].float()
    layer = on_kernel(linear(w32, b32))  # float32: the same kernel, in place of MKL's matmul
    assert isinstance(layer, FloatLinear)
    kernel_rows = torch.ops.pagechat.float_linear(x32[:16], w32) + b32
    assert torch.equal(layer(x32[:16]), kernel_rows) and rel(kernel_rows, exact[:16]) <= 1e-5
    assert torch.equal(layer(x32), torch.nn.functional.linear(x32, w32, b32))


def test_pagechat_kernels_avx2_runs_the_avx2_code_whatever_the_cpu_has():
    """PAGECHAT_KERNELS=avx2 (read at import by the Python side, and by the C++ side): int8 in rows,
    int4 on its AVX2 panel kernel, float rows and the GEMM on their AVX2 tiles. On a CPU with
    AVX512-VNNI the tests above ran the VNNI kernels and the AVX512 tiles, so those tests run
    again here, on AVX2."""
    env = {**os.environ, "PAGECHAT_KERNELS": "avx2"}
    code = (
        "from pagechat.quant import kernels as k; print(k.INT8_PANELS, k.INT4_PATH, k.FLOAT_PATH)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["False", "int4-avx2", "avx2"], out.stderr
    if CAN_BUILD and kernels.INT8_PANELS:
        tests = "int4_kernel or gemm or float_kernel"
        args = [__file__, "-q", "-p", "no:cacheprovider", "-k", tests]
        out = subprocess.run(
            [sys.executable, "-m", "pytest", *args], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout[-2000:]  # 5 where no test was selected


def test_a_step_graph_records_every_kernel_layers_few_rows_side():
    """Step graphs take up to MAX_GRAPH_TOKENS rows and record one side of each layer's row
    branch: every kernel layer must take at least that many rows on its kernel."""
    from pagechat.core.graphs import MAX_GRAPH_TOKENS

    assert MAX_GRAPH_TOKENS <= kernels.MAX_ROWS
    for x_dtype in (torch.float32, torch.bfloat16):
        for w_dtype in (torch.float32, torch.bfloat16):
            assert MAX_GRAPH_TOKENS <= kernels.float_rows(x_dtype, w_dtype)
