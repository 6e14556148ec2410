"""The AWQ search (arXiv 2306.00978) for one decoder block: activation statistics, per-group scale
grid search, scale folding and clipping search, all in fp32 on dense calibration batches.

The four Llama groups: input_layernorm -> q,k,v (loss on the attention output); v -> o (only when
their shapes match, so not with GQA); post_attention_layernorm -> gate,up (loss on the MLP output);
up -> down. Scaling a linear's input columns by s and dividing the op before it by s leaves the fp
block unchanged; AWQ picks s so that columns meeting large activations lose less to 4-bit rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pagechat.core.loader import WeightReader
from pagechat.core.model import rope_tables, rotate
from pagechat.core.modelspec import ModelSpec
from pagechat.quant.pack import fake_quantize

LINEARS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
GRID = 20  # scale exponents alpha = i / GRID, i = 0..GRID-1
CLIP_STEPS = 10  # clip max = absmax * (1 - i / GRID), i = 0..CLIP_STEPS-1 (shrinks up to 45%)
CLIP_TOKENS = 512  # tokens sampled for the clipping search
_CHUNK_FLOATS = 1 << 25  # ~128 MiB of fp32 per intermediate tensor in chunked loops


@dataclass(slots=True)
class Block:
    """One decoder block's weights in fp32, keyed by short names (q, k, v, o, gate, up, down)."""

    w: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor] = field(default_factory=dict)  # biases of the linears that have one
    norms: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # ln1, ln2 (and q_norm, k_norm for Qwen3)


def load_block(reader: WeightReader, spec: ModelSpec, i: int) -> Block:
    """Block i's weights from the checkpoint, as fp32 copies (they are scaled in place later)."""
    p = f"model.layers.{i}"

    def get(name: str) -> torch.Tensor:
        return reader.get(f"{p}.{name}").float().clone()

    blk = Block({s: get(f"{n}.weight") for s, n in LINEARS.items()})
    for s, n in LINEARS.items():
        if reader.has(f"{p}.{n}.bias"):
            blk.b[s] = get(f"{n}.bias")
    blk.norms = {
        "ln1": get("input_layernorm.weight"),
        "ln2": get("post_attention_layernorm.weight"),
    }
    if spec.qk_norm:
        blk.norms |= {
            "q_norm": get("self_attn.q_norm.weight"),
            "k_norm": get("self_attn.k_norm.weight"),
        }
    return blk


