"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch, on the paged KV pool.

q/k/v and gate/up are fused into one matmul each at load time; weights come from safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagechat.core import ops
from pagechat.core.attention import AttentionMetadata, paged_attention
from pagechat.core.loader import WeightReader
from pagechat.core.modelspec import ModelSpec
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation. Given the
    residual stream too, it adds x to it first and returns (the norm, the new residual), as vLLM's
    does: the residual add and the next sublayer's norm are then one fused op."""

    def __init__(self, weight: torch.Tensor, eps: float, small: ops.SmallOps | None = None) -> None:
        """small: the fused ops' rms_norm / add_rms_norm (core/ops.py's small_ops) to run on rows
        of the weight's size, as a decoder layer's norms see them; None: torch's ops."""
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.shape = (
            eps,
            tuple(weight.shape),
        )  # plain ints: a trace records them as constants
        self.small = small

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            if self.small is not None:
                return self.small.add_rms_norm(x, residual, self.weight, self.eps)
            x = x + residual
            return self._norm(x), x
        if self.small is not None:
            return self.small.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic as below, in one op instead of seven
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear holding the given (already loaded) weight; quant/ swaps in its own layers."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def dense_linear(
    w: WeightReader,
    names: list[str],
    out_sizes: tuple[int, ...],
    in_size: int,
    bias: bool,
    dtype: torch.dtype,
) -> nn.Linear:
    """One nn.Linear whose output rows are named checkpoint linears stacked (fused qkv, gate/up)."""
    weight = torch.cat(
        [w.floats(f"{n}.weight", (o, in_size), dtype) for n, o in zip(names, out_sizes)]
    )
    b = (
        torch.cat([w.floats(f"{n}.bias", (o,), dtype) for n, o in zip(names, out_sizes)])
        if bias
        else None
    )
    return linear(weight, b)


