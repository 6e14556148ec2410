"""Sampler: repetition penalty, temperature, top-k / top-p / min-p, seeded draws, candidate records.

Semantics follow transformers' RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper (min_tokens_to_keep=1), applied in that
order, but vectorised across rows so every row may carry its own settings. A constrained row's
grammar mask (core/grammar.py) comes first, after the penalty: the filters see only what it allows,
as vLLM applies its bitmask before sampling.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.ops import candidates, row_max, sampler_ops_take
from pagechat.core.params import SamplingParams
from torch import Tensor

_CUT_BY = (None, "grammar", "top-k", "top-p", "min-p")  # index = the cut code used below
_NEG_INF = float("-inf")
# where ops.cpp's top_p_cut does not run (a GPU, PAGECHAT_KERNELS=0): the tokens top-p looks at
# before it sorts the whole vocabulary...
TOP_P_SHORTLIST = 256
TOP_P_SHORTLIST_VOCAB = 4096  # ...in vocabularies this large: in smaller ones one sort is cheaper
# Closer than this to the top-p limit, a token's fate is left to the full sort: transformers'
# float32 cumulative sum (a double accumulator on CPU) is within ~1e-7 of the exact sum, so 1e-5
# leaves a wide berth.
TOP_P_MARGIN = 1e-5


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    seq_id: int
    params: SamplingParams
    history: list[int]  # prompt + output token ids so far (for the repetition penalty)
    generator: torch.Generator | None  # on the logits' device; None -> torch's global RNG
    allowed: Tensor | None = None  # the grammar's mask [V] (bool) of a constrained row
    where: str = ""  # where the row's grammar matcher stands (the sampling panel says it)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token in the sampling panel: its logit, probability and which filter (if any) cut it."""

    token_id: int
    text: str  # the token's text as the tokenizer decodes it alone
    logit: float  # after repetition penalty, before temperature
    prob: (
        float  # softmax(logit / T) over the whole vocabulary, before any filter (T = 1 when greedy)
    )
    cum_prob: float  # cumulative prob down the candidate list (sorted by logit, descending)
    kept: bool  # survived the filters; a greedy row keeps only its argmax
    cut_by: (
        str | None
    )  # "grammar" | "top-k" | "top-p" | "min-p": the first filter that cut it; None if kept
    chosen: bool


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """The sampler's own record of one sampled token: what the UI's sampling panel shows."""

    seq_id: int
    token_id: int
    candidates: tuple[Candidate, ...]  # top-N by logit; the chosen token is appended if outside it
    params: SamplingParams  # a copy of the params in force for this token
    allowed: int | None = None  # tokens the grammar allowed here (None: unconstrained)
    where: str = ""  # where the grammar matcher stood


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request on `device`, or None (global RNG) when there's no seed."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _column(values: list, like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)


def penalised_logits(logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
    """`logits` in float32 with each row's repetition penalty applied over its history (`logits`
    itself when it is float32 and no row has a penalty: nothing downstream writes into it)."""
    out = logits.float()
    hit = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1 and r.history]
    if not hit:
        return out
    n, vocab = out.shape
    dev = out.device
    # One scatter for the whole batch: flat (row, token) pairs mark every token seen in a history.
    tokens = torch.tensor(
        list(itertools.chain.from_iterable(rows[i].history for i in hit)), device=dev
    )
    lengths = torch.tensor([len(rows[i].history) for i in hit], device=dev)
    row_ids = torch.repeat_interleave(torch.tensor(hit, device=dev), lengths)
    valid = (tokens >= 0) & (tokens < vocab)  # ids outside the vocabulary are skipped
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    seen[row_ids[valid], tokens[valid]] = True
    pen = _column([r.params.repetition_penalty for r in rows], out)
    return torch.where(seen, torch.where(out < 0, out * pen, out / pen), out)


def _top_p_by_sort(x: Tensor, thresholds: Tensor) -> Tensor:
    """Top-p removal mask as transformers' TopPLogitsWarper computes it (threshold 0: row off)."""
    # Ascending, with torch's default (unstable) sort, exactly as transformers: the cumulative sums
    # match it bit for bit and tied logits at the boundary break the same way.
    sorted_x, order = torch.sort(x, dim=-1)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= thresholds) & (thresholds > 0)  # top_p == 1 is off, as in transformers
    drop[:, -1] = False  # min_tokens_to_keep=1: the top token always stays
    return torch.zeros_like(drop).scatter_(1, order, drop)


