"""Quantised linear layers the model swaps in: AWQ int4, torch int8 weight-only, bitsandbytes int8.

Each layer picks its kernel ("path") once, from the device and the shapes, and says which in `path`:
torch's int4 / int8 weight-only matmuls want bf16 activations (other dtypes hit a slow scalar loop),
so activations are cast to bf16 around the call and back; where the op is missing or the shapes
don't fit it, the weights are dequantised on every call (exact in fp32, memory stays quantised).
int8 weight-only and AWQ int4 layers on an AVX2 CPU run pagechat's own kernels (quant/kernels.py;
in panels of 16 rows where the CPU has AVX512-VNNI) for up to 16 rows (decode), faster
than torch's, and for more rows (prefill) a GEMM on the weights dequantised for the call (bf16
where the model computes in bf16 on a CPU with native bf16, else float32), faster than torch's
packed kernels there (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from pagechat.core.graphs import MAX_GRAPH_TOKENS
from pagechat.core.native import cpu_has_native_bf16
from pagechat.quant import kernels
from pagechat.quant.pack import dequantize, pack_awq, unpack_awq
from torch import nn

INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 kernels take
WEIGHT_ONLY = (
    "int8-wo",
    "bf16-wo",
    "awq",
)  # modes with float activations around low-precision weights
LLM_INT8_THRESHOLD = (
    6.0  # activation magnitude above which a column goes through the fp16 outlier matmul
)
_BF16 = torch.bfloat16
# the paths of layers on pagechat's kernels: decode's few rows run them, prefill a GEMM
INT8_KERNEL_PATH = f"{kernels.INT8_PATH} <= {kernels.MAX_ROWS} rows, else GEMM"
INT4_KERNEL_PATH = f"{kernels.INT4_PATH} <= {kernels.MAX_ROWS} rows, else GEMM"
BF16_KERNEL_PATH = f"bf16-{kernels.FLOAT_PATH} <= {kernels.MAX_ROWS} rows, else GEMM"
BF16_TORCH_PATH = f"bf16 <= {MAX_GRAPH_TOKENS} rows, else GEMM"


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of prefill's GEMM: bf16 (on weights dequantised for the call) where the
    activations are bf16 on a CPU that computes bf16 natively (AMX: several times float32's
    speed), else float32 (pagechat's GEMM, kernels.cpp's int8_gemm / int4_gemm), since a bf16
    GEMM without native bf16 is several times slower than float32."""
    return _BF16 if x.dtype == _BF16 and cpu_has_native_bf16() else torch.float32


def _has_kernel(op: str, device: torch.device) -> bool:
    key = "CPU" if device.type == "cpu" else "CUDA"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except RuntimeError:  # the op does not exist in this torch
        return False


