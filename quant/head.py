"""The LM head's format (--lm-head): int8 per row or 4-bit groups, and a tied embedding that reads
its rows from the quantised head's own table.

In a small model the tied head is the largest weight a decode step reads (135M: 49152 x 576), so
quantised models quantise it too, as llama.cpp keeps a tied token_embd quantised and dequantises
only the rows it looks up (get_rows). The heads are the decoder's own layer classes (Int8WOLinear,
Int4Linear), so a head runs whatever kernel those layers get; each adds `embedding()`, the module
DecoderModel ties in: it holds the head's tensors (one table, not two) and dequantises the rows it
looks up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.model import linear
from pagechat.core.modelspec import ModelSpec
from pagechat.quant import kernels
from pagechat.quant.layers import (
    INT4_KERNEL_PATH,
    Bf16WOLinear,
    Int4Linear,
    Int8WOLinear,
    bf16_head,
    on_kernel,
)
from pagechat.quant.pack import AWQ_REVERSE, dequantize, quantize_groups
from torch import nn

LM_HEADS = ("auto", "int8", "int4", "float")
INT4_GROUP = 32  # llama.cpp's Q4 block, and the smallest group torch's int4 kernels take
# The --quant modes whose head `auto` makes int8. bitsandbytes' int8 too: transformers leaves
# lm_head out of LLM.int8 because LLM.int8 quantises the activations, whose outliers hurt logits;
# a weight-only int8 head keeps them in float, so that reason does not hold, and it runs pagechat's
# int8 kernel where LLM.int8 would run its slow outlier split.
QUANTISED_MODES = ("int8", "int8-wo", "awq")
HEAD_LABELS = {
    "int8": "int8 weight-only, a scale per row",
    "int4": f"4-bit, groups of {INT4_GROUP}, round-to-nearest",
    "bf16": "bf16 weight-only",
    "dense": "the model dtype",
}


def head_format(lm_head: str, mode: str | None, dtype: torch.dtype) -> str:
    """What --lm-head builds under --quant mode: int8 | int4 | bf16 | dense."""
    if lm_head == "auto":
        lm_head = "int8" if mode in QUANTISED_MODES else "float"
    if lm_head == "float":  # as before heads were quantised: bf16 in float32 weight-only modes
        return "bf16" if bf16_head(mode, dtype) else "dense"
    return lm_head


def check_lm_head(lm_head: str, spec: ModelSpec, where: str) -> None:
    """PagechatError (one line) unless --lm-head is a known format that fits this model's head."""
    if lm_head not in LM_HEADS:
        raise PagechatError(f"--lm-head must be auto, int8, int4 or float, got {lm_head!r}")
    # Int4Linear packs 8 outputs per int32 (pack_awq) and quantises groups of inputs
    if lm_head == "int4" and (spec.hidden_size % INT4_GROUP or spec.vocab_size % 8):
        raise PagechatError(
            f"--lm-head int4 needs hidden_size a multiple of {INT4_GROUP} and vocab_size of 8, but "
            f"{where} has {spec.hidden_size} and {spec.vocab_size}; use --lm-head int8"
        )


def check_int4_tie(path: str) -> None:
    """PagechatError unless a tied int4 head's rows can be read from its kernel's layout."""
    if path not in (INT4_KERNEL_PATH, "int4pack-cpu", "dequant"):
        raise PagechatError(
            f"--lm-head int4 cannot share a tied embedding's table on the {path} kernel (pagechat "
            "reads rows from its own, torch's CPU int4 and AWQ's layouts only); use --lm-head int8"
        )


def head_builder(fmt: str, device: torch.device) -> Callable[[torch.Tensor], nn.Module]:
    """How DecoderModel builds an lm_head of head_format `fmt` from its weight [vocab, hidden]."""
    if fmt == "int8":
        return lambda weight: Int8Head.from_float(weight.float(), None, device)
    if fmt == "int4":
        return lambda weight: Int4Head.from_float(weight, device)
    if fmt == "bf16":
        return lambda weight: Bf16Head(weight, None, device)
    return lambda weight: on_kernel(linear(weight))


class Bf16Head(Bf16WOLinear):
    """A bf16 head; tied, the embedding reads the same bf16 table and the model casts its rows."""

    def embedding(self) -> nn.Embedding:
        emb = nn.Embedding(self.out_features, self.in_features, device="meta")
        emb.weight = nn.Parameter(self.weight, requires_grad=False)
        return emb


class Int8Head(Int8WOLinear):
    """An int8 weight-only head (a scale per vocabulary row)."""

    def embedding(self) -> Int8Rows:
        return Int8Rows(self)


class Int4Head(Int4Linear):
    """A 4-bit head: groups of INT4_GROUP inputs, round-to-nearest, through Int4Linear's kernels."""

    @classmethod
    def from_float(cls, weight: torch.Tensor, device: torch.device) -> Int4Head:
        # in AWQ's layout, [in, out]
        q, zeros, scales = (x.t().contiguous() for x in quantize_groups(weight, INT4_GROUP))
        # fp16 scales, as AWQ checkpoints store them, so the layer holds what the planner counts
        return cls(q, zeros, scales.half(), None, INT4_GROUP, device)

    def embedding(self) -> nn.Module:
        check_int4_tie(self.path)
        if self.path == "dequant":
            return Int4AWQRows(self)
        return Int4Rows(self) if self.path == INT4_KERNEL_PATH else Int4PackRows(self)