def top_p_removed(x: Tensor, tops: list[float]) -> Tensor:
    """Which tokens top-p removes: transformers' mask, found where it is clear without sorting the
    whole vocabulary (ops.cpp's top_p_cut on a CPU where the ops build, else the TOP_P_SHORTLIST
    most likely tokens), by the full sort for the rows where it is not."""
    # 1 - p in double, then float32, as transformers compares
    thresholds = _column([1 - t for t in tops], x)
    if sampler_ops_take(x):
        removed, slow = torch.ops.pagechat.top_p_cut(x, thresholds, TOP_P_MARGIN)
    elif x.shape[1] < TOP_P_SHORTLIST_VOCAB:
        return _top_p_by_sort(x, thresholds)
    else:
        removed, slow = _top_p_from_shortlist(x, thresholds)
    if slow.any():
        removed[slow] = _top_p_by_sort(x[slow], thresholds[slow])
    return removed


def _top_p_from_shortlist(x: Tensor, thresholds: Tensor) -> tuple[Tensor, Tensor]:
    """(top-p's removed mask [n, V], the rows [n] left to the full sort) from the TOP_P_SHORTLIST
    most likely tokens. A nucleus of tens of tokens (a trained model's) then costs a top-k of the
    shortlist instead of a sort of the whole vocabulary; a nucleus beyond the shortlist (a flat,
    untrained model's) pays for both.

    transformers removes a token when the probability mass of it and every less likely token is
    <= 1 - p, i.e. keeps the token ranked j (descending) when the mass ranked above it is
    < total - (1 - p). That is decided from the shortlist unless the cut falls beyond it, the mass
    above a token next to the cut lies within TOP_P_MARGIN of the limit (float32 rounding of
    transformers' cumulative sum could decide it), or two equally likely tokens straddle the cut
    (the sort's tie order decides it).
    """
    probs = x.softmax(dim=-1)
    k = TOP_P_SHORTLIST
    top, idx = probs.topk(k, dim=-1)
    top64 = top.double()
    above = top64.cumsum(dim=-1) - top64  # mass ranked strictly above each shortlisted token
    limit = probs.double().sum(dim=-1, keepdim=True) - thresholds.double()
    keep = above < limit
    keep[:, 0] = True
    kept = keep.sum(dim=-1, keepdim=True)  # the cut: tokens ranked >= kept are removed
    ranks = torch.arange(k, device=x.device)
    near = (above - limit).abs() < TOP_P_MARGIN
    near &= ((ranks == kept - 1) & (ranks > 0)) | (
        ranks == kept
    )  # the last kept and the first removed token
    tied = (top[:, :-1] == top[:, 1:]) & (ranks[1:] == kept)  # the first removed ties the last kept
    beyond = (kept == k).squeeze(1)
    on = thresholds.squeeze(1) > 0  # top_p == 1 is off
    removed = torch.ones_like(x, dtype=torch.bool).scatter_(1, idx, ~keep)
    removed[~on] = False
    return removed, (near.any(dim=-1) | tied.any(dim=-1) | beyond) & on


def _temperatures(rows: Sequence[SampleRow]) -> list[float]:
    """Each row's temperature; 1 for a greedy row, whose logits are not divided."""
    return [1.0 if r.params.greedy else r.params.temperature for r in rows]


def tempered(pen: Tensor, rows: Sequence[SampleRow], top: Tensor | None = None) -> Tensor:
    """The penalised logits divided by each row's temperature (greedy rows: by 1); `top`: each
    row's largest penalised logit ([n, 1]), when the caller has it already.

    A temperature so small that a row's top logit overflows (1e-38, say) takes the row's limit
    instead: its top logits 0, the others -inf, so softmax gives the argmax (ties shared), not NaN.
    """
    temps = _temperatures(rows)
    if all(t == 1 for t in temps):
        return pen
    t = _column(temps, pen)
    x = pen / t
    top = pen.amax(dim=-1, keepdim=True) if top is None else top
    over = ~torch.isfinite(top / t).squeeze(1)  # dividing by t > 0 keeps the maximum's place
    if over.any():
        x[over] = torch.where(pen[over] == top[over], 0.0, _NEG_INF)
    return x


