"""The Triton kernels of core/paged_triton.py (which says what they compute and why), apart so
that a process that never attends on a GPU never imports Triton (about a second)."""

import triton
import triton.language as tl


@triton.jit
def store_kv(k, v, k_cache, v_cache, slots, k_row, v_row, c_slot, n, BLOCK: tl.constexpr):
    """Row t's K and V [KV * D] into the caches at slots[t]; a negative slot (a padding row of
    a captured batch) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        i = tl.arange(0, BLOCK)
        m = i < n
        kt = tl.load(k + t * k_row + i, mask=m)
        tl.store(k_cache + slot * c_slot + i, kt.to(k_cache.dtype.element_ty), mask=m)
        vt = tl.load(v + t * v_row + i, mask=m)
        tl.store(v_cache + slot * c_slot + i, vt.to(v_cache.dtype.element_ty), mask=m)


@triton.jit
def attend_part(
    q, k_cache, v_cache, table, q_pos, acc_out, ml_out,
    q_row, q_head, c_slot, c_head, t_row, block_size, part, window, scale,
    GROUP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """Query row t's GROUP heads sharing KV head h against partition p of its context: the
    unnormalised sums of V [G, D] and each head's max and sum of exponentials."""
    t, h, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(q_pos + t) + 1
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    lo, hi = tl.maximum(first, p * part), tl.minimum(ctx, (p + 1) * part)
    g, d = tl.arange(0, G), tl.arange(0, BLOCK_D)
    gd = (g[:, None] < GROUP) & (d[None, :] < D)
    heads = h * GROUP + g
    qg = tl.load(q + t * q_row + heads[:, None] * q_head + d[None, :], mask=gd, other=0.0)
    qg = qg.to(tl.float32) * scale
    m_i, l_i = tl.full([G], float("-inf"), tl.float32), tl.zeros([G], tl.float32)
    acc = tl.zeros([G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        block = tl.load(table + t * t_row + n // block_size, mask=valid, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        at = slot[:, None] * c_slot + h * c_head + d[None, :]
        nd = valid[:, None] & (d[None, :] < D)
        kt = tl.load(k_cache + at, mask=nd, other=0.0).to(tl.float32)
        scores = tl.sum(qg[:, None, :] * kt[None, :, :], axis=2)  # [G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha, e = tl.exp(m_i - m_new), tl.exp(scores - m_new[:, None])
        vt = tl.load(v_cache + at, mask=nd, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(e[:, :, None] * vt[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(e, axis=1)
        m_i = m_new
    # partials [T, H, P, D] and [T, H, P, 2]; an empty partition leaves -inf, 0 and zeros
    row = (t * (tl.num_programs(1) * GROUP) + heads) * P + p
    tl.store(acc_out + row[:, None] * D + d[None, :], acc, mask=gd)
    tl.store(ml_out + row * 2, m_i, mask=g < GROUP)
    tl.store(ml_out + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def merge(
    acc_in, ml_in, out, o_row, o_head, heads,
    D: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    """Head h of row t: its partitions' sums rescaled to their common max, over their sum."""
    t, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, P_PAD)
    d = tl.arange(0, BLOCK_D)
    row = (t * heads + h) * P + i
    m = tl.load(ml_in + row * 2, mask=i < P, other=float("-inf"))
    l_p = tl.load(ml_in + row * 2 + 1, mask=i < P, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    pd = (i[:, None] < P) & (d[None, :] < D)
    acc = tl.load(acc_in + row[:, None] * D + d[None, :], mask=pd, other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_p * w, axis=0)
    tl.store(out + t * o_row + h * o_head + d, o.to(out.dtype.element_ty), mask=d < D)