# How decoder linears are built from the checkpoint: dense_linear here; quant/ provides loaders for
# quantised checkpoints with the same signature, so fused layers stay fused whatever the format.
LinearLoader = Callable[
    [WeightReader, list[str], tuple[int, ...], int, bool, torch.dtype], nn.Module
]


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with linear or llama3 scaling applied."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "factors":  # a GGUF's rope_freqs: llama3 scaling as llama.cpp stores it
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly between them
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_tables(spec: ModelSpec, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [length, D] of positions 0..length-1 for `rotate` (sin's 1st half < 0)."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), rope_inv_freq(spec))
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary position embedding (half-split layout) to x [..., D], with rope_tables' cos and
    signed sin: x * cos + (-x2, x1) * sin, where (x2, x1) is x rolled by D/2 and the sign sits in
    the table (4 ops, not 6)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """Self-attention with fused qkv, optional q/k norm, rotary embedding and a sliding window."""

    def __init__(
        self,
        spec: ModelSpec,
        w: WeightReader,
        p: str,
        dtype: torch.dtype,
        window: int | None,
        load: LinearLoader,
        small: ops.SmallOps | None,
        fused: bool,
    ) -> None:
        """small: the fused ops' rope (None: torch's); fused: decode attention in ops.cpp."""
        super().__init__()
        self.small = small
        self.fused = fused and spec.head_dim % 8 == 0  # ops.cpp's attention reads 8 values at once
        # a decode step's rope, K/V write and attention as one op (ops.cpp's qkv_decode_attention),
        # where ops.cpp's rope is the one the model runs
        self.fused_decode = self.fused and small is torch.ops.pagechat and not spec.qk_norm
        h, kv, d, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        self.sizes = (h * d, kv * d, kv * d)
        self.heads, self.kv_heads, self.head_dim, self.window = h, kv, d, window
        self.qkv_proj = load(
            w, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"], self.sizes, hid, spec.qkv_bias, dtype
        )
        self.o_proj = load(w, [f"{p}.o_proj"], (hid,), h * d, spec.o_bias, dtype)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(w.floats(f"{p}.q_norm.weight", (d,), dtype), spec.rms_norm_eps)
            self.k_norm = RMSNorm(w.floats(f"{p}.k_norm.weight", (d,), dtype), spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # every row a sequence's one token, its context read through gather slots (not a table)
        if self.fused_decode and meta.q_pos.shape[1] == 1 and meta.block_table is None:
            out = torch.ops.pagechat.qkv_decode_attention(
                qkv,
                cos,
                sin,
                kv,
                meta.slot_mapping,
                meta.gather,
                meta.q_pos,
                self.window or 0,
                self.heads,
            )
        else:
            out = self._attend(qkv, cos, sin, kv, meta)
        return self.o_proj(out)

    def _attend(self, qkv, cos, sin, kv, meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 KV) * D] split, normed, rotated and attended (paged) -> [T, H * D]."""
        # -1 and flatten instead of sizes read off x: a traced step then carries no size arithmetic
        qk, v = qkv.split((self.sizes[0] + self.sizes[1], self.sizes[2]), dim=-1)
        qk = qk.view(
            -1, self.heads + self.kv_heads, self.head_dim
        )  # q's heads, then k's: rotated as one tensor
        if self.q_norm is not None:
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        rotated = self.small.rope(qk, cos, sin) if self.small is not None else rotate(qk, cos, sin)
        q, k = rotated.split((self.heads, self.kv_heads), dim=1)
        out = paged_attention(
            q,
            k,
            v.view(-1, self.kv_heads, self.head_dim),
            kv[0],
            kv[1],
            meta,
            self.window,
            self.fused,
        )
        return out.flatten(1)


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    def __init__(
        self,
        spec: ModelSpec,
        w: WeightReader,
        p: str,
        dtype: torch.dtype,
        load: LinearLoader,
        small: ops.SmallOps | None,
    ) -> None:
        super().__init__()
        self.small = small  # silu(gate) * up as one op (core/ops.py's small_ops)
        hid, inter = spec.hidden_size, spec.intermediate_size
        self.gate_up_proj = load(
            w, [f"{p}.gate_proj", f"{p}.up_proj"], (inter, inter), hid, spec.mlp_bias, dtype
        )
        self.down_proj = load(w, [f"{p}.down_proj"], (hid,), inter, spec.mlp_bias, dtype)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.small is not None:
            return self.down_proj(self.small.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections. It takes and returns the
    sublayer output and the residual stream apart (residual None before the first layer), so that
    each residual add is fused with the norm after it."""

    def __init__(
        self,
        spec: ModelSpec,
        w: WeightReader,
        i: int,
        dtype: torch.dtype,
        load: LinearLoader,
        small: ops.SmallOps | None,
        fused: bool,
    ) -> None:
        super().__init__()
        p = f"model.layers.{i}"

        def norm(name: str) -> RMSNorm:
            weight = w.floats(f"{p}.{name}.weight", (spec.hidden_size,), dtype)
            return RMSNorm(weight, spec.rms_norm_eps, small)

        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.self_attn = Attention(
            spec, w, f"{p}.self_attn", dtype, spec.sliding_windows[i], load, small, fused
        )
        self.mlp = MLP(spec, w, f"{p}.mlp", dtype, load, small)

    def forward(self, x, residual, cos, sin, kv, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# How the LM head and the embedding are built from the checkpoint: from the reader and the
# tensor's name, so that a quantised file's table can be read in its own format (quant/).
TableLoader = Callable[[WeightReader, str, tuple[int, int]], nn.Module]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def dense_embedding(dtype: torch.dtype) -> TableLoader:
    """An nn.Embedding of the table as floats in dtype."""

    def load(w: WeightReader, name: str, shape: tuple[int, int]) -> nn.Embedding:
        emb = nn.Embedding(*shape, device="meta")
        table = w.floats(name, shape, dtype)
        emb.weight = nn.Parameter(table, requires_grad=False)
        return emb

    return load


def dense_head(dtype: torch.dtype) -> TableLoader:
    """An nn.Linear of the table as floats in dtype."""
    return lambda w, name, shape: linear(w.floats(name, shape, dtype))


def tied_embedding(head: nn.Module) -> nn.Module:
    """The embedding that reads a tied head's table: the head's own `embedding()` where it keeps
    the table in a format of its own (quant/head.py), else an nn.Embedding over its weight."""
    if hasattr(head, "embedding"):
        return head.embedding()
    emb = nn.Embedding(head.out_features, head.in_features, device="meta")
    emb.weight = head.weight
    return emb


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; forward takes one flat ragged batch."""

    def __init__(
        self,
        spec: ModelSpec,
        w: WeightReader,
        dtype: torch.dtype,
        max_len: int,
        device: torch.device,
        load: LinearLoader = dense_linear,
        head: TableLoader | None = None,
        embed: TableLoader | None = None,
    ) -> None:
        """`head` and `embed` build lm_head and the embedding from their tables (quant/ gives
        quantised and weight-only modes, and GGUF files, their own). A tied model builds the head
        from the embedding's table, and the embedding reads the head's: one table, not two."""
        super().__init__()
        self.dtype = dtype
        self.spec = spec
        head, embed = head or dense_head(dtype), embed or dense_embedding(dtype)
        vh = (spec.vocab_size, spec.hidden_size)
        if spec.tie_word_embeddings or not w.has(HEAD):
            lm_head = head(w, EMBED, vh)
            # registered first, so that the memory report counts the shared table as embedding
            self.embed_tokens = tied_embedding(lm_head)
        else:
            self.embed_tokens = embed(w, EMBED, vh)
            lm_head = head(w, HEAD, vh)
        self.lm_head = lm_head
        # the device the model will run on, not where its tensors are now: a dense model loads on
        # the CPU and moves to a GPU later, where ops.cpp's CPU ops cannot run
        small, fused = ops.small_ops(device, dtype), ops.fused(device, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, w, i, dtype, load, small, fused) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(
            w.floats("model.norm.weight", (spec.hidden_size,), dtype), spec.rms_norm_eps, small
        )
        cos, sin = rope_tables(spec, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for input_ids [T] at positions [T]."""
        x = self.embed_tokens(input_ids).to(self.dtype)
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        residual = None
        for layer, kv in zip(
            self.layers, kv_pool.flatten(2, 3)
        ):  # each layer's K and V as [slots, kv_heads, D]
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the given hidden rows."""
        return self.lm_head(hidden).float()
