"""Decide how a checkpoint's decoder linears load (dense, int8, int8-wo, AWQ) and build them.

`resolve_quant` reads config.json's quantization_config and the --quant and --lm-head requests and
refuses every combination it cannot run with one line; `QuantPlan.loader(device)` is the
LinearLoader the engine's DecoderModel builds each (possibly fused) decoder linear with,
`QuantPlan.head` its lm_head (quant/head.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.loader import WeightReader
from pagechat.core.model import LinearLoader, TableLoader, dense_embedding, dense_linear
from pagechat.core.modelspec import ModelSpec
from pagechat.quant.ggml import gguf_embedding, gguf_head, gguf_loader
from pagechat.quant.head import LM_HEADS, check_lm_head, head_builder, head_format
from pagechat.quant.layers import (
    Bf16WOLinear,
    Int4Linear,
    Int8WOLinear,
    bnb_int8_linear,
    on_kernel,
    quant_tensors,
)
from pagechat.quant.pack import unpack_awq

QUANT_MODES = ("int8", "int8-wo", "bf16-wo", "awq")
MODE_LABELS = {
    None: "none (weights in the model dtype; float32/bf16 decode rows on pagechat's kernel where "
    "it builds)",
    "int8": "int8 LLM.int8 (bitsandbytes Linear8bitLt, outlier threshold 6.0)",
    "int8-wo": "int8 weight-only (pagechat's kernel where it builds, else torch's int8pack)",
    "bf16-wo": "bf16 weight-only (decode rows on pagechat's kernel where it builds, else a "
    "bf16 matmul; prefill in float32 on pagechat's GEMM reading the bf16 weights where it "
    "builds, else on weights upcast per call)",
    "awq": "AWQ 4-bit (pagechat's int4 kernel where it builds, else torch's int4 matmul)",
    "gguf": "the GGUF's own (Q4_0/Q4_1/Q4_K on pagechat's int4 kernel, Q8_0 on its int8 kernel "
    "where it builds; other types requantised to Q8_0 at load)",
}


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """How the decoder linears and lm_head load: the mode, what the checkpoint holds, the AWQ
    group size and the --lm-head request."""

    mode: str | None  # None | "int8" | "int8-wo" | "bf16-wo" | "awq" | "gguf"
    checkpoint: str  # "float" | "bnb-int8" | "awq" | "gguf"
    group_size: int | None = None
    lm_head: str = "auto"  # one of quant/head.py's LM_HEADS

    @property
    def label(self) -> str:
        return MODE_LABELS[self.mode]

    @property
    def traceable(self) -> bool:
        """Whether a trace records these layers faithfully: bitsandbytes' LLM.int8 picks its outlier
        columns in Python on every call, which a trace would freeze."""
        return self.mode != "int8"

    def head(self, device: torch.device, dtype: torch.dtype) -> TableLoader:
        """How lm_head is built from its weight: int8 or 4-bit for quantised models, bf16 in a
        float32 weight-only mode (quant/head.py).

        A tied head is the biggest weight read per token (in a small model, a float32 embedding can
        outweigh all the quantised decoder linears together); quantised, it reads a quarter or less
        of the bytes, and decoding, bound by the bytes it reads, gets faster.
        """
        if self.mode == "gguf" and self.lm_head == "auto":  # the file's own format
            return gguf_head(device, dtype)
        build = head_builder(head_format(self.lm_head, self.mode, dtype), device)
        return lambda w, name, shape: build(w.floats(name, shape, dtype))

    def embedding(self, device: torch.device, dtype: torch.dtype) -> TableLoader:
        """An untied embedding: its table in the model's dtype, a GGUF's in its own format."""
        return gguf_embedding(device, dtype) if self.mode == "gguf" else dense_embedding(dtype)

    def loader(self, device: torch.device) -> LinearLoader:
        """The LinearLoader building each decoder linear on device, quantised as planned."""
        if self.mode is None:
            return lambda *args: on_kernel(dense_linear(*args))
        if self.mode == "awq":
            return _awq_loader(self.group_size, device)
        if self.mode == "bf16-wo":
            return _bf16_loader(device)
        if self.mode == "gguf":
            return gguf_loader(device)
        return _int8_loader(self.mode, self.checkpoint == "bnb-int8", device)


def resolve_quant(
    spec: ModelSpec, requested: str | None, model_dir: Path, lm_head: str = "auto"
) -> QuantPlan:
    """The plan for this checkpoint, --quant and --lm-head; PagechatError (one line) if it can't
    run."""
    check_lm_head(lm_head, spec, f"{model_dir}/config.json")
    return replace(_decoder_plan(spec, requested, model_dir), lm_head=lm_head)


def _decoder_plan(spec: ModelSpec, requested: str | None, model_dir: Path) -> QuantPlan:
    """The decoder linears' part of resolve_quant."""
    where = f"{model_dir}/config.json"
    if requested is not None and requested not in QUANT_MODES:
        raise PagechatError(f"--quant must be one of {', '.join(QUANT_MODES)}, got {requested!r}")
    qc = spec.quantization
    if qc is None:
        if requested == "awq":
            raise PagechatError(
                f"--quant awq needs an AWQ checkpoint, but {where} has no quantization_config; "
                f"make one with `pagechat quantize {model_dir} OUT_DIR --method awq`"
            )
        return QuantPlan(requested, "float")
    if not isinstance(qc, dict):
        raise PagechatError(
            f"{where}: quantization_config must be an object, got {type(qc).__name__}"
        )
    method = str(qc.get("quant_method", "?")).lower()
    if method == "gguf":
        if requested is not None:
            types = ", ".join(qc["types"])
            raise PagechatError(
                f"--quant {requested} cannot apply to {model_dir}: its tensors are quantised as "
                f"the file stores them ({types}); run it without --quant"
            )
        return QuantPlan("gguf", "gguf")
    if method == "awq":
        group = _check_awq(qc, spec, where)
        if requested in ("int8", "int8-wo", "bf16-wo"):
            raise PagechatError(
                f"--quant {requested} cannot apply to {model_dir}: it is already an AWQ 4-bit "
                "checkpoint (run it without --quant, or with --quant awq)"
            )
        return QuantPlan("awq", "awq", group)
    if method == "bitsandbytes":
        if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
            raise PagechatError(
                f"{where}: bitsandbytes 4-bit checkpoints (load_in_4bit) are not supported; "
                "pagechat loads bitsandbytes 8-bit (load_in_8bit) and AWQ GEMM 4-bit"
            )
        if not (qc.get("load_in_8bit") or qc.get("_load_in_8bit")):
            raise PagechatError(
                f"{where}: bitsandbytes quantization_config sets neither load_in_8bit "
                "nor load_in_4bit"
            )
        if requested in ("awq", "bf16-wo"):
            raise PagechatError(
                f"--quant {requested} cannot apply to {model_dir}: "
                "it is a bitsandbytes int8 checkpoint "
                "(run it without --quant, or with --quant int8 / int8-wo)"
            )
        return QuantPlan(requested or "int8", "bnb-int8")
    raise PagechatError(
        f"{where}: quantization_config quant_method {method!r} is not supported "
        "(supported: awq with version gemm, bitsandbytes with load_in_8bit)"
    )


