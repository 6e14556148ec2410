"""Speculative decoding: exact greedy output, the target's distribution when sampling, honest
bookkeeping."""

from __future__ import annotations

import pytest
import torch
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.core.spec import ngram_propose, verify
from pagechat.tools.make_model import make_model, save_tokenizer, train_tokenizer

PROMPTS = [
    "Hi",
    "The KV cache keeps keys and values of every token, block by block.",
    "one two three one two three one two",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different random llama of the same tokenizer: it disagrees with the target often."""
    return make_model(tmp_path_factory.mktemp("draft") / "d", "llama", "tiny", seed=7)


def engine(path, **kw) -> Engine:
    return Engine(path, EngineConfig(device="cpu", dtype="float32", block_size=4, **kw))


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama):
    return [s.output_ids for s in engine(tiny_llama).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("proposer", [None, "ngram", "draft"])
def test_verification_and_catch_up_graphs_are_traced_at_load(proposer, tiny_llama, draft_dir):
    """With a proposer, the causal-mask trace (verification; a draft's catch-up) is made while
    loading, not in the
    first reply."""
    kw = (
        {}
        if proposer is None
        else {"ngram": True}
        if proposer == "ngram"
        else {"draft": str(draft_dir)}
    )
    eng = engine(tiny_llama, **kw)
    # (every sequence computes one token, the masked windows...)
    decode, causal = (True,), (False, None)
    assert set(eng.runner.graphs.traces) == ({decode} if proposer is None else {decode, causal})
    if proposer == "draft":
        assert set(eng.proposer.runner.graphs.traces) == {decode, causal}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["ngram", "draft", "self"])
def test_greedy_equals_plain(proposer, k, tiny_llama, draft_dir, plain_outputs):
    kw = (
        {"ngram": True}
        if proposer == "ngram"
        else {"draft": str(draft_dir if proposer == "draft" else tiny_llama)}
    )
    eng = engine(tiny_llama, num_draft=k, **kw)
    records = []
    for prompt, want in zip(PROMPTS, plain_outputs):  # single requests
        [seq] = eng.generate([prompt], GREEDY, on_report=lambda r: records.extend(r.drafts))
        assert seq.output_ids == want
    seqs = eng.generate(
        PROMPTS, GREEDY, on_report=lambda r: records.extend(r.drafts)
    )  # one continuous batch
    assert [s.output_ids for s in seqs] == plain_outputs
    assert records and all(len(r.drafted) <= k for r in records)
    if proposer == "self":  # the target drafting for itself: every greedy draft is accepted
        assert all(r.accepted == len(r.drafted) for r in records)
    assert eng.block_map.snapshot().num_used == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_equals_plain_under_preemption(proposer, tiny_llama, draft_dir, plain_outputs):
    kw = {"ngram": True} if proposer == "ngram" else {"draft": str(draft_dir)}
    eng = engine(tiny_llama, num_draft=3, kv_blocks=24, **kw)
    preempted = []
    seqs = eng.generate(PROMPTS, GREEDY, on_report=lambda r: preempted.extend(r.preempted))
    assert preempted and [s.output_ids for s in seqs] == plain_outputs


def test_bookkeeping_matches_recount(tiny_llama, draft_dir):
    eng = engine(tiny_llama, draft=str(draft_dir), num_draft=4)
    records = []
    seqs = eng.generate(
        PROMPTS,
        SamplingParams(temperature=1.0, max_tokens=30, seed=3, ignore_eos=True),
        on_report=lambda r: records.extend(r.drafts),
    )
    for seq in seqs:
        mine = [r for r in records if r.seq_id == seq.seq_id]
        assert seq.spec.drafted == sum(len(r.drafted) for r in mine)
        assert seq.spec.accepted == sum(r.accepted for r in mine)
        assert mine[-1].totals == seq.spec
        drafted = [r for r in mine if r.drafted]
        width = max((len(r.drafted) for r in mine), default=0)
        assert seq.spec.tried == tuple(sum(len(r.drafted) > i for r in mine) for i in range(width))
        assert seq.spec.hits == tuple(sum(r.accepted > i for r in mine) for i in range(width))
        assert seq.spec.drafting_steps == len(drafted) and seq.spec.steps == len(mine)
        assert seq.spec.emitted == sum(len(r.emitted) for r in mine)
        for (
            r
        ) in mine:  # the emitted tokens are the accepted prefix of the draft, then one target token
            assert list(r.emitted[: r.accepted]) == list(r.drafted[: r.accepted])
            assert len(r.emitted) <= r.accepted + 1
        emitted = [t for r in mine for t in r.emitted]
        assert emitted == seq.output_ids[len(seq.output_ids) - len(emitted) :]
    # the target's KV never keeps a rejected token: pool free after the run, draft cache too
    draft_blocks = eng.proposer.blocks
    assert eng.block_map.snapshot().num_used == 0
    assert draft_blocks.num_free_blocks() == draft_blocks.num_blocks  # the draft's KV too


def test_rollback_leaves_no_stale_slots(tiny_llama, draft_dir):
    eng = engine(tiny_llama, draft=str(draft_dir), num_draft=5)
    rid = eng.requests.add(
        "The KV cache keeps", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    seq = eng.requests[rid]
    while not seq.finished:
        report = eng.step()
        if not seq.finished:
            assert eng.blocks.length(rid) == seq.num_computed == len(seq.token_ids) - 1
            assert report.blocks.tokens_stored == seq.num_computed


def test_verify_keeps_target_distribution():
    """The rejection-sampling theorem, checked numerically: emitted token ~ p whatever q is."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0], [1 / 6] * 6])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.3, 0.3]])
    n = 15000
    counts = torch.zeros(6)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        accepted, nxt = verify(p, q, [d], greedy=False, generator=gen)
        counts[d if accepted else nxt] += 1
    expected = p[0] * n
    mask = expected > 0
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    assert chi2 < 20.5  # df 4, p = 0.0004
    assert counts[5] == 0  # a token the target gives zero probability never appears


def test_verify_one_hot_draft():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    n, counts = 20000, torch.zeros(3)
    for _ in range(n):
        accepted, nxt = verify(p, None, [1], greedy=False, generator=gen)
        counts[1 if accepted else nxt] += 1
    torch.testing.assert_close(counts / n, p[0], atol=0.015, rtol=0)


def test_sampled_distribution_with_speculation_equals_plain(tiny_llama, draft_dir):
    """Many seeds at temperature 1 / top-p 0.9: token histograms at draft positions agree
    (chi-square)."""
    prompts = ["one two three"] * 300

    def tokens(**kw):
        eng = engine(tiny_llama, max_seqs=100, **kw)
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, seed=i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        return [s.output_ids[1:3] for s in eng.generate(prompts, params)]

    plain, spec = tokens(), tokens(draft=str(draft_dir), num_draft=2)
    for pos in range(2):
        a = [t[pos] for t in plain]
        b = [t[pos] for t in spec]
        top = [
            t
            for t, _ in sorted(
                ((t, a.count(t) + b.count(t)) for t in set(a + b)), key=lambda x: -x[1]
            )[:5]
        ]
        ca, cb = _bucket(a, top), _bucket(b, top)
        chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(ca, cb) if x + y)
        assert chi2 < 22.5, (ca, cb)  # two-sample chi-square, df <= 5, p = 0.0004


def test_ngram_lookup():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert ngram_propose([5, 6, 7, 5], 2) == [6, 7]
    assert ngram_propose([1, 2, 3], 4) == []


def test_ngram_needs_fewer_target_forwards_on_repetition(tiny_llama):
    text = "alpha beta gamma delta " * 6

    def forwards(**kw):
        eng = engine(tiny_llama, **kw)
        [seq] = eng.generate(
            [text], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        )
        return seq.target_forwards / seq.num_output_tokens, seq.output_ids

    plain, out_plain = forwards()
    spec, out_spec = forwards(ngram=True, num_draft=5)
    assert out_plain == out_spec
    assert plain > 0.9 and spec < plain


def test_nothing_is_drafted_past_an_end_of_sequence(tiny_llama):
    """A drafted EOS ends the draft (whatever followed could never be kept); with ignore_eos it
    does not."""
    eng = engine(tiny_llama, ngram=True, num_draft=4)
    eos = min(eng.requests.eos_ids)
    eng.proposer.propose = lambda seqs, ks: ([[eos, 8, 9, 10][:k] for k in ks], [None] * len(seqs))
    for ignore, expected in ((False, (eos,)), (True, (eos, 8, 9, 10))):
        records = []
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=ignore)
        eng.generate([[5, 6, 7]], params, on_report=_collect_drafts(records))
        assert records and records[0].drafted == expected
        assert all(
            d.drafted == expected[: len(d.drafted)] for d in records
        )  # later ones capped by max_tokens