def _sm80(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def int4_kernel_runs(k: int, group: int, device_type: str) -> bool:
    """Whether pagechat's int4 kernel runs an AWQ layer with k inputs in groups of `group` on
    device_type (deciding builds the kernels)."""
    fits = group % kernels.BLOCK == 0 and k % group == 0
    return device_type == "cpu" and fits and kernels.loaded()


def int8_kernel_runs(k: int, device_type: str) -> bool:
    """Whether pagechat's int8 kernel runs an int8 weight-only layer with k inputs on device_type
    (deciding builds the kernels)."""
    return device_type == "cpu" and k % kernels.BLOCK == 0 and kernels.loaded()


def awq_path(n: int, k: int, group: int, device: torch.device) -> str:
    """Which kernel an AWQ layer (out=n, in=k) runs on device: pagechat's int4 kernel on a CPU
    where it builds, else int4pack-cpu/-cuda or dequant."""
    if int4_kernel_runs(k, group, device.type):
        return INT4_KERNEL_PATH
    if group in INT4_GROUPS and k % group == 0:
        if (
            device.type == "cpu"
            and n % 16 == 0
            and _has_kernel("_weight_int4pack_mm_for_cpu", device)
        ):
            return "int4pack-cpu"
        # tensor-core tiles: n in 8s, k in 2 x 16 at least; the kernel needs sm80+ (torch's source)
        if (
            device.type == "cuda"
            and n % 8 == 0
            and k % 32 == 0
            and _sm80(device)
            and _has_kernel("_weight_int4pack_mm", device)
        ):
            return "int4pack-cuda"
    return "dequant"


def int8_wo_path(device: torch.device) -> str:
    """Which torch kernel an int8 weight-only layer runs on device: int8pack-cpu/-cuda, dequant."""
    if _has_kernel("_weight_int8pack_mm", device):
        return f"int8pack-{device.type}"
    return "dequant"


def int8_wo_kernel(k: int, device: torch.device):
    """pagechat's int8 kernel for a layer with k inputs on device, or None where it cannot run."""
    return kernels.op("int8_linear") if int8_kernel_runs(k, device.type) else None


def float_kernel_runs(k: int, device_type: str) -> bool:
    """Whether pagechat's float kernel runs a float32 or bf16 layer with k inputs on device_type
    (deciding builds the kernels)."""
    return device_type == "cpu" and k % 8 == 0 and kernels.loaded()


def bf16_wo_path(k: int, device_type: str) -> str:
    """Which kernel a bf16 weight-only layer with k inputs runs: pagechat's float kernel on a CPU
    where it builds (deciding builds it), else torch's bf16 matmul."""
    return BF16_KERNEL_PATH if float_kernel_runs(k, device_type) else BF16_TORCH_PATH


class FloatLinear(nn.Linear):
    """A float32 or bf16 model's dense linear on a CPU where pagechat's kernels run: up to
    kernels.float_rows rows (decode, batched decode) run its float kernel, which reads the weights
    faster than torch's matmuls (bf16's and MKL's float32 one; docs/benchmarks.md) and multiplies
    bf16 faster where the CPU has AVX512-BF16; more rows (prefill) stay torch's. Reported as a
    dense layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > kernels.float_rows(x.dtype, self.weight.dtype):
            return F.linear(x, self.weight, self.bias)
        y = kernels.float_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def on_kernel(layer: nn.Linear) -> nn.Linear:
    """A dense layer as it is, or as a FloatLinear holding the same tensors where its weight is
    float32 or bf16 on a CPU that runs pagechat's kernels (deciding builds them)."""
    w = layer.weight
    if w.dtype not in (torch.float32, _BF16) or not float_kernel_runs(w.shape[1], w.device.type):
        return layer
    out = FloatLinear(w.shape[1], w.shape[0], bias=layer.bias is not None, device="meta")
    out.weight, out.bias = layer.weight, layer.bias
    return out


def bf16_head(mode: str | None, dtype: torch.dtype) -> bool:
    """Whether lm_head (and a tied embedding) is kept in bf16: weight-only modes of fp32 models."""
    return mode in WEIGHT_ONLY and dtype == torch.float32


def _scales_and_zeros(offsets: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # torch's int4 kernels compute w = (q - 8) * scale + zero; AWQ's w = (q - z) * scale, so
    # zero = (8 - z) * scale; GGUF's w = q * scale + min, so zero = min + 8 * scale
    s = scales.float()
    zero = offsets.float() + 8 * s if offsets.is_floating_point() else (8 - offsets.float()) * s
    return torch.stack([s, zero], dim=-1).to(_BF16).contiguous()


class _WeightOnlyLinear(nn.Module):
    """What the weight-only layers share: rows flattened for `_matmul` (when not flat yet), bias
    added in the output's dtype, the leading dimensions restored."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's rows are flat already: no reshape ops per call
        y = self._matmul(x if flat else x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(_WeightOnlyLinear):
    """4-bit group-wise linear over one or more stacked checkpoint linears: an AWQ checkpoint's
    (w = (q - zero) * scale), a 4-bit LM head's, or a GGUF file's Q4_0 (zero 8), Q4_1 and Q4_K
    (w = q * scale + min)."""

    quant_format = "awq-int4"  # GGUF's layers say their type instead (quant/ggml.py)

    def __init__(
        self,
        q: torch.Tensor,
        offsets: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        group: int,
        device: torch.device,
        path: str | None = None,
    ) -> None:
        """q [K, N] values 0..15, offsets and scales [K/g, N] (AWQ's layout, unpacked): offsets
        uint8 zeros, or float mins; on pagechat's kernel in its panels (kernels.int4_pack)."""
        super().__init__()
        k, n = q.shape
        self.in_features, self.out_features, self.group = k, n, group
        self.mins = offsets.is_floating_point()
        self.path = path or awq_path(n, k, group, device)
        if self.path == INT4_KERNEL_PATH:
            offsets = offsets.t() if self.mins else offsets.t().to(torch.uint8)
            tensors = kernels.int4_pack(q.t().to(torch.uint8), scales.t(), offsets)
            for name, t in zip(("weight_packed", "scales", "offsets"), tensors, strict=True):
                self.register_buffer(name, t.to(device))
            # the rows past n are padding: their outputs are cut off
            self.padded = n % kernels.PANEL != 0
        elif self.path == "int4pack-cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.t().contiguous().to(torch.int32), 2
            )
            self.register_buffer("weight_packed", packed.to(device))
            self.register_buffer("scales_zeros", _scales_and_zeros(offsets, scales).to(device))
        elif self.path == "int4pack-cuda":
            qt = q.t().contiguous().to(device=device, dtype=torch.uint8)
            inner = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
            self.register_buffer(
                "weight_packed",
                torch.ops.aten._convert_weight_to_int4pack((qt[:, 0::2] << 4) | qt[:, 1::2], inner),
            )  # byte i = q[2i] high nibble, q[2i+1] low
            self.register_buffer("scales_zeros", _scales_and_zeros(offsets, scales).to(device))
        else:  # keep the values packed 8 to an int32 as AWQ does; dequantise per call
            self.register_buffer("qweight", pack_awq(q).to(device))
            self.register_buffer(
                "offsets", (offsets if self.mins else pack_awq(offsets)).to(device)
            )
            self.register_buffer("scales", scales.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device))

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.path == INT4_KERNEL_PATH:
            args = (self.weight_packed, self.scales, self.offsets, self.group)
            if x2.shape[0] <= kernels.MAX_ROWS:
                y = torch.ops.pagechat.int4_linear(x2, *args)
                # the fused ops after a layer take dense rows
                return y[:, : self.out_features].contiguous() if self.padded else y
            dtype = gemm_dtype(x2)
            if dtype == torch.float32:  # many rows: pagechat's GEMM, the weights read as stored
                y = torch.ops.pagechat.int4_gemm(x2.to(dtype), *args).to(x2.dtype)
                return y[:, : self.out_features].contiguous() if self.padded else y
            # a bf16 GEMM (AMX's) on the weights dequantised for this call
            w = torch.ops.pagechat.int4_dequantize(*args, dtype=dtype)
            return F.linear(x2.to(dtype), w[: self.out_features]).to(x2.dtype)
        if self.path == "dequant":
            offsets = self.offsets if self.mins else unpack_awq(self.offsets)
            w = dequantize(unpack_awq(self.qweight), offsets, self.scales, self.group)
            return x2 @ w.to(x2.dtype)
        if self.path == "int4pack-cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(_BF16).contiguous(), self.weight_packed, self.group, self.scales_zeros
            ).to(x2.dtype)
        return torch.ops.aten._weight_int4pack_mm(
            x2.to(_BF16).contiguous(), self.weight_packed, self.group, self.scales_zeros
        ).to(x2.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group}, path={self.path}"
        )


