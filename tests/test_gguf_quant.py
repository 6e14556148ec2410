"""A GGUF's quantised tensors in pagechat's layers, against the gguf package (ggml's own Python
code) as the oracle: every type pagechat runs as it is dequantises to gguf's numbers bit for bit
(float32), in each kernel layout and in torch's fallback; the kernels' products match a matmul on
those weights; every other type is requantised to exactly what gguf's Q8_0 makes of gguf's
dequantisation.

The blocks are random bytes with finite fp16 scales written in, so every nibble, 6-bit scale and
min pattern occurs, not only those a quantiser makes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from pagechat.core.gguf_model import GGMLTensor
from pagechat.quant import kernels
from pagechat.quant.ggml import StackedLinear, gguf_layer, label, unpack_int4, unpack_q8_0
from pagechat.quant.head import Int4Head, Int8Head
from pagechat.quant.layers import INT4_KERNEL_PATH, INT8_KERNEL_PATH, Int4Linear, Int8WOLinear
from test_kernels import INT8_LAYOUTS, needs_kernel, quantised_activations, rel

CPU = torch.device("cpu")
# the byte offsets of each type's fp16 numbers (scales, mins) in a block
FP16_AT = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.IQ4_NL: (0,),
}


def random_blocks(qtype: T, n: int, k: int, seed: int) -> GGMLTensor:
    """n rows of k values of qtype: random bytes, with its fp16 numbers set to finite values of
    either sign and magnitudes from 1e-4 to 1."""
    block, size = GGML_QUANT_SIZES[qtype]
    g = np.random.default_rng(seed)
    b = g.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        d = g.standard_normal((n, k // block)) * 10.0 ** g.integers(-4, 0, (n, k // block))
        b[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return GGMLTensor(f"t.{qtype.name}", qtype, (n, k), torch.from_numpy(b.reshape(n, -1)))


def native_layer(t: GGMLTensor, panels: bool = False, path: str | None = None):
    """A native type's layer (or on torch's `path`): Q8_0 in the int8 layout `panels` picks, the
    4-bit types in panels."""
    if t.type == T.Q8_0:
        return Int8WOLinear(*unpack_q8_0(t.blocks, *t.shape), None, CPU, path, panels)
    q, scales, offsets = unpack_int4(t)
    return Int4Linear(q.t(), offsets.t(), scales.t(), None, 32, CPU, path)


def gguf_values(t: GGMLTensor) -> torch.Tensor:
    """The oracle: gguf's dequantisation, float32 [N, K]."""
    return torch.from_numpy(dequantize(t.blocks.numpy(), t.type).reshape(t.shape).copy())


def bits(x: torch.Tensor) -> torch.Tensor:
    """Float32 values as their bit patterns: equal means equal to the bit (signed zeros too)."""
    return x.contiguous().float().view(torch.int32)


def weights_of(layer) -> torch.Tensor:
    """A layer's weights dequantised by its own code [out, in], float32."""
    n = layer.out_features
    if isinstance(layer, Int4Linear):
        if layer.path == INT4_KERNEL_PATH:
            op = kernels.op("int4_dequantize")
            return op(layer.weight_packed, layer.scales, layer.offsets, layer.group)[:n]
        rows = Int4Head.embedding(layer)  # the dequant path's row reader: every row
        return rows(torch.arange(n))
    return kernels.int8_dequantize(layer.weight, layer.scales)[:n]