def _masked(pen: Tensor, rows: Sequence[SampleRow]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(the penalised logits with what the rows' grammars forbid at -inf, their row maxima [n, 1],
    the first index of each maximum [n], the forbidden tokens [n, V] or None when no row is
    constrained)."""
    top, best = row_max(pen)
    # the maxima as floats, not torch.isfinite(...).all(): three ops fewer a step, each ~30 us
    # on the caches a decode step's weights have just streamed through
    if not all(math.isfinite(v) for (v,) in top.tolist()):
        raise PagechatError(
            "the model's logits are not finite (NaN or inf): its weights are broken or its "
            "precision overflowed"
        )
    masks = [r.allowed for r in rows]
    if all(m is None for m in masks):
        return pen, top, best, None
    allowed = torch.ones_like(pen, dtype=torch.bool)
    for i, m in enumerate(masks):
        if m is not None:
            allowed[i] = m.to(pen.device)
    masked = pen.masked_fill(~allowed, _NEG_INF)
    return masked, *row_max(masked), ~allowed


def _process(
    logits: Tensor, rows: Sequence[SampleRow]
) -> tuple[Tensor, Tensor, list[Tensor | None], Tensor]:
    """(penalised logits, processed logits, [grammar, top-k, top-p, min-p] masks, None if not
    applied, each row's first argmax of the masked logits: a greedy row's token). The penalised
    logits are the model's, unmasked: what the panel shows."""
    pen = penalised_logits(logits, rows)
    masked, top, best, grammar = _masked(pen, rows)
    vocab = pen.shape[1]
    # Greedy rows ride along with neutral settings: their processed logits are the penalised ones.
    ps = [r.params for r in rows]
    ks = [0 if p.greedy or p.top_k >= vocab else p.top_k for p in ps]
    tops = [1.0 if p.greedy else p.top_p for p in ps]
    min_ps = [0.0 if p.greedy else p.min_p for p in ps]
    x = tempered(masked, rows, top)
    cuts: list[Tensor | None] = [grammar, None, None, None]
    if any(ks):
        k = torch.tensor(ks, device=pen.device).unsqueeze(1)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        removed = (x < kth) & (k > 0)  # ties with the k-th value survive, as in transformers
        x = x.masked_fill(removed, _NEG_INF)
        cuts[1] = removed
    if any(t < 1 for t in tops):
        removed = top_p_removed(x, tops)
        x = x.masked_fill(removed, _NEG_INF)
        cuts[2] = removed
    if any(m > 0 for m in min_ps):
        probs = x.softmax(dim=-1)
        # The top token is never below min_p * max (min_p <= 1), so it always stays.
        removed = probs < _column(min_ps, pen) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(removed, _NEG_INF)
        cuts[3] = removed
    return pen, x, cuts, best


def processed_logits(logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
    """Penalty, temperature, filters applied; cut entries -inf (greedy rows: penalised logits)."""
    return _process(logits, rows)[1]


def target_probs(logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
    """The exact distribution each row samples from ([n, V], rows sum to 1); greedy rows one-hot
    on the first argmax of their processed logits, which are their (masked) penalised ones."""
    _, x, _, best = _process(logits, rows)
    probs = x.softmax(dim=-1)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        g = torch.tensor(greedy, device=x.device)
        probs[g] = 0.0
        probs[g, best[g]] = 1.0
    return probs


def _uniforms(n: int, generators: Sequence[torch.Generator | None], dev: torch.device) -> Tensor:
    """One uniform per row [n, 1] float64, from that row's own generator (so a seeded row's tokens
    do not depend on the batch), the unseeded rows' from torch's."""
    if n == 1:  # the same draw as below, in one op
        return torch.rand(1, 1, dtype=torch.float64, generator=generators[0], device=dev)
    u = torch.empty(n, 1, dtype=torch.float64, device=dev)
    free = [i for i, g in enumerate(generators) if g is None]
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=g, device=dev)
    if free:
        u[torch.tensor(free, device=dev)] = torch.rand(
            len(free), 1, dtype=torch.float64, device=dev
        )
    return u


def draw_from(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of `probs` [n, V] (rows sum to ~1) by inverse CDF with generators[i]."""
    # A batched search of the float64 CDF. torch.multinomial would do the same draw but is slow on
    # CPU for large vocabularies; this is a cumsum and two searchsorted calls.
    u = _uniforms(probs.shape[0], generators, probs.device)
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(
        cdf, u * total, right=True
    )  # first token whose CDF exceeds the target
    # u * total can round up to total: fall back to the last token with nonzero probability.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last).squeeze(1)


def draw_softmax(x: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """draw_from(x.softmax(dim=-1), generators) for processed logits x [n, V]: the same inverse
    CDF in one op (ops.cpp's softmax_draw) where the ops build."""
    if sampler_ops_take(x):
        u = _uniforms(x.shape[0], generators, x.device)
        return torch.ops.pagechat.softmax_draw(x, u)
    return draw_from(x.softmax(dim=-1), generators)


class Sampler:
    """Picks one token per row and records the candidates it saw, for the sampling panel."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._token_text = token_text
        self._texts: dict[int, str] = {}  # decoding one token at a time is slow; texts never change

    def text(self, token_id: int) -> str:
        """The token's text as decoded alone (cached)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id)
        return text

    def sample(
        self, logits: Tensor, rows: Sequence[SampleRow]
    ) -> tuple[list[int], list[SampleRecord]]:
        """One token per row (argmax if greedy, a seeded draw otherwise) and one record per row."""
        if not rows:
            return [], []
        pen, x, cuts, best = _process(logits, rows)
        tokens = self._draw(x, rows, best)
        chosen = tokens.tolist()
        return chosen, self._records(pen, x, cuts, tokens, chosen, rows)

    def record(
        self, logits: Tensor, rows: Sequence[SampleRow], chosen: list[int]
    ) -> list[SampleRecord]:
        """Records for tokens chosen in speculative verification, by the logits that judged them."""
        if not rows:
            return []
        pen, x, cuts, _ = _process(logits, rows)
        return self._records(pen, x, cuts, torch.tensor(chosen, device=logits.device), chosen, rows)

    @staticmethod
    def _draw(x: Tensor, rows: Sequence[SampleRow], best: Tensor) -> Tensor:
        """Each row's token: `best` for a greedy row (its processed logits are its masked ones,
        whose first argmax `best` is), a draw from softmax(x) for the others; written into best."""
        greedy = [r.params.greedy for r in rows]
        if not any(greedy):  # every row draws: no indexing in and out
            return draw_softmax(x, [r.generator for r in rows])
        drawn = [i for i, g in enumerate(greedy) if not g]
        if drawn:
            idx = torch.tensor(drawn, device=x.device)
            # Row-wise softmax of the processed logits: what target_probs gives for these rows.
            best[idx] = draw_softmax(x[idx], [rows[i].generator for i in drawn])
        return best

    def _records(
        self,
        pen: Tensor,
        x: Tensor,
        cuts: list[Tensor | None],
        tokens: Tensor,
        chosen: list[int],
        rows: Sequence[SampleRow],
    ) -> list[SampleRecord]:
        """One SampleRecord per row: its top candidates (and the chosen token), with figures."""
        wants = [r.params.num_candidates for r in rows]
        top_n = min(max(wants), pen.shape[1])
        params = [r.params for r in rows]  # frozen: a record may hold the request's own
        allowed = [None if r.allowed is None else int(r.allowed.sum()) for r in rows]
        if top_n == 0:
            return [
                SampleRecord(r.seq_id, t, (), p, a, r.where)
                for r, t, p, a in zip(rows, chosen, params, allowed)
            ]
        cols = _candidate_columns(pen, x, cuts, tokens, rows, top_n)
        return [
            SampleRecord(r.seq_id, token, self._candidates(want, token, top_n, col), p, a, r.where)
            for r, want, token, col, p, a in zip(rows, wants, chosen, cols, params, allowed)
        ]

    def _candidates(self, want: int, token: int, top_n: int, col: tuple) -> tuple[Candidate, ...]:
        """One row's candidates: its first `want` of the top N, then the chosen token if outside."""
        i_, l_, p_, k_, c_ = col
        picks = list(range(min(want, top_n)))
        if want and token not in i_[:want]:
            picks.append(top_n)  # the chosen token's column
        cum, cands = 0.0, []
        for j in picks:
            cum += p_[j]
            cut_by = _CUT_BY[c_[j]]
            cands.append(
                Candidate(i_[j], self.text(i_[j]), l_[j], p_[j], cum, k_[j], cut_by, i_[j] == token)
            )
        return tuple(cands)


def _candidate_columns(
    pen: Tensor,
    x: Tensor,
    cuts: list[Tensor | None],
    tokens: Tensor,
    rows: Sequence[SampleRow],
    top_n: int,
) -> list[tuple]:
    """Per row, (ids, logits, probs, kept, cut codes) of its top N tokens, then the chosen one."""
    # Everything per candidate is computed on an [n, N + 1] block (top N, then the chosen token),
    # then read back with a few .tolist() calls: no tensor op per candidate.
    temps = torch.tensor(_temperatures(rows), device=pen.device)
    ids, prob = candidates(pen, temps, tokens, top_n)
    logit = pen.gather(1, ids)
    greedy = _column([r.params.greedy for r in rows], pen, torch.bool)
    kept = torch.where(greedy, ids == tokens.unsqueeze(1), x.gather(1, ids) > _NEG_INF)
    code = _cut_codes(ids, cuts)  # a greedy row's filters are off: only its grammar cuts
    return list(zip(ids.tolist(), logit.tolist(), prob.tolist(), kept.tolist(), code.tolist()))


def _cut_codes(ids: Tensor, cuts: list[Tensor | None]) -> Tensor:
    """Per candidate, its index into _CUT_BY: the first filter, in order, whose mask removed it."""
    code = torch.zeros(ids.shape, dtype=torch.long, device=ids.device)
    for c, removed in reversed(list(enumerate(cuts, 1))):
        if removed is not None:
            code.masked_fill_(removed.gather(1, ids), c)
    return code
