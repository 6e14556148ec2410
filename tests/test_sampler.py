"""Sampler tests: transformers' warpers are the oracle for the filtered logits; draws are seeded."""

import dataclasses

import pytest
import torch
from pagechat.core.params import SamplingParams
from pagechat.core.sampler import (
    Sampler,
    SampleRow,
    draw_from,
    draw_softmax,
    make_generator,
    processed_logits,
    target_probs,
)
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

INF = float("inf")


def make_logits(seed: int, n: int, vocab: int) -> torch.Tensor:
    """Rows of three kinds: plain normal, coarse (many exact ties), very peaked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    x[1::3] = torch.round(x[1::3])  # ties
    x[2::3, 0] += 40.0  # one token takes almost all the mass
    return x


def make_history(seed: int, n: int, vocab: int, length: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed + 1))


def rows_for(params: SamplingParams, history: torch.Tensor) -> list[SampleRow]:
    return [SampleRow(i, params, h, None) for i, h in enumerate(history.tolist())]


def assert_same_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))  # the cut masks, exactly
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite])


CASES = [  # (our params, transformers' processors in its own order)
    (dict(temperature=0.7), lambda: [TemperatureLogitsWarper(0.7)]),
    (dict(temperature=1.6), lambda: [TemperatureLogitsWarper(1.6)]),
    (dict(top_k=1), lambda: [TopKLogitsWarper(1)]),
    (dict(top_k=7), lambda: [TopKLogitsWarper(7)]),
    (dict(top_k=5000), lambda: [TopKLogitsWarper(5000)]),
    (dict(top_p=0.05), lambda: [TopPLogitsWarper(0.05)]),
    (dict(top_p=0.5), lambda: [TopPLogitsWarper(0.5)]),
    (dict(top_p=0.9), lambda: [TopPLogitsWarper(0.9)]),
    (dict(top_p=0.99), lambda: [TopPLogitsWarper(0.99)]),
    (dict(min_p=0.05), lambda: [MinPLogitsWarper(0.05)]),
    (dict(min_p=0.3), lambda: [MinPLogitsWarper(0.3)]),
    (dict(min_p=1.0), lambda: [MinPLogitsWarper(1.0)]),
    (dict(repetition_penalty=1.3), lambda: [RepetitionPenaltyLogitsProcessor(1.3)]),
    (dict(repetition_penalty=0.6), lambda: [RepetitionPenaltyLogitsProcessor(0.6)]),
    (
        dict(repetition_penalty=1.2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
        lambda: [
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(40),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ],
    ),
    (
        dict(repetition_penalty=1.5, temperature=1.3, top_k=10, top_p=0.6, min_p=0.2),
        lambda: [
            RepetitionPenaltyLogitsProcessor(1.5),
            TemperatureLogitsWarper(1.3),
            TopKLogitsWarper(10),
            TopPLogitsWarper(0.6),
            MinPLogitsWarper(0.2),
        ],
    ),
    (
        dict(temperature=0.5, top_p=0.95, min_p=0.1),
        lambda: [TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.95), MinPLogitsWarper(0.1)],
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_processed_logits_match_transformers(case):
    kwargs, processors = CASES[case]
    for seed in range(3):
        for vocab in (50, 257, 1000):
            logits, history = make_logits(seed, 6, vocab), make_history(seed, 6, vocab)
            ref = LogitsProcessorList(processors())(history, logits.clone())
            assert_same_logits(
                processed_logits(logits, rows_for(SamplingParams(**kwargs), history)), ref
            )


@pytest.mark.parametrize("native", [True, False])
def test_top_p_equals_transformers_and_sorts_only_the_rows_it_must(native, monkeypatch):
    """top_p_removed against transformers' TopPLogitsWarper, by ops.cpp's top_p_cut (native: rows
    on 8 threads, a vocabulary with a tail past its 8-wide pass) and by torch's shortlist (where the
    ops do not run); the full sort only for rows whose cut the two cannot settle."""
    from pagechat.core import sampler

    if native and not sampler.sampler_ops_take(torch.zeros(1, 8)):
        pytest.skip("ops.cpp's ops do not build here")
    if not native:
        monkeypatch.setattr(sampler, "sampler_ops_take", lambda x: False)
    sorted_rows = []
    by_sort = sampler._top_p_by_sort
    monkeypatch.setattr(
        sampler, "_top_p_by_sort", lambda x, t: sorted_rows.append(len(x)) or by_sort(x, t)
    )
    was = torch.get_num_threads()
    torch.set_num_threads(8)
    g = torch.Generator().manual_seed(0)
    vocab = sampler.TOP_P_SHORTLIST_VOCAB + 5
    peaked = (
        torch.randn(8, vocab, generator=g) * 6
    )  # a nucleus of a few tokens, as a trained model's
    flat = torch.randn(8, vocab, generator=g) * 0.3  # the nucleus reaches beyond the shortlist
    tied = torch.round(
        torch.randn(8, vocab, generator=g) * 6
    )  # many exactly equal logits at any cut
    top_k = TopKLogitsWarper(40)(None, peaked.clone())  # top-p after top-k: -inf logits
    edge = torch.full((1, vocab), -INF)
    edge[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()  # p = 0.5 and 0.8 cut exactly at a token
    try:
        for p in (0.5, 0.8, 0.9, 0.95, 0.99):
            # rows the full sort may decide: peaked ones only where a cut lies within TOP_P_MARGIN
            # of the limit (a 0.99 nucleus ends among tokens of ~1e-3: cuts near the limit are
            # common); flat ones all from the shortlist, where the cut lies beyond it, and the same
            # few as peaked ones natively
            wide = 2 if p < 0.99 else 8
            for x, most in (
                (peaked, wide),
                (top_k, wide),
                (flat, wide if native else 8),
                (tied, 8),
                (edge, 1 if p in (0.5, 0.8) else 0),
            ):
                sorted_rows.clear()
                ref = TopPLogitsWarper(p)(None, x.clone())
                assert torch.equal(sampler.top_p_removed(x, [p] * len(x)), torch.isneginf(ref)), p
                assert sum(sorted_rows) <= most, (p, sorted_rows)
                if x is edge or x is flat and not native:
                    assert sum(sorted_rows) == most, (p, sorted_rows)
        # a threshold within twice the margin (natively: every token not cut sorted), and a row
        # of one token
        lone = torch.full((1, vocab), -INF)
        lone[0, 7] = 0.0
        for x in (peaked, top_k, lone):
            ref = TopPLogitsWarper(0.99999)(None, x.clone())
            assert torch.equal(sampler.top_p_removed(x, [0.99999] * len(x)), torch.isneginf(ref))
        mixed = sampler.top_p_removed(peaked, [0.9, 1.0] * 4)  # top-p 1 is off
        assert not mixed[1::2].any()
        assert torch.equal(mixed[::2], torch.isneginf(TopPLogitsWarper(0.9)(None, peaked[::2])))
    finally:
        torch.set_num_threads(was)


def mixed_rows(vocab: int) -> list[SampleRow]:
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(top_p=0.8, repetition_penalty=0.8),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(top_p=0.5),  # a row of tied logits (see make_logits)
        SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.1),
    ]
    history = make_history(7, len(params), vocab, 15).tolist()
    return [SampleRow(i, p, h, None) for i, (p, h) in enumerate(zip(params, history))]


def test_mixed_batch_equals_rows_one_by_one():
    logits, rows = make_logits(3, 6, 300), mixed_rows(300)
    batch = processed_logits(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(batch[i], processed_logits(logits[i : i + 1], [row])[0])
    assert not torch.isinf(batch[0]).any()  # greedy row: penalised logits, unfiltered


def test_processed_logits_leaves_input_alone():
    logits, rows = make_logits(4, 6, 100), mixed_rows(100)
    before = logits.clone()
    processed_logits(logits, rows)
    target_probs(logits, rows)
    assert torch.equal(logits, before)


def test_target_probs_follow_processed_logits():
    logits, rows = make_logits(5, 6, 300), mixed_rows(300)
    probs, proc = target_probs(logits, rows), processed_logits(logits, rows)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)))
    for i, row in enumerate(rows):
        if row.params.greedy:
            assert probs[i].max() == 1 and (probs[i] > 0).sum() == 1
            assert probs[i].argmax() == proc[i].argmax()
        else:
            assert torch.equal(probs[i] == 0, torch.isneginf(proc[i]))


def seeded(params: SamplingParams, seed: int, seq_id: int = 0, history=()) -> SampleRow:
    return SampleRow(seq_id, params, list(history), make_generator(seed))


def run_steps(rows_factory, steps: int = 30) -> list[list[int]]:
    sampler, rows, out = Sampler(str), rows_factory(), []
    for step in range(steps):
        # Row 0's logits do not depend on the batch size (randn's stream does).
        mates = make_logits(500 + step, len(rows), 200)[1:]
        tokens, _ = sampler.sample(torch.cat([make_logits(100 + step, 1, 200), mates]), rows)
        out.append(tokens)
    return out


def test_seed_repeats_and_ignores_batch_mates():
    params = SamplingParams(temperature=1.3, top_p=0.95)
    alone = run_steps(lambda: [seeded(params, 42)])
    again = run_steps(lambda: [seeded(params, 42)])
    assert alone == again
    # Same row next to others (one seeded, one on the global RNG) draws the same tokens.
    with_mates = run_steps(
        lambda: [
            seeded(params, 42),
            seeded(SamplingParams(top_k=3), 7, 1),
            SampleRow(2, SamplingParams(min_p=0.1), [], None),
        ]
    )
    assert [t[0] for t in with_mates] == [t[0] for t in alone]
    assert run_steps(lambda: [seeded(params, 43)]) != alone


def test_draws_match_target_probs():
    vocab, draws = 20, 20_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 1.5
    row = seeded(SamplingParams(top_p=0.9, num_candidates=0), 123)
    target = target_probs(logits, [row])[0]
    tokens, records = Sampler(str).sample(logits.expand(draws, vocab), [row] * draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
    assert counts[target == 0].sum() == 0  # never a token top-p cut
    assert (target == 0).sum() > 0
    tv = 0.5 * (counts / draws - target).abs().sum().item()
    assert tv < 0.02, tv  # expected ~0.01 at 20k draws
    assert all(r.candidates == () for r in records)


def test_greedy_takes_penalised_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.5]])
    row = SampleRow(0, SamplingParams(temperature=0.0, repetition_penalty=2.0), [1], None)
    tokens, (rec,) = Sampler(str).sample(logits, [row])
    assert tokens == [2]  # 3.0 / 2 = 1.5 < 2.9
    assert [c.token_id for c in rec.candidates] == [2, 1, 0, 3]
    assert [c.kept for c in rec.candidates] == [True, False, False, False]
    assert all(c.cut_by is None for c in rec.candidates)
    assert rec.candidates[0].chosen and rec.candidates[1].logit == 1.5
    probs = torch.softmax(torch.tensor([1.0, 1.5, 2.9, 0.5]), -1)  # T = 1 for greedy
    assert [c.prob for c in rec.candidates] == pytest.approx(probs[[2, 1, 0, 3]].tolist())


def test_cut_by_on_hand_made_example():
    # softmax([5,4,3]) = .665 .245 .090: top-p 0.8 drops the 3 (ascending cum .090 <= 0.2);
    # softmax([5,4]) = .731 .269: min-p 0.5 drops the 4 (.269 < .5 * .731).
    logits = torch.tensor([[2.0, 4.0, 1.0, 5.0, 3.0]])
    params = SamplingParams(top_k=3, top_p=0.8, min_p=0.5, num_candidates=5)
    tokens, (rec,) = Sampler(lambda t: f"<{t}>").sample(logits, [seeded(params, 0, 5)])
    assert tokens == [3] and rec.seq_id == 5 and rec.token_id == 3
    assert [c.token_id for c in rec.candidates] == [3, 1, 4, 0, 2]
    assert [c.text for c in rec.candidates] == ["<3>", "<1>", "<4>", "<0>", "<2>"]
    assert [c.cut_by for c in rec.candidates] == [None, "min-p", "top-p", "top-k", "top-k"]
    assert [c.kept for c in rec.candidates] == [True, False, False, False, False]
    assert [c.chosen for c in rec.candidates] == [True, False, False, False, False]
    assert rec.candidates[-1].cum_prob == pytest.approx(1.0)
    assert rec.params is params  # frozen, so the record needs no copy of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.top_k = 1  # type: ignore[misc]


def greedy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=0.0, repetition_penalty=params.repetition_penalty)


def test_records_on_random_rows():
    vocab = 500
    logits, rows = make_logits(11, 6, vocab), mixed_rows(vocab)
    for r in rows:
        r.generator = make_generator(r.seq_id)
    tokens, records = Sampler(str).sample(logits, rows)
    # Greedy rows' processed logits are just the penalised ones.
    as_greedy = [SampleRow(r.seq_id, greedy(r.params), r.history, None) for r in rows]
    pen = processed_logits(logits, as_greedy)
    proc = processed_logits(logits, rows)
    for i, (row, token, rec) in enumerate(zip(rows, tokens, records)):
        cands, temp = rec.candidates, row.params.temperature or 1.0
        assert rec.token_id == token and rec.seq_id == row.seq_id
        assert len(cands) in (8, 9) and (len(cands) == 8) == (
            token in pen[i].topk(8).indices.tolist()
        )
        assert (
            sum(c.chosen for c in cands) == 1
            and next(c for c in cands if c.chosen).token_id == token
        )
        logits_seen = [c.logit for c in cands]
        assert logits_seen == sorted(logits_seen, reverse=True)
        assert logits_seen == pytest.approx(pen[i, [c.token_id for c in cands]].tolist())
        probs = torch.softmax(pen[i] / temp, -1)[[c.token_id for c in cands]]
        assert [c.prob for c in cands] == pytest.approx(probs.tolist(), rel=1e-4, abs=1e-7)
        cum = [c.cum_prob for c in cands]
        assert cum == sorted(cum) and cum == pytest.approx(
            torch.cumsum(probs, 0).tolist(), rel=1e-4
        )
        if not row.params.greedy:
            assert [c.kept for c in cands] == [bool(proc[i, c.token_id] > -INF) for c in cands]
            assert all((c.cut_by is None) == c.kept for c in cands)


def test_chosen_outside_top_n_is_appended_and_zero_candidates_is_empty():
    logits = torch.linspace(1.0, 0.8, 50).unsqueeze(
        0
    )  # nearly flat: draws rarely hit the top token
    sampler, row = Sampler(str), seeded(SamplingParams(num_candidates=1), 3)
    _, (rec,) = sampler.sample(logits, [row])
    assert rec.token_id != 0 and len(rec.candidates) == 2
    top, chosen = rec.candidates
    assert (
        top.token_id == 0 and not top.chosen and chosen.chosen and chosen.token_id == rec.token_id
    )
    assert chosen.cum_prob == pytest.approx(top.prob + chosen.prob)
    none = SampleRow(1, SamplingParams(num_candidates=0), [], None)
    _, recs = sampler.sample(
        logits.expand(2, 50), [none, seeded(SamplingParams(num_candidates=3), 3)]
    )
    assert recs[0].candidates == () and len(recs[1].candidates) in (3, 4)


def test_empty_batch():
    assert Sampler(str).sample(torch.zeros(0, 10), []) == ([], [])


def test_token_texts_are_cached():
    calls = []
    sampler = Sampler(lambda t: calls.append(t) or str(t))
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    for _ in range(3):
        sampler.sample(logits, [SampleRow(0, SamplingParams(temperature=0.0), [], None)])
    assert sorted(calls) == [0, 1, 2]  # each text decoded once


def test_draw_from_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(4000, 5)
    g = make_generator(1)
    tokens = draw_from(probs, [g] * 4000)
    assert set(tokens.tolist()) == {1, 3} and abs((tokens == 3).float().mean().item() - 0.75) < 0.03
    torch.manual_seed(5)  # rows without a generator use torch's global RNG
    first = draw_from(probs[:50], [None] * 50)
    torch.manual_seed(5)
    assert torch.equal(first, draw_from(probs[:50], [None] * 50))


@pytest.mark.parametrize("rows,vocab", [(1, 49152 + 3), (3, 8192 + 5), (2, 11)])
def test_draw_softmax_is_draw_from_of_the_softmax(rows, vocab, monkeypatch):
    """draw_softmax (ops.cpp's softmax_draw where it builds) picks what draw_from picks from
    softmax(x) on the same uniforms: random rows with cut (-inf) ids, rows cut into a part a
    thread (8 threads), a uniform that rounds up to the sum; a cut id is never drawn."""
    was = torch.get_num_threads()
    torch.set_num_threads(8)
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, ::3] = float("-inf")
    x[:, -2:] = float("-inf")  # the last ids weigh nothing: a round-up lands before them
    try:
        for seed in range(40):
            a = draw_softmax(x, [make_generator(seed)] * rows)
            b = draw_from(x.softmax(dim=-1), [make_generator(seed)] * rows)
            assert torch.equal(a, b)
            assert torch.isfinite(x.gather(1, a[:, None])).all()
        ones = [make_generator(0)] * rows
        top = lambda *shape, **_: torch.full(shape[:2], 1 - 2**-53, dtype=torch.float64)  # noqa: E731
        monkeypatch.setattr(torch, "rand", top)
        assert torch.equal(draw_softmax(x, ones), draw_from(x.softmax(dim=-1), ones))
    finally:
        torch.set_num_threads(was)
