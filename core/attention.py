"""Paged attention: K/V are written through a slot mapping and read back only through block tables.

The torch backend pads the step's ragged batch into [seqs, max_query, max_context] once per step
(the gather index and masks are shared by every layer), then runs scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# enable_gqa arrived in torch 2.5; older torch repeats the K/V heads instead
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors all layers' attention shares: where to write K/V, what each query reads."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    # [B * max_ctx] pool slots of each sequence's context, row after row (padded with slot 0)
    gather: torch.Tensor
    q_rows: torch.Tensor | None  # [T] each token's row in the padded [B * max_q]; None: no padding
    q_pos: torch.Tensor  # [B, max_q] position of each padded query (-1 for padding)
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, max_q, max_ctx] bool: causal, within the context, and within the sliding window if
        any; None when every query may read every key (one sequence decoding), so attention runs
        without a mask."""
        if window not in self._masks:
            if self.q_pos.shape == (1, 1) and (window is None or self.gather.shape[0] <= window):
                # one sequence decoding its newest token: it reads the whole context
                self._masks[window] = None
                return None
            k_pos = torch.arange(
                self.gather.shape[0] // self.q_pos.shape[0], device=self.gather.device
            )
            q = self.q_pos.unsqueeze(-1)
            allowed = k_pos <= q
            if window is not None:
                allowed &= q - k_pos < window
            # padding rows attend to slot 0 only, so softmax never sees an all-masked row (NaN)
            allowed |= (q < 0) & (k_pos == 0)
            self._masks[window] = None if bool(allowed.all()) else allowed.unsqueeze(1)
        return self._masks[window]


def build_metadata(
    starts: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences computing `counts[i]` tokens after `starts[i]` already cached ones."""
    max_q = max(counts)
    ctx = [s + c for s, c in zip(starts, counts)]
    max_ctx = max(ctx)
    max_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    # the slot of every context position, row after row: each block's first slot plus its offsets
    gather = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(1)[:, :max_ctx]
    if min(ctx) < max_ctx:  # a shorter context reads slot 0 past its end
        gather = torch.where(torch.arange(max_ctx) < torch.tensor(ctx).unsqueeze(1), gather, 0)
    # every sequence computes one token (decode): no padding, slots found in Python
    if max_q == min(counts) == 1:
        q_pos = torch.tensor(starts).unsqueeze(1)
        slot_mapping = torch.tensor(
            [t[s // block_size] * block_size + s % block_size for t, s in zip(tables, starts)]
        )
        q_rows = None
    else:
        i = torch.arange(max_q)
        starts_t, counts_t = torch.tensor(starts).unsqueeze(1), torch.tensor(counts).unsqueeze(1)
        valid = i < counts_t
        q_pos = torch.where(valid, starts_t + i, -1)
        slot_mapping = gather.gather(1, torch.where(valid, starts_t + i, 0))[valid]
        q_rows = None if bool(valid.all()) else valid.flatten().nonzero().squeeze(1).to(device)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        gather=gather.flatten().to(device),
        q_rows=q_rows,
        q_pos=q_pos.to(device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    fused: bool = False,
) -> torch.Tensor:
    """Write k/v [T, KV, D] into the caches [slots, KV, D], then attend q [T, H, D] -> [T, H, D].
    A cache kept in another dtype than q's (16 bits under a float32 model) is cast both ways.
    fused: a step where every sequence computes one token runs core/ops.py's decode_attention,
    which reads the context in place instead of gathering it (the trace's key says which)."""
    if fused and meta.q_pos.shape[1] == 1:
        return torch.ops.pagechat.decode_attention(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.gather, meta.q_pos, window or 0
        )
    return _gathered_attention(q, k, v, k_cache, v_cache, meta, window)


def _gathered_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int | None):
    """paged_attention in torch ops: write k/v, gather every context position, run SDPA."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    # The batch size is read from a tensor, so a traced step follows it; other sizes are -1 or flat.
    b = meta.q_pos.shape[0]
    if meta.q_rows is None:
        qp = q.unflatten(0, (b, -1))
    else:
        qp = (
            q.new_zeros(meta.q_pos.numel(), *q.shape[1:])
            .index_copy_(0, meta.q_rows, q)
            .unflatten(0, (b, -1))
        )
    # keys and values [B, KV, ctx, D] by index_select, not k_cache[meta.gather]: on CPU, advanced
    # indexing copies several times slower
    keys = k_cache.index_select(0, meta.gather).to(q.dtype).unflatten(0, (b, -1)).transpose(1, 2)
    values = v_cache.index_select(0, meta.gather).to(q.dtype).unflatten(0, (b, -1)).transpose(1, 2)
    if not _SDPA_GQA and keys.shape[1] != q.shape[1]:
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    extra = {"enable_gqa": True} if _SDPA_GQA else {}
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, values, attn_mask=meta.mask(window), **extra
    )
    out = out.transpose(1, 2).flatten(0, 1)
    return out if meta.q_rows is None else out[meta.q_rows]