class Int8WOLinear(_WeightOnlyLinear):
    """int8 weight-only linear: symmetric int8 weights with a scale per output row (int8-wo), or
    per group of inputs (a GGUF's Q8_0, 32), floating activations."""

    quant_format = "int8-wo"  # GGUF's layers say their type instead (quant/ggml.py)

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        device: torch.device,
        path: str | None = None,
        panels: bool = kernels.INT8_PANELS,
    ) -> None:
        """q int8 [N, K], scales [N] (w = q * scale) or [N, G] (groups of K/G inputs). `path`
        forces torch's kernel (int8pack-*, dequant); by default pagechat's kernel runs up to
        kernels.MAX_ROWS rows where it can, its weights laid out as `panels` picks
        (kernels.int8_pack)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.grouped = scales.dim() == 2
        self.kernel = None if path else int8_wo_kernel(self.in_features, device)
        # every call, where the kernel cannot run (torch's int8pack takes a scale per row only)
        self.torch_path = path or ("dequant" if self.grouped else int8_wo_path(device))
        self.path = self.torch_path
        # the int8pack kernels take scales in the activations' dtype (bf16), and pagechat's kernel
        # reads the same bf16 scales, so both compute with the same weights; dequant keeps fp32;
        # group scales stay as given (Q8_0's fp16)
        dtype = torch.float32 if self.torch_path == "dequant" else _BF16
        q, scales = q.to(torch.int8), scales if self.grouped else scales.to(dtype)
        if self.kernel is not None:
            self.path = INT8_KERNEL_PATH
            q, scales = kernels.int8_pack(q, scales, panels)
        # in panels, the rows past out_features are padding: their outputs are cut off
        self.padded = q.dim() == 3 and self.out_features % kernels.PANEL != 0
        self.register_buffer("weight", q.to(device).contiguous())
        self.register_buffer("scales", scales.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device))

    @classmethod
    def from_float(
        cls, w: torch.Tensor, bias: torch.Tensor | None, device: torch.device
    ) -> Int8WOLinear:
        """Quantise an nn.Linear weight [N, K]: scale = row absmax / 127, q = round(w / scale)."""
        scales = w.float().abs().amax(1).clamp(min=1e-8) / 127
        q = torch.round(w.float() / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, bias, device)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if x2.shape[0] <= kernels.MAX_ROWS:
                y = self.kernel(x2, self.weight, self.scales)
            elif (dtype := gemm_dtype(x2)) == torch.float32:  # pagechat's GEMM, weights as stored
                y = torch.ops.pagechat.int8_gemm(x2.to(dtype), self.weight, self.scales)
                y = y.to(x2.dtype)
            elif self.grouped:  # a bf16 GEMM on the weights dequantised for this call
                w = kernels.int8_dequantize(self.weight, self.scales, dtype=dtype)
                y = F.linear(x2.to(dtype), w).to(x2.dtype)
            else:  # a bf16 GEMM (faster than int8pack's) on the int8 values, exact in bf16
                w = kernels.int8_rows(self.weight, dtype=dtype)
                y = (F.linear(x2.to(dtype), w) * self.scales.to(dtype)).to(x2.dtype)
            return y[:, : self.out_features].contiguous() if self.padded else y
        if self.grouped:
            return F.linear(x2, kernels.int8_dequantize(self.weight, self.scales, dtype=x2.dtype))
        if (
            self.torch_path == "dequant"
        ):  # x @ (q * s)^T == (x @ q^T) * s: scale the output, not the weight
            return F.linear(x2, self.weight.to(x2.dtype)) * self.scales.to(x2.dtype)
        return torch.ops.aten._weight_int8pack_mm(
            x2.to(_BF16).contiguous(), self.weight, self.scales
        ).to(x2.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, path={self.path}"


class Bf16WOLinear(_WeightOnlyLinear):
    """bf16 weight-only linear for float32 models: the weight is stored in bf16 (half the bytes). A
    few rows (decode) read half the bytes: on a CPU pagechat's float kernel multiplies the bf16
    weights with the float32 activations as they are (where it builds), else a bf16 matmul. Many
    rows (prefill) run in float32, because on a CPU without native bf16 a bf16 matmul of many rows
    is several times slower: pagechat's GEMM reads the bf16 weight as stored (where it builds),
    else the weight is upcast for the call."""

    quant_format = "bf16-wo"

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.path = bf16_wo_path(self.in_features, device.type)
        # a traced step records one side of the branch below
        self.max_rows = kernels.MAX_ROWS if self.path == BF16_KERNEL_PATH else MAX_GRAPH_TOKENS
        self.gemm = device.type == "cpu" and kernels.loaded()
        self.register_buffer("weight", weight.to(device=device, dtype=_BF16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(device))

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] > self.max_rows:
            if self.gemm and x2.dtype == torch.float32:
                return kernels.float_gemm(x2, self.weight)
            return F.linear(x2, self.weight.to(x2.dtype))
        if self.path == BF16_KERNEL_PATH:
            return kernels.float_linear(x2, self.weight)
        return F.linear(x2.to(_BF16), self.weight).to(x2.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


def bnb_int8_linear(
    bias: torch.Tensor | None,
    device: torch.device,
    weight: torch.Tensor | None = None,
    int8: torch.Tensor | None = None,
    scb: torch.Tensor | None = None,
) -> nn.Module:
    """A bitsandbytes Linear8bitLt (LLM.int8, threshold 6.0, eval) from float or int8 + SCB."""
    import bitsandbytes as bnb

    # bnb warns on every call whose activations are not fp16; it casts them itself: say it once here
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    n, k = (weight if weight is not None else int8).shape
    layer = bnb.nn.Linear8bitLt(
        k,
        n,
        bias=bias is not None,
        has_fp16_weights=False,
        threshold=LLM_INT8_THRESHOLD,
        device="meta",
    )
    if weight is not None:
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        # CB must be set too: without it bnb takes the int8 rows for float weights, quantising again
        layer.weight = bnb.nn.Int8Params(
            int8, requires_grad=False, has_fp16_weights=False, CB=int8, SCB=scb.float()
        )
    layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    # bnb quantises a float weight in .to(device): row absmax -> SCB, int8 rows -> CB
    layer = layer.to(device)
    layer.quant_format, layer.path = "int8", "bnb-llm.int8"
    return layer.eval()  # training mode dequantises the weight on CPU, which is far slower


def quant_tensors(module: nn.Module) -> tuple[str, str, list[torch.Tensor]] | None:
    """(format, kernel path, every tensor it holds) of a quantised layer; None for other modules."""
    fmt = getattr(module, "quant_format", None)
    if fmt is None:
        return None
    tensors = list(module.buffers(recurse=False)) + list(module.parameters(recurse=False))
    if (
        fmt == "int8"
    ):  # bnb keeps the row scales (SCB) outside the module's parameters: on the weight or its state
        w, st = module.weight, module.state
        tensors += [t for t in (getattr(w, "SCB", None), st.SCB, st.CB) if t is not None]
    seen, unique = set(), []
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            unique.append(t)
    label = f"awq-int4 g{module.group}" if fmt == "awq-int4" else fmt
    return label, module.path, unique
