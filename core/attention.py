"""Paged attention: K/V are written through a slot mapping and read back only through block tables.

A step whose sequences compute as many tokens each (decode, a step graph) gathers its contexts
into [seqs, query, max_context] once per step (the gather index and masks are shared by every
layer), then runs scaled_dot_product_attention. A step whose sequences compute several tokens
(prefill chunks, with or without decodes beside them) attends each sequence apart: padded, eight
prompts of 32 to 512 tokens were one [8, 512, 512] masked attention per layer, a third of their
prefill's time, where each prompt alone is causal without a mask, which SDPA's flash kernel
computes in triangles. On a CPU, ops.cpp's prefill attention does the same in place, for a prompt's
later chunks too (no mask made), at 1.4-2x SDPA's speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pagechat.core import paged_triton

# A sequence's new tokens up to this many (a draft's verification, MAX_GRAPH_TOKENS at most, so
# that a step graph and the eager step attend alike) run ops.cpp's decode attention, reading the
# context in place: 5 rows over 1,000 keys 275 us against 514 for the gather and SDPA (SmolLM2's
# shape, bf16, 2 threads, EPYC Zen 4), 16 rows 488 against 535. A longer prompt chunk runs ops.cpp's
# prefill attention, blocked into tiles (2,000 rows in the decode op took 1.2x SDPA's time).
IN_PLACE_ROWS = 16
# enable_gqa arrived in torch 2.5; older torch repeats the K/V heads instead
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors all layers' attention shares: where to write K/V, what each query reads."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    # [B * max_ctx] pool slots of each sequence's context, row after row (padded with slot 0)
    gather: torch.Tensor
    q_pos: torch.Tensor  # [B, max_q] position of each padded query (-1 for padding)
    _masks: dict = field(default_factory=dict)
    # (start, count) of each sequence where some computes several tokens, for the eager ragged
    # path; None for decode steps and inside a step graph, which take the padded one
    spans: tuple[tuple[int, int], ...] | None = None
    # [B, blocks] int32 block table, for the decode rows on a GPU (core/paged_triton.py), which
    # read their contexts through it in place; None where decodes gather (or use ops.cpp's)
    block_table: torch.Tensor | None = None
    block_size: int = 0

    @property
    def uniform(self) -> bool:
        """Whether every sequence computes as many tokens (the padded path needs no padding)."""
        return self.spans is None or len({count for _, count in self.spans}) == 1

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, max_q, max_ctx] bool for a uniform step (the padded path's): causal, within the
        context, and within the sliding window if any; None when every query may read every key
        (one sequence decoding), so attention runs without a mask."""
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
            self._masks[window] = None if bool(allowed.all()) else allowed.unsqueeze(1)
        return self._masks[window]


