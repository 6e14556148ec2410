"""Beam search against transformers' generate(num_beams=B, do_sample=False): the same beams in
the same order and the same scores, for every architecture, also when the pool is so small that
beams are preempted; and beams share their blocks."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from transformers import AutoModelForCausalLM

PROMPT = "The KV cache keeps keys and values"
NEW = 10
# (beams, length penalty, early stopping)
SETTINGS = [(4, 1.0, False), (3, 0.5, True), (2, 2.0, "never")]


def hf_beams(hf, ids, eos, width, penalty, early, new=NEW):
    """transformers' beams for ids: [(generated tokens, score)], best first."""
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        num_beams=width,
        do_sample=False,
        num_return_sequences=width,
        max_new_tokens=new,
        length_penalty=penalty,
        early_stopping=early,
        eos_token_id=sorted(eos),
        pad_token_id=min(eos),
        output_scores=True,
        return_dict_in_generate=True,
    )
    return [
        (row[len(ids) :].tolist(), score.item())
        for row, score in zip(out.sequences, out.sequences_scores)
    ]


def assert_same(seq, expected, pad):
    assert len(seq.beams) == len(expected)
    for beam, (tokens, score) in zip(seq.beams, expected):
        n = len(beam.token_ids)
        # transformers pads a beam that ended early (pad_token_id: the smallest end id)
        assert list(beam.token_ids) == tokens[:n] and set(tokens[n:]) <= {pad}
        assert beam.score == pytest.approx(score, abs=1e-4)
    assert seq.output_ids == list(seq.beams[0].token_ids)


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for arch, path in tiny_models.items()
    }


def engine(path, **cfg):
    return Engine(path, EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", **cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_equal_transformers(arch, tiny_models, hf_models):
    eng = engine(tiny_models[arch])
    ids = eng.tokenizer(PROMPT).input_ids
    for width, penalty, early in SETTINGS:
        params = SamplingParams(
            temperature=0, max_tokens=NEW, beam_width=width, length_penalty=penalty,
            early_stopping=early,
        )  # fmt: skip
        [seq] = eng.generate([ids], params)
        assert_same(
            seq,
            hf_beams(hf_models[arch], ids, eng.requests.eos_ids, width, penalty, early),
            min(eng.requests.eos_ids),
        )
    assert eng.block_map.snapshot().num_used == 0


@pytest.mark.parametrize("early", [False, True, "never"])
def test_beams_that_end_early_equal_transformers(early, tiny_llama, hf_models):
    """With a likely token as the end of sequence, hypotheses finish at different lengths."""
    eng = engine(tiny_llama)
    ids = eng.tokenizer(PROMPT).input_ids
    [greedy] = eng.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.requests.eos_ids = frozenset(greedy.output_ids[1:3])  # tokens the model is about to pick
    params = SamplingParams(temperature=0, max_tokens=NEW, beam_width=3, early_stopping=early)
    [seq] = eng.generate([ids], params)
    expected = hf_beams(hf_models["llama"], ids, eng.requests.eos_ids, 3, 1.0, early)
    assert any(len(b.token_ids) < NEW for b in seq.beams)
    assert_same(seq, expected, min(eng.requests.eos_ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_in_a_tight_pool_are_preempted_and_still_equal(arch, tiny_models, hf_models):
    eng = engine(tiny_models[arch], block_size=4, kv_blocks=8, max_batch_tokens=16)
    ids = eng.tokenizer(PROMPT).input_ids
    preempted = []
    params = SamplingParams(temperature=0, max_tokens=NEW, beam_width=4)
    [seq] = eng.generate([ids], params, on_report=lambda r: preempted.extend(r.preempted))
    assert preempted  # 4 beams of ~20 tokens do not fit 8 blocks of 4 at once
    assert_same(
        seq,
        hf_beams(hf_models[arch], ids, eng.requests.eos_ids, 4, 1.0, False),
        min(eng.requests.eos_ids),
    )
    assert eng.block_map.snapshot().num_used == 0


def test_beams_share_blocks_and_keep_other_requests_exact(tiny_llama):
    eng = engine(tiny_llama, block_size=4)
    ids = eng.tokenizer(PROMPT).input_ids
    shared = []
    beam = SamplingParams(temperature=0, max_tokens=NEW, beam_width=4)
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    seqs = eng.generate(
        [ids, ids[:5]], [beam, plain], on_report=lambda r: shared.append(r.blocks.num_shared)
    )
    assert max(shared) >= len(ids) // 4  # the prompt's full blocks are held by every beam
    [alone] = engine(tiny_llama).generate([ids[:5]], plain)
    assert seqs[1].output_ids == alone.output_ids
    assert len(seqs[0].beams) == 4


def test_beam_settings_are_checked():
    from pagechat.core.errors import PagechatError

    with pytest.raises(PagechatError, match="beams must be >= 1, got 0"):
        SamplingParams(beam_width=0).validate()
    with pytest.raises(PagechatError, match="early-stopping must be true, false or never"):
        SamplingParams(beam_width=2, early_stopping="sometimes").validate()
    with pytest.raises(PagechatError, match="beams cannot be combined with n > 1"):
        SamplingParams(beam_width=2, n=2).validate()