def test_draft_with_other_tokenizer_is_refused(tiny_llama, tmp_path):
    other = tmp_path / "other"
    make_model(other, "llama", "tiny")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (other / f).unlink()
    save_tokenizer(
        train_tokenizer(["a different corpus gives a different vocabulary"] * 50, 300), other
    )
    with pytest.raises(PagechatError, match="differs from the target's"):
        engine(tiny_llama, draft=str(other))


def test_speculation_toggles_between_steps(tiny_llama):
    eng = engine(tiny_llama, ngram=True, num_draft=2)
    rid = eng.requests.add("a b a b a b a b", GREEDY)
    eng.step()
    eng.set_speculation(False)
    assert not eng.step().drafts
    eng.set_speculation(True, 4)
    while not eng.requests[rid].finished:
        assert all(len(r.drafted) <= 4 for r in eng.step().drafts)


def test_generate_json_reports_speculation(tiny_llama, capsys):
    import json

    from conftest import cli

    code, out, err = cli(
        [
            "generate",
            str(tiny_llama),
            "-p",
            "a b c a b c a b",
            "--ngram",
            "--num-draft",
            "3",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    st = json.loads(out)["stats"]
    assert st["proposer"] == "ngram" and st["num_draft"] == 3
    assert (
        0 <= st["accepted_tokens"] <= st["drafted_tokens"]
        and len(st["per_position_acceptance"]) <= 3
    )
    assert st["mean_acceptance_length"] >= 1 or st["drafted_tokens"] == 0


def _bucket(xs: list[int], top: list[int]) -> list[int]:
    """Counts of each of the top tokens in xs, then of every other token."""
    return [sum(x == t for x in xs) for t in top] + [sum(x not in top for x in xs)]


def _collect_drafts(records: list):
    """An on_report hook that keeps the non-empty DraftRecords of each step."""
    return lambda r: records.extend(d for d in r.drafts if d.drafted)
