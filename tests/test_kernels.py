"""pagechat's int8 matmul kernel (quant/kernels.cpp) against a dequantise-then-matmul reference,
its place in Int8WOLinear and the engine, and the fallback to torch's kernels.

The kernel is built once per machine and source (10.6 s with g++ here) into the user cache, and
loaded from there in milliseconds by every later session. Tolerances: against a float64 reference
computed from the same int16-quantised activations the kernel sums exactly in integers, so only its
float32 block sums differ (rel <= 1e-6); against the float activations each output may move by the
activations' rounding, at most half a level (1/32767 of its block's max) times |weight| summed
(`rounding_bound`; over a whole output row that is rel ~2e-5, torch's bf16 activations ~3e-3).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.quant import kernels
from pagechat.quant.evaluate import window_logits
from pagechat.quant.layers import Int8WOLinear

CPU = torch.device("cpu")
CAN_BUILD = (
    kernels.enabled()
    and kernels._cpu_ok()
    and shutil.which("c++") is not None
    and (shutil.which("ninja") is not None or kernels._has_ninja_module())
)
needs_kernel = pytest.mark.skipif(
    not CAN_BUILD, reason="needs an AVX2 CPU, g++ and ninja, and PAGECHAT_KERNELS unset"
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 rows and bf16 row scales, as Int8WOLinear stores them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    layer = Int8WOLinear.from_float(w, None, CPU)
    return layer.weight, layer.scales


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
    op = kernels.int8_linear()
    assert op is not None, "the kernel did not build on a host that can build it (see the log)"
    return op


# odd n (tails of the 4-row tiles and of each thread's range), k odd multiples of 32
@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (13, 160), (257, 544), (1000, 288)])
def test_kernel_matches_dequantised_matmul_at_every_batch_size(kernel, n, k):
    q, s = int8_weight(n, k, seed=n)
    g = torch.Generator().manual_seed(k)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
        y = kernel(x, q, s)
        assert y.shape == (m, n) and y.dtype == torch.float32
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
    xb = x.bfloat16()
    assert rel(kernel(xb, q, s), reference(quantised_activations(xb.float()), q, s)) <= 1e-6


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
def test_layer_runs_the_kernel_for_up_to_16_rows_and_a_float32_matmul_beyond(kernel):
    w = torch.randn(96, 256)
    layer = Int8WOLinear.from_float(w, None, CPU)
    assert layer.path == "int8-avx2 <= 16 rows, else fp32" and layer.kernel is kernel
    torch_only = Int8WOLinear(layer.weight, layer.scales, None, CPU, path="int8pack-cpu")
    assert torch_only.kernel is None and torch_only.path == "int8pack-cpu"
    x = torch.randn(17, 256)
    deq = reference(x, layer.weight, layer.scales)
    assert rel(layer(x[:16]), deq[:16]) <= 1e-4  # the kernel
    assert rel(torch_only(x[:16]), deq[:16]) > 1e-4  # torch's, with bf16 activations
    assert rel(layer(x), deq) <= 1e-6  # 17 rows: float32 on the same weights and scales
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(x[:3].reshape(1, 3, 256)).shape == (1, 3, 96)


def test_a_layer_whose_k_is_no_multiple_of_32_keeps_torch_path():
    # 48, not an odd k: torch 2.13's int8pack kernel crashes at k = 24 or 40 on an AVX512 host
    layer = Int8WOLinear.from_float(torch.randn(16, 48), None, CPU)
    assert layer.kernel is None and layer.path == "int8pack-cpu"
    x = torch.randn(2, 48)
    assert rel(layer(x), reference(x, layer.weight, layer.scales)) <= 5e-3


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """kernels.int8_linear() decided again in this test, with an empty cache and PAGECHAT_KERNELS
    unset; as before after."""
    monkeypatch.setenv("PAGECHAT_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGECHAT_KERNELS", raising=False)
    kernels.int8_linear.cache_clear()
    yield
    kernels.int8_linear.cache_clear()


def test_pagechat_kernels_0_forces_torch_path(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setenv("PAGECHAT_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="pagechat.quant.kernels"):
        layer = Int8WOLinear.from_float(torch.randn(32, 64), None, CPU)
        Int8WOLinear.from_float(torch.randn(32, 64), None, CPU)
    assert layer.kernel is None and layer.path == "int8pack-cpu"
    assert [r.message for r in caplog.records] == [
        "pagechat kernels off: PAGECHAT_KERNELS=0; int8 weight-only layers use torch's"
    ]  # once per process, not once per layer


@pytest.mark.parametrize(
    "broken,why",
    [
        ("cpu", "this CPU lacks AVX2/FMA"),
        ("compiler", "no C++ compiler and ninja to build them"),
        ("source", "the build failed"),
    ],
)
def test_no_kernel_falls_back_to_torch_and_says_why_once(
    fresh_kernels, monkeypatch, tmp_path, caplog, broken, why
):
    if broken == "cpu":
        monkeypatch.setattr(kernels, "_cpu_ok", lambda: False)
    elif broken == "compiler":
        monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
        monkeypatch.setattr(kernels, "_has_ninja_module", lambda: False)
    else:
        bad = tmp_path / "kernels.cpp"
        bad.write_text("#error a source that does not compile\n")
        monkeypatch.setattr(kernels, "SOURCE", bad)
    with caplog.at_level(logging.WARNING, logger="pagechat.quant.kernels"):
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
            m.kernel, m.torch_path, m.path = None, path, path
            m.scales = m.scales.float() if path == "dequant" else m.scales
    return e


@needs_kernel
def test_engine_with_the_kernel_decodes_as_the_exact_dequantised_model(kernel, tiny_llama):
    """Traced decode steps record the kernel (torch.ops.pagechat), and greedy tokens equal those of
    the same int8 weights dequantised in float32. The logits differ by the bf16 lm_head's roundings
    of slightly different inputs, less than torch's int8pack path (bf16 activations) differs."""
    e = Engine(tiny_llama, EngineConfig(kv_blocks=64, dtype="float32", quant="int8-wo"))
    paths = {m.path for m in e.model.modules() if isinstance(m, Int8WOLinear)}
    assert paths == {"int8-avx2 <= 16 rows, else fp32"}
    ref = _torch_engine(tiny_llama, "dequant")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    got = [o.output_ids for o in e.generate(prompts, params)]
    assert got == [o.output_ids for o in ref.generate(prompts, params)]
    ids = [5, 9, 3, 77, 120, 6, 7]
    exact = window_logits(ref, ids)
    kernel_err = rel(window_logits(e, ids), exact)
    torch_err = rel(window_logits(_torch_engine(tiny_llama, "int8pack-cpu"), ids), exact)
    assert kernel_err <= 2e-3 and kernel_err < torch_err / 2