@needs_kernel
@pytest.mark.parametrize(
    "qtype,panels",
    [(T.Q4_0, True), (T.Q4_1, True), (T.Q4_K, True), (T.Q8_0, False)]
    + [pytest.param(T.Q8_0, True, marks=INT8_LAYOUTS[1].marks)],
)
@pytest.mark.parametrize("n", [16, 37])  # 37: panels padded
def test_native_types_dequantise_to_ggufs_numbers_bit_for_bit(qtype, n, panels):
    k = 512
    t = random_blocks(qtype, n, k, seed=n)
    layer = native_layer(t, panels)
    assert layer.path in (INT4_KERNEL_PATH, INT8_KERNEL_PATH)
    assert (layer.weight.dim() if qtype == T.Q8_0 else layer.weight_packed.dim()) == 2 + panels
    want = gguf_values(t)
    assert torch.equal(bits(weights_of(layer)), bits(want))
    ids = torch.tensor([n - 1, 0, 5, n - 1])  # a tied embedding's lookups
    emb = (Int8Head if qtype == T.Q8_0 else Int4Head).embedding(layer)
    assert torch.equal(bits(emb(ids)), bits(want[ids]))
    # the kernel's products, against a float64 matmul on those weights and the activations
    # as the kernel quantises them (offsets are taken off in float: a few float32 roundings)
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert rel(layer(x), quantised_activations(x) @ want.double().t()) <= 1e-5, m
    x = torch.randn(17, k)  # prefill: a GEMM on the dequantised weights
    assert rel(layer(x), x.double() @ want.double().t()) <= 1e-6


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0])
def test_a_files_tensor_becomes_the_layer_its_type_names(qtype):
    layer = gguf_layer(random_blocks(qtype, 16, 256, seed=1), None, torch.float32, CPU)
    assert isinstance(layer, Int8WOLinear if qtype == T.Q8_0 else Int4Linear)
    assert layer.quant_format == qtype.name == label(qtype)
    assert layer.path in (INT4_KERNEL_PATH, INT8_KERNEL_PATH)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0])
def test_torchs_fallback_computes_with_the_same_weights(qtype):
    """Where pagechat's kernels do not run (a GPU, PAGECHAT_KERNELS=0): the layer dequantises per
    call, with gguf's numbers exactly."""
    t = random_blocks(qtype, 24, 256, seed=3)
    layer = native_layer(t, path="dequant")
    want = gguf_values(t)
    assert torch.equal(bits(weights_of(layer)), bits(want))
    x = torch.randn(5, 256)
    assert rel(layer(x), x.double() @ want.double().t()) <= 1e-6


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL])
def test_other_types_are_requantised_as_ggufs_q8_0_of_ggufs_values(qtype):
    t = random_blocks(qtype, 8, 256, seed=4)
    layer = gguf_layer(t, None, torch.float32, CPU)
    assert isinstance(layer, Int8WOLinear) and layer.quant_format == f"{qtype.name}→int8"
    values = gguf_values(t).numpy()
    q8 = GGMLTensor("q8", T.Q8_0, (8, 256), torch.from_numpy(quantize(values, T.Q8_0)))
    assert torch.equal(bits(weights_of(layer)), bits(gguf_values(q8)))
    assert rel(weights_of(layer), torch.from_numpy(values)) < 1e-2  # Q8_0's rounding


def test_float_types_are_dense_layers_in_the_models_dtype():
    w = torch.randn(16, 64)
    for qtype, dtype in ((T.F32, torch.float32), (T.F16, torch.float16), (T.BF16, torch.bfloat16)):
        raw = w.to(dtype).view(torch.uint8).reshape(16, -1)
        layer = gguf_layer(GGMLTensor("w", qtype, (16, 64), raw), None, torch.bfloat16, CPU)
        assert layer.weight.dtype == torch.bfloat16
        assert torch.equal(layer.weight, w.to(dtype).to(torch.bfloat16))


@needs_kernel
def test_parts_of_different_types_stack_into_one_layer():
    """q and k as Q4_K, v as Q6_K (a Q4_K_M file): one layer per part, outputs side by side."""
    parts = [random_blocks(T.Q4_K, 64, 256, 1), random_blocks(T.Q4_K, 32, 256, 2)]
    parts.append(random_blocks(T.Q6_K, 32, 256, 3))
    layers = [gguf_layer(p, None, torch.float32, CPU) for p in parts]
    stacked = StackedLinear(layers)
    assert (stacked.in_features, stacked.out_features) == (256, 128)
    assert [type(m).__name__ for m in stacked.parts] == ["Int4Linear", "Int4Linear", "Int8WOLinear"]
    x = torch.randn(2, 256)
    want = torch.cat([weights_of(m) for m in layers])  # Q6_K's part as int8
    assert rel(stacked(x), quantised_activations(x) @ want.double().t()) <= 1e-5