def build_metadata(
    starts: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    paged: bool = False,
) -> AttentionMetadata:
    """Metadata for sequences computing `counts[i]` tokens after `starts[i]` already cached ones;
    paged: with the block table that core/paged_triton.py's decode attention reads."""
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
    else:
        i = torch.arange(max_q)
        starts_t, counts_t = torch.tensor(starts).unsqueeze(1), torch.tensor(counts).unsqueeze(1)
        valid = i < counts_t
        q_pos = torch.where(valid, starts_t + i, -1)
        slot_mapping = gather.gather(1, torch.where(valid, starts_t + i, 0))[valid]
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        gather=gather.flatten().to(device),
        q_pos=q_pos.to(device),
        spans=None if max_q == 1 else tuple(zip(starts, counts)),
        block_table=table.to(device, torch.int32) if paged else None,
        block_size=block_size,
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
    fused: the sequences computing one token (all of a decode step's, the decodes beside a prompt
    chunk) run core/ops.py's decode_attention, which reads the context in place instead of
    gathering it (the trace's key says which; with a block table, core/paged_triton.py's does),
    and so do a sequence's few new tokens (IN_PLACE_ROWS: a draft's verification), causal by
    position."""
    if (fused or meta.block_table is not None) and meta.q_pos.shape[1] == 1:
        return _decode_in_place(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.q_pos, meta, window
        )
    if fused and meta.spans is None:  # a step graph's verification: as many tokens a sequence
        return torch.ops.pagechat.decode_attention(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.gather, meta.q_pos, window or 0
        )
    if fused:  # ops.cpp's: no cast made, 8 values at a time
        torch.ops.pagechat.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if meta.spans is not None:
        return _ragged_attention(q, k, v, k_cache, v_cache, meta, window, fused)
    return _gathered_attention(q, k_cache, v_cache, meta, window)


_GQA = {"enable_gqa": True} if _SDPA_GQA else {}


def _decode_in_place(q, k, v, k_cache, v_cache, slot_mapping, q_pos, meta, window, seqs=None):
    """One-token rows in one call that writes their K/V and reads each context where it lies:
    core/paged_triton.py's through the block table (a GPU), else core/ops.py's through the gather
    slots. seqs: the sequences of a ragged step the rows are (None: every sequence, a row each)."""
    if meta.block_table is not None:
        table = meta.block_table if seqs is None else meta.block_table.index_select(0, seqs)
        return paged_triton.decode_attention(
            q, k, v, k_cache, v_cache, slot_mapping, table, q_pos, meta.block_size, window or 0
        )
    gather = meta.gather
    if seqs is not None:
        gather = gather.view(len(meta.spans), -1).index_select(0, seqs).flatten()
    return torch.ops.pagechat.decode_attention(
        q, k, v, k_cache, v_cache, slot_mapping, gather, q_pos, window or 0
    )


def _ragged_attention(q, k, v, k_cache, v_cache, meta, window: int | None, fused: bool):
    """Each sequence's queries against its own context (_attend_one; fused: ops.cpp's
    decode_attention where they are few, see IN_PLACE_ROWS, else its prefill_attention). fused or
    paged (a block table): the one-token sequences in one decode attention call (a call per
    sequence, 30 layers a step, cost a serving step beside a prompt chunk far more than its
    decodes)."""
    max_ctx = meta.gather.shape[0] // len(meta.spans)
    firsts = [0]
    for _, count in meta.spans:
        firsts.append(firsts[-1] + count)
    out = torch.empty_like(q)
    one = fused or meta.block_table is not None  # the one-token sequences attend in one call
    decodes = [b for b, (_, count) in enumerate(meta.spans) if count == 1] if one else []
    if decodes:
        rows = torch.tensor([firsts[b] for b in decodes], device=q.device)
        seqs = torch.tensor(decodes, device=q.device)
        q_pos = torch.tensor([[meta.spans[b][0]] for b in decodes], device=q.device)
        # it writes the rows' K and V again, the same values
        out[rows] = _decode_in_place(
            q[rows], k[rows], v[rows], k_cache, v_cache, meta.slot_mapping[rows], q_pos, meta,
            window, seqs,
        )  # fmt: skip
    for b, (start, count) in enumerate(meta.spans):
        if not (one and count == 1):
            slots = meta.gather[b * max_ctx : b * max_ctx + start + count]
            rows = slice(firsts[b], firsts[b] + count)
            if fused and count <= IN_PLACE_ROWS:  # ops.cpp's, causal by each row's position
                positions = torch.arange(start, start + count, device=q.device).unsqueeze(0)
                out[rows] = torch.ops.pagechat.decode_attention(
                    q[rows], k[rows], v[rows], k_cache, v_cache, meta.slot_mapping[rows], slots,
                    positions, window or 0,
                )  # fmt: skip
            elif fused:  # ops.cpp's prefill attention: no mask, the context read in place
                out[rows] = torch.ops.pagechat.prefill_attention(
                    q[rows], k_cache, v_cache, slots, start, window or 0
                )
            else:
                out[rows] = _attend_one(q[rows], k_cache, v_cache, slots, start, window)
    return out


def _attend_one(q, k_cache, v_cache, slots, start: int, window: int | None) -> torch.Tensor:
    """One sequence's queries q [count, H, D], at positions start.., against its context (the
    cache's `slots`): causal without a mask where its queries are its whole context (a prompt from
    its start, within the window), else masked by position."""
    count, ctx = q.shape[0], slots.shape[0]
    keys = k_cache.index_select(0, slots).to(q.dtype).transpose(0, 1)
    values = v_cache.index_select(0, slots).to(q.dtype).transpose(0, 1)
    if not _SDPA_GQA and keys.shape[0] != q.shape[1]:
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[0], dim=0)
        values = values.repeat_interleave(q.shape[1] // values.shape[0], dim=0)
    causal = start == 0 and count > 1 and (window is None or ctx <= window)
    mask = None
    if not causal and (count > 1 or (window is not None and ctx > window)):
        q_pos = torch.arange(start, ctx, device=q.device).unsqueeze(1)
        k_pos = torch.arange(ctx, device=q.device)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= q_pos - k_pos < window
    # [1, heads, count, D] as the padded path's: SDPA's CPU flash kernel takes 4-d inputs
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        mask,
        is_causal=causal,
        **_GQA,
    )
    return attended[0].transpose(0, 1)


def _gathered_attention(q, k_cache, v_cache, meta: AttentionMetadata, window: int | None):
    """paged_attention in torch ops over a batch of sequences computing as many tokens each (a
    decode step, a step graph): gather every context position, run SDPA."""
    # The batch size is read from a tensor, so a traced step follows it; other sizes are -1 or flat.
    b = meta.q_pos.shape[0]
    qp = q.unflatten(0, (b, -1))
    # keys and values [B, KV, ctx, D] by index_select, not k_cache[meta.gather]: on CPU, advanced
    # indexing copies several times slower
    keys = k_cache.index_select(0, meta.gather).to(q.dtype).unflatten(0, (b, -1)).transpose(1, 2)
    values = v_cache.index_select(0, meta.gather).to(q.dtype).unflatten(0, (b, -1)).transpose(1, 2)
    if not _SDPA_GQA and keys.shape[1] != q.shape[1]:
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, values, attn_mask=meta.mask(window), **_GQA
    )
    return out.transpose(1, 2).flatten(0, 1)