def _check_awq(qc: dict, spec: ModelSpec, where: str) -> int:
    """Validate an AWQ quantization_config against what pagechat runs; return the group size."""
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if str(qc.get("backend", "")).lower() == "llm-awq" or version == "llm-awq":
        raise PagechatError(
            f"{where}: checkpoints in the original llm-awq format are not supported; "
            "pagechat loads AutoAWQ GEMM checkpoints (version 'gemm')"
        )
    if version != "gemm":
        raise PagechatError(
            f"{where}: AWQ version {version!r} is not supported: its weights are packed for "
            "its own CUDA kernels; pagechat loads AutoAWQ GEMM checkpoints (version 'gemm')"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise PagechatError(f"{where}: AWQ bits={bits!r} is not supported (only 4)")
    if qc.get("zero_point", True) is not True:
        raise PagechatError(f"{where}: AWQ without zero points (zero_point false) is not supported")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise PagechatError(
            f"{where}: AWQ group_size must be a positive integer, got {group!r} "
            "(per-channel group_size -1 is not supported)"
        )
    for name, k in (
        ("hidden_size", spec.hidden_size),
        ("intermediate_size", spec.intermediate_size),
        ("num_attention_heads x head_dim", spec.num_heads * spec.head_dim),
    ):
        if k % group:
            raise PagechatError(
                f"{where}: AWQ group_size {group} does not divide in_features {k} ({name})"
            )
    return group


def _stacked(
    w: WeightReader, names: list[str], suffix: str, shapes: list[tuple[int, ...]], what: str
) -> torch.Tensor:
    """The named tensors concatenated along the last dim, each checked against its shape."""
    parts = []
    for n, shape in zip(names, shapes):
        try:
            parts.append(w.get(f"{n}.{suffix}", shape))
        except PagechatError as e:
            raise PagechatError(f"{e} ({what})") from None
    return torch.cat(parts, dim=-1)


def _weights(
    w: WeightReader, names: list[str], out_sizes: tuple[int, ...], in_size: int
) -> torch.Tensor:
    """The named linears' weights stacked on the output dim as stored (fused qkv, gate/up)."""
    return torch.cat([w.get(f"{n}.weight", (o, in_size)) for n, o in zip(names, out_sizes)])


def _bias(
    w: WeightReader, names: list[str], out_sizes: tuple[int, ...], bias: bool, dtype: torch.dtype
):
    return (
        torch.cat([w.get(f"{n}.bias", (o,)).to(dtype) for n, o in zip(names, out_sizes)])
        if bias
        else None
    )


def _unquantised(w: WeightReader, names: list[str], marker: str) -> bool:
    """True when none of names is quantised (modules_to_not_convert, llm_int8_skip_modules).

    Mixed is an error."""
    have = [w.has(f"{n}.{marker}") for n in names]
    if any(have) and not all(have):
        raise PagechatError(
            f"checkpoint mixes quantised and float weights within {', '.join(names)}"
        )
    return not any(have)


def _awq_loader(group: int, device: torch.device) -> LinearLoader:
    def load(w, names, out_sizes, in_size, bias, dtype):
        if _unquantised(w, names, "qweight"):
            return dense_linear(w, names, out_sizes, in_size, bias, dtype)
        what = f"AWQ 4-bit, group_size {group}, in_features {in_size}"
        qw = _stacked(w, names, "qweight", [(in_size, o // 8) for o in out_sizes], what)
        qz = _stacked(w, names, "qzeros", [(in_size // group, o // 8) for o in out_sizes], what)
        sc = _stacked(w, names, "scales", [(in_size // group, o) for o in out_sizes], what)
        if qw.dtype != torch.int32 or qz.dtype != torch.int32:
            raise PagechatError(
                f"{names[0]}.qweight / .qzeros must be int32, got {qw.dtype} / {qz.dtype}"
            )
        # fused qkv / gate-up: the checkpoint linears stack along the output dim, as in dense_linear
        return Int4Linear(
            unpack_awq(qw),
            unpack_awq(qz),
            sc,
            _bias(w, names, out_sizes, bias, dtype),
            group,
            device,
        )

    return load


def _bf16_loader(device: torch.device) -> LinearLoader:
    def load(w, names, out_sizes, in_size, bias, dtype):
        weight = _weights(w, names, out_sizes, in_size)
        return Bf16WOLinear(weight, _bias(w, names, out_sizes, bias, dtype), device)

    return load


def _int8_loader(mode: str, prequantised: bool, device: torch.device) -> LinearLoader:
    def load(w, names, out_sizes, in_size, bias, dtype):
        b = _bias(w, names, out_sizes, bias, dtype)
        if prequantised and _unquantised(w, names, "SCB"):  # llm_int8_skip_modules: left in float
            return dense_linear(w, names, out_sizes, in_size, bias, dtype)
        if prequantised:
            # transformers' load_in_8bit checkpoints: int8 rows `weight` [out, in], row absmax
            # `SCB` [out]
            q = _weights(w, names, out_sizes, in_size)
            scb = torch.cat([w.get(f"{n}.SCB", (o,)) for n, o in zip(names, out_sizes)]).float()
            if q.dtype != torch.int8:
                raise PagechatError(
                    f"{names[0]}.weight of a bitsandbytes int8 checkpoint must be int8, "
                    f"got {q.dtype}"
                )
            if mode == "int8-wo":
                return Int8WOLinear(q, scb / 127, b, device)
            return bnb_int8_linear(b, device, int8=q, scb=scb)
        weight = _weights(w, names, out_sizes, in_size)
        if weight.dtype == torch.int8:
            raise PagechatError(
                f"{names[0]}.weight is int8 but config.json has no bitsandbytes quantization_config"
            )
        if mode == "int8-wo":
            return Int8WOLinear.from_float(weight.float(), b, device)
        return bnb_int8_linear(b, device, weight=weight.float())

    return load


class Backend:
    """pagechat's quantisation as the engine's registry sees it (`pagechat.quant` entry point)."""

    modes = QUANT_MODES
    lm_heads = LM_HEADS
    resolve = staticmethod(resolve_quant)
    storage = staticmethod(quant_tensors)


BACKEND = Backend()
