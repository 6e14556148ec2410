"""The engine vs transformers: same checkpoint, fp32, greedy tokens equal and prefill logits close.

Every scenario that changes how the engine computes (continuous batch, 7-token prefill chunks, a
pool so small that sequences are preempted, a prefix served from the cache) must still produce
transformers' tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.core.scheduler import ScheduledSeq
from pagechat.core.sequence import Sequence
from transformers import AutoModelForCausalLM

NEW_TOKENS = 32
PROMPTS = [
    "Hi",
    "The KV cache keeps keys and values of every token, block by block.",
    "Continuous batching lets new requests join the running batch at the next step, while long "
    "prompts are prefilled in chunks so that decoding sequences are not starved; preemption frees "
    "blocks when they run out.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def fp32(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", **kw)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """arch -> (hf model, prompt ids, greedy continuations from transformers' generate)."""
    out = {}
    for arch, path in tiny_models.items():
        hf = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        ).eval()
        engine = Engine(path, fp32())
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
        out[arch] = (hf, prompts, [hf_greedy(hf, ids) for ids in prompts])
    return out


def run(path, prompts, **cfg):
    engine = Engine(path, fp32(**cfg))
    seqs = engine.generate(prompts, GREEDY)
    return engine, [s.output_ids for s in seqs]


@pytest.mark.parametrize("arch", ARCHS)
def test_single_requests_match(arch, tiny_models, reference):
    _, prompts, conts = reference[arch]
    for ids, expected in zip(prompts, conts):
        assert run(tiny_models[arch], [ids])[1] == [expected]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match(arch, tiny_models, reference):
    hf, prompts, _ = reference[arch]
    engine = Engine(tiny_models[arch], fp32(max_batch_tokens=7))
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        seq = Sequence(100 + i, list(ids), len(ids), GREEDY, 0.0)
        engine.blocks.allocate(seq.seq_id, ids)
        got = []
        for start in range(
            0, len(ids), 7
        ):  # the engine's 7-token chunks, each reading earlier chunks' KV
            item = ScheduledSeq(seq, start, min(7, len(ids) - start))
            got.append(engine.runner.run([item], [item.count]))
        torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=0)
        engine.blocks.free(seq.seq_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_16_bit_kv_cache_stays_close(arch, tiny_models, reference):
    """The default KV cache of a float32 model on a CPU is float16 (half the bytes of the pool):
    chunked prefill logits, each chunk reading the earlier chunks' KV back from 16 bits, stay
    within 5e-3 of transformers' float32 ones (seen: 1e-3; float32 KV: 1e-4)."""
    hf, prompts, _ = reference[arch]
    engine = Engine(tiny_models[arch], EngineConfig(device="cpu", dtype="float32", kv_blocks=32))
    assert engine.pool.dtype == torch.float16 and engine.dtype == torch.float32
    full = Engine(tiny_models[arch], fp32(kv_blocks=32))
    assert engine.pool.nbytes * 2 == full.pool.nbytes
    ids = prompts[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    seq = Sequence(100, list(ids), len(ids), GREEDY, 0.0)
    engine.blocks.allocate(seq.seq_id, ids)
    got = []
    for start in range(0, len(ids), 5):
        item = ScheduledSeq(seq, start, min(5, len(ids) - start))
        got.append(engine.runner.run([item], [item.count]))
    torch.testing.assert_close(torch.cat(got), want, atol=5e-3, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_continuous_batch_matches(arch, tiny_models, reference):
    _, prompts, conts = reference[arch]
    assert run(tiny_models[arch], prompts)[1] == conts


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches(arch, tiny_models, reference):
    _, prompts, conts = reference[arch]
    engine, outs = run(tiny_models[arch], prompts, max_batch_tokens=7)
    assert outs == conts


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches(arch, tiny_models, reference):
    _, prompts, conts = reference[arch]
    engine = Engine(tiny_models[arch], fp32(block_size=4, kv_blocks=32))
    preempted = []
    seqs = engine.generate(prompts, GREEDY, on_report=lambda r: preempted.extend(r.preempted))
    assert preempted, "the pool was meant to be too small for all three at once"
    assert [s.output_ids for s in seqs] == conts
    assert engine.block_map.snapshot().num_used == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_matches(arch, tiny_models, reference):
    hf, prompts, _ = reference[arch]
    engine = Engine(tiny_models[arch], fp32(block_size=4))
    long_ids = prompts[2]
    engine.generate([long_ids], GREEDY)
    shared = long_ids[:40] + prompts[1]  # repeats the first 40 tokens of the finished request
    hits = []
    [seq] = engine.generate([shared], GREEDY, on_report=lambda r: hits.append(r.prefix_hit_tokens))
    assert sum(hits) == seq.num_cached_tokens > 0
    assert seq.output_ids == hf_greedy(hf, shared)


@pytest.mark.parametrize("arch", ARCHS)
def test_next_turn_resumes_from_the_partial_tail(arch, tiny_models, reference):
    """A chat's next turn extends the finished turn's tokens: every token with KV is a hit, the
    partly filled last block included, and the reply is still transformers'."""
    hf, prompts, conts = reference[arch]
    engine = Engine(tiny_models[arch], fp32(block_size=16))
    [first] = engine.generate([prompts[1]], GREEDY)
    assert first.num_computed % 16, "the turn was meant to end inside a block"
    turn2 = prompts[1] + first.output_ids + prompts[0]
    [seq] = engine.generate([turn2], GREEDY)
    assert seq.num_cached_tokens == first.num_computed == len(prompts[1]) + NEW_TOKENS - 1
    assert seq.output_ids == hf_greedy(hf, turn2)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_float_lm_head_matches(arch, tiny_models, reference):
    """--lm-head float keeps the head (and a tied embedding) as the checkpoint has it."""
    _, prompts, conts = reference[arch]
    engine, got = run(tiny_models[arch], prompts, lm_head="float")
    head = engine.model.lm_head  # a plain linear (pagechat's float kernel runs it where it builds)
    assert isinstance(head, torch.nn.Linear) and head.weight.dtype == torch.float32
    assert got == conts


def hf_greedy(hf, ids: list[int]) -> list[int]:
    """transformers' greedy continuation of NEW_TOKENS tokens."""
    gen = copy.deepcopy(hf.generation_config)
    gen.eos_token_id = None  # like --ignore-eos: always NEW_TOKENS tokens
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            generation_config=gen,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()