class _TiedRows(nn.Module):
    """What the tied embeddings share: the head's shape, format and kernel path for the memory
    report (core/memory.py), which counts the head's tensors once, here, under embedding."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.quant_format, self.path, self.bias = head.quant_format, head.path, None


class Int8Rows(_TiedRows):
    """A tied embedding over an int8 head's table: rows [T, hidden] in float32 for ids [T]."""

    def __init__(self, head: Int8WOLinear) -> None:
        super().__init__(head)
        self.register_buffer("weight", head.weight)
        self.register_buffer("scales", head.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return kernels.int8_dequantize(self.weight, self.scales, ids)


class Int4Rows(_TiedRows):
    """A tied embedding over a 4-bit head on pagechat's int4 kernel: the looked-up rows of its
    table, dequantised by the kernel's own op (float32 [T, hidden]) from either of its layouts."""

    def __init__(self, head: Int4Linear) -> None:
        super().__init__(head)
        self.group = head.group
        for name in ("weight_packed", "scales", "offsets"):
            self.register_buffer(name, getattr(head, name))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagechat.int4_dequantize(
            self.weight_packed, self.scales, self.offsets, self.group, ids
        )


class Int4PackRows(_TiedRows):
    """A tied embedding over a 4-bit head packed by torch's CPU int4 kernel (where pagechat's does
    not build): rows [T, hidden] in float32 for ids [T], w = (q - 8) * scale + zero as that kernel
    computes them."""

    def __init__(self, head: Int4Linear) -> None:
        super().__init__(head)
        self.group = head.group
        start, stride = int4pack_cpu_rows(head.out_features, head.in_features)
        self.register_buffer("packed", head.weight_packed.view(-1))
        self.register_buffer("scales_zeros", head.scales_zeros)  # [hidden / group, vocab, 2]
        self.register_buffer("start", start)
        self.register_buffer("stride", stride)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        nib = self.start[ids].long().unsqueeze(1) + (
            torch.arange(k, device=ids.device) * self.stride[ids].long().unsqueeze(1)
        )  # [T, hidden]: nibble indices, low nibble of a byte first
        q = (self.packed[nib >> 1].long() >> ((nib & 1) << 2)) & 0xF
        sz = self.scales_zeros[:, ids].float().transpose(0, 1)  # [T, groups, 2]
        w = (q.float().view(-1, k // self.group, self.group) - 8) * sz[..., :1] + sz[..., 1:]
        return w.flatten(1)


class Int4AWQRows(_TiedRows):
    """A tied embedding over a 4-bit head that keeps AWQ's packing and dequantises per call (where
    no int4 kernel runs): the looked-up rows' nibbles picked from their packed columns."""

    def __init__(self, head: Int4Linear) -> None:
        super().__init__(head)
        self.group, self.mins = head.group, head.mins
        for name in ("qweight", "offsets", "scales"):
            self.register_buffer(name, getattr(head, name))

    def _column(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The values of output rows ids [T] of AWQ-packed [R, N/8]: [R, T]."""
        shift = 4 * torch.tensor(AWQ_REVERSE, dtype=torch.int32, device=ids.device)
        return (packed[:, ids // 8] >> shift[ids % 8]) & 0xF

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self._column(self.qweight, ids)
        offsets = self.offsets[:, ids] if self.mins else self._column(self.offsets, ids)
        return dequantize(q, offsets, self.scales[:, ids], self.group).t()


def _packed_nibbles(values: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 packing of values [n, k] (0..15), as a flat tensor of nibbles, low first."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 2)
    return torch.stack((packed & 0xF, packed >> 4), -1).view(-1).long()


def int4pack_cpu_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where torch's CPU int4 packing puts the rows of an [n, k] weight: per row, the nibble index
    of its input 0 (int64 [n]) and the nibbles from one input to the next (int16 [n]).

    The layout depends on the CPU's vector width: torch packs blocks of 32 or 64 rows (fewer in the
    last one), input by input, pairing rows d and d + 16 or d + 32 in a byte. So it is read off
    torch's own packing of two-input probes whose values spell each row's index, then checked on a
    four-input probe of random values: any other layout raises instead of reading wrong rows.
    """
    rows = torch.arange(n)
    digits = range(0, max(1, (n - 1).bit_length()), 4)
    row_at = sum(_packed_nibbles(((rows >> d) & 15).unsqueeze(1).expand(n, 2)) << d for d in digits)
    input_at = _packed_nibbles(torch.tensor([0, 1]).expand(n, 2))
    pos = torch.empty(n, 2, dtype=torch.long)
    pos[row_at, input_at] = torch.arange(2 * n)
    stride = pos[:, 1] - pos[:, 0]
    block = int(stride[0])  # rows per block: input 1 of row 0 comes one block's width after input 0
    first = rows // block * block  # each row's block starts at its first row x k inputs' nibbles
    offset = pos[:, 0] - 2 * first  # within the block (the probes have 2 inputs)

    def start(inputs: int) -> torch.Tensor:
        return first * inputs + offset

    own = torch.Generator().manual_seed(0)  # loading a model leaves torch's random state alone
    probe = torch.randint(0, 16, (n, 4), generator=own)
    read = _packed_nibbles(probe)[start(4).unsqueeze(1) + torch.arange(4) * stride.unsqueeze(1)]
    if not torch.equal(read, probe):
        raise PagechatError(
            "torch's CPU int4 packing is not in a layout pagechat can read rows from; "
            "use --lm-head int8"
        )
    return start(k), stride.to(torch.int16)