class BlockRunner:
    """Dense fp32 forward of one decoder block over calibration batches [S, T, hidden], chunked."""

    def __init__(self, spec: ModelSpec, seqlen: int, layer: int) -> None:
        self.spec, self.window = spec, spec.sliding_windows[layer]
        cos, sin = rope_tables(spec, seqlen)
        self.cos, self.sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        self.mask = None
        if self.window is not None and self.window < seqlen:
            pos = torch.arange(seqlen)
            self.mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.window)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps) * w

    def _chunks(self, x: torch.Tensor, per_sample: int):
        step = max(1, _CHUNK_FLOATS // max(1, per_sample))
        return [x[i : i + step] for i in range(0, x.shape[0], step)]

    def context(self, blk: Block, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """Attention before o_proj: h [S, T, hidden] (normed) -> [S, T, heads * head_dim]."""
        sp, out = self.spec, []
        t = h.shape[1]
        for hc in self._chunks(h, sp.num_heads * t * t):
            s = hc.shape[0]
            q = F.linear(hc, w["q"], blk.b.get("q")).view(s, t, sp.num_heads, sp.head_dim)
            k = F.linear(hc, w["k"], blk.b.get("k")).view(s, t, sp.num_kv_heads, sp.head_dim)
            v = F.linear(hc, w["v"], blk.b.get("v")).view(s, t, sp.num_kv_heads, sp.head_dim)
            if "q_norm" in blk.norms:
                q, k = self._norm(q, blk.norms["q_norm"]), self._norm(k, blk.norms["k_norm"])
            q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
            rep = sp.num_heads // sp.num_kv_heads  # GQA: each K/V head serves `rep` query heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=self.mask,
                is_causal=self.mask is None,
            )
            out.append(o.transpose(1, 2).reshape(s, t, -1))
        return torch.cat(out)

    def attention(self, blk: Block, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """Attention output (after o_proj) for normed input h."""
        return F.linear(self.context(blk, w, h), w["o"], blk.b.get("o"))

    def act(self, blk: Block, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """silu(gate(h)) * up(h): the input of down_proj."""
        out = [
            F.silu(F.linear(hc, w["gate"], blk.b.get("gate")))
            * F.linear(hc, w["up"], blk.b.get("up"))
            for hc in self._chunks(h, h.shape[1] * w["up"].shape[0] * 3)
        ]
        return torch.cat(out)

    def mlp(self, blk: Block, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(blk, w, h), w["down"], blk.b.get("down"))

    def forward(self, blk: Block, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The block's output, and the inputs each scaling group sees (qkv, o, gate_up, down)."""
        h1 = self._norm(x, blk.norms["ln1"])
        ctx = self.context(blk, blk.w, h1)
        x = x + F.linear(ctx, blk.w["o"], blk.b.get("o"))
        h2 = self._norm(x, blk.norms["ln2"])
        act = self.act(blk, blk.w, h2)
        x = x + F.linear(act, blk.w["down"], blk.b.get("down"))
        return x, {"qkv": h1, "o": ctx, "gate_up": h2, "down": act}


def search_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    run: Callable[[list[torch.Tensor]], torch.Tensor],
    group: int,
) -> tuple[torch.Tensor, float]:
    """Per-input-channel scale s [K] (and alpha) minimising run()'s MSE with fake-4-bit W*s / s."""
    k = x.shape[-1]
    x_mean = x.reshape(-1, k).abs().mean(0)
    w = torch.cat(weights)
    wg = w.abs().view(-1, group)
    w_mean = (
        (wg / (wg.amax(1, keepdim=True) + 1e-6)).view(w.shape).mean(0)
    )  # weight magnitude within its group
    ref = run(weights)
    best, best_s, best_alpha = float("inf"), None, 0.0
    for i in range(GRID):
        alpha = i / GRID
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (the quantiser sees W*s)
        loss = (
            (run([fake_quantize(wi * s, group) / s for wi in weights]) - ref).pow(2).mean().item()
        )
        if loss < best:
            best, best_s, best_alpha = loss, s, alpha
    if best_s is None:
        raise FloatingPointError("AWQ scale search produced no finite loss (NaN/inf activations)")
    return best_s, best_alpha


def search_clip(w: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """Per (output row, group) clip value [N, K/g] minimising the group's output MSE on samples."""
    n, k = w.shape
    g = k // group
    xs = x.reshape(-1, k)
    xs = xs[:: max(1, xs.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS]
    xg = xs.view(-1, g, group).transpose(
        0, 1
    )  # [G, T, group]: each group's partial dot products are one bmm
    rows = max(1, _CHUNK_FLOATS // (g * xs.shape[0]))
    best_all = []
    for r in range(0, n, rows):
        wb = w[r : r + rows].view(-1, g, group)  # [b, G, group]
        org_max = wb.abs().amax(-1, keepdim=True)  # [b, G, 1]
        ref = torch.bmm(xg, wb.permute(1, 2, 0))  # [G, T, b]
        best, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for i in range(CLIP_STEPS):
            mx = org_max * (1 - i / GRID)
            qw = fake_quantize(torch.clamp(wb, -mx, mx).reshape(-1, k), group).view(wb.shape)
            err = (
                (torch.bmm(xg, qw.permute(1, 2, 0)) - ref).pow(2).mean(1).t().unsqueeze(-1)
            )  # [b, G, 1]
            better = err < best_err
            best_err[better], best[better] = err[better], mx[better]
        best_all.append(best.squeeze(-1))
    return torch.cat(best_all)


def _scale_rows(blk: Block, name: str, s: torch.Tensor) -> None:
    blk.w[name].div_(s.unsqueeze(1))
    if name in blk.b:
        blk.b[name].div_(s)


def scale_groups(blk: Block, runner: BlockRunner, feats: dict[str, torch.Tensor]):
    """(group, its linears, the function its loss is measured on) for the block's scaling groups."""
    w = blk.w
    groups = [
        (
            "qkv",
            ["q", "k", "v"],
            lambda ws: runner.attention(blk, w | dict(zip("qkv", ws)), feats["qkv"]),
        ),
        (
            "gate_up",
            ["gate", "up"],
            lambda ws: runner.mlp(blk, w | {"gate": ws[0], "up": ws[1]}, feats["gate_up"]),
        ),
        ("down", ["down"], lambda ws: F.linear(feats["down"], ws[0], blk.b.get("down"))),
    ]
    if (
        w["v"].shape[0] == w["o"].shape[1]
    ):  # v's output rows feed o's input columns one to one (no GQA)
        groups.insert(1, ("o", ["o"], lambda ws: F.linear(feats["o"], ws[0], blk.b.get("o"))))
    return groups


def fold_scales(
    blk: Block, scales: dict[str, torch.Tensor], feats: dict[str, torch.Tensor] | None = None
) -> None:
    """Fold each group's s (fp-exact): the op before divides by s, its linears' inputs multiply."""
    prev = {
        "qkv": ("norm", "ln1"),
        "o": ("rows", "v"),
        "gate_up": ("norm", "ln2"),
        "down": ("rows", "up"),
    }
    users = {"qkv": ["q", "k", "v"], "o": ["o"], "gate_up": ["gate", "up"], "down": ["down"]}
    for g, s in scales.items():
        kind, target = prev[g]
        if kind == "norm":
            blk.norms[target].div_(s)
        else:
            _scale_rows(blk, target, s)
        for n in users[g]:
            blk.w[n].mul_(s)
        if feats is not None:
            feats[g] = feats[g] / s  # the inputs the scaled weights will meet


def clip_weights(blk: Block, feats: dict[str, torch.Tensor], group: int) -> None:
    """Clip all linears but q/k to the per-group max minimising output error on sampled tokens."""
    # q and k are left alone: their errors reach the softmax scores, where clipping hurts more than
    # it helps (AutoAWQ skips them too); each other linear is searched on the inputs it meets
    inputs = {"v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}
    for n, g in inputs.items():
        w = blk.w[n]
        mx = search_clip(w, feats[g], group).unsqueeze(-1)
        k = w.shape[1]
        blk.w[n] = torch.clamp(w.view(-1, k // group, group), -mx, mx).view(-1, k)


def awq_block(
    blk: Block, runner: BlockRunner, feats: dict[str, torch.Tensor], group: int
) -> dict[str, float]:
    """Search and fold AWQ scales, then clip, in place on blk; returns each group's chosen alpha."""
    found = {
        g: search_scales(feats[g], [blk.w[n] for n in names], run, group)
        for g, names, run in scale_groups(blk, runner, feats)
    }  # each search sees the original weights
    fold_scales(blk, {g: s for g, (s, _) in found.items()}, feats)
    clip_weights(blk, feats, group)
    return {g: a for g, (_, a) in found.items()}
