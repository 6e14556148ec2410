"""The scheduler's own records in each StepReport: every sequence (what it is, its state, tokens,
blocks held and shared, preemptions) and the batch each step ran, checked against the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams

PROMPTS = [list(range(5 + i, 17 + 2 * i)) for i in range(6)]  # 12..22 tokens
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine_of(model, **config) -> Engine:
    return Engine(model, EngineConfig(device="cpu", dtype="float32", block_size=4, **config))


def run(engine: Engine, prompts, params) -> list:
    reports = []
    engine.generate(prompts, params, on_report=reports.append)
    return reports


def test_each_step_lists_every_live_sequence_with_the_block_maps_counts(tiny_llama):
    engine = engine_of(tiny_llama, max_batch_tokens=16)
    engine.requests.add(PROMPTS[0], LONG)
    engine.requests.add(PROMPTS[5], LONG)
    while engine.has_unfinished():
        report = engine.step()
        live = {s.seq_id for s in report.seqs if s.state != "finished"}
        sched = engine.scheduler
        assert live == {s.seq_id for s in [*sched.running, *sched.waiting, *sched.swapped]}
        snap = report.blocks
        for rec in report.seqs:
            seq = engine.requests[rec.seq_id]
            held = [b for b in snap.blocks if rec.seq_id in b.owners]
            assert rec.blocks == len(held)
            assert rec.shared == sum(b.ref_count > 1 for b in held)
            assert rec.output_tokens == seq.num_output_tokens and rec.computed == seq.num_computed
            assert (rec.role, rec.index, rec.request_id) == ("request", 0, rec.seq_id)
        # the batch: chunks within the budget, their tokens the step's counted work
        assert sum(b.tokens + b.reserved for b in report.batch) <= report.token_budget == 16
        prefill = sum(b.tokens for b in report.batch if b.kind == "prefill")
        assert prefill == report.prefill_tokens
        assert sum(b.tokens for b in report.batch if b.kind == "decode") == report.decode_tokens
    assert [s.state for s in report.seqs] == ["finished"]


def test_a_chunked_prompt_is_recorded_chunk_by_chunk(tiny_llama):
    engine = engine_of(tiny_llama, max_batch_tokens=8)
    reports = run(engine, [list(range(5, 27))], replace(LONG, max_tokens=2))
    chunks = [(b.start, b.tokens, b.total) for r in reports for b in r.batch if b.kind == "prefill"]
    assert chunks == [(0, 8, 22), (8, 8, 22), (16, 6, 22)]
    assert [(b.kind, b.start, b.total) for b in reports[-1].batch] == [("decode", 22, 23)]


def test_samples_are_named_and_share_the_prompts_blocks(tiny_llama):
    engine = engine_of(tiny_llama)
    params = SamplingParams(temperature=1.0, n=4, seed=2, max_tokens=6, ignore_eos=True)
    reports = run(engine, [PROMPTS[3]], params)
    forked = next(r for r in reports if len(r.seqs) == 4)
    assert [(s.role, s.index) for s in forked.seqs] == [("sample", k) for k in range(4)]
    assert {s.request_id for s in forked.seqs} == {forked.seqs[0].seq_id}
    assert all(s.shared == s.blocks > 0 for s in forked.seqs)  # forks share every block
    ended = [s for r in reports for s in r.seqs if s.state == "finished"]
    assert sorted(s.index for s in ended) == [0, 1, 2, 3]
    assert {s.finish_reason for s in ended} == {"length"}


def test_beams_are_ranked_and_dropped_beams_are_left_out(tiny_llama):
    engine = engine_of(tiny_llama)
    params = SamplingParams(beam_width=3, max_tokens=6, ignore_eos=True)
    reports = run(engine, [PROMPTS[2]], params)
    mid = reports[3]
    assert [(s.role, s.index) for s in mid.seqs] == [("beam", k) for k in range(3)]
    ended = [s for r in reports for s in r.seqs if s.state == "finished"]
    assert [(s.seq_id, s.role) for s in ended] == [(0, "request")]  # only the search's request


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preempted_and_swapped_sequences_say_so(preempt, tiny_llama):
    engine = engine_of(tiny_llama, kv_blocks=24, preempt=preempt)
    reports = run(engine, PROMPTS, LONG)
    states = {s.state for r in reports for s in r.seqs}
    assert ("swapped" if preempt == "swap" else "preempted") in states
    preempted = {i for r in reports for i in r.preempted}
    last = {s.seq_id: s for r in reports for s in r.seqs}
    assert {i for i, s in last.items() if s.preemptions} == preempted
    assert all(s.state == "finished" and s.blocks == 0 for s in last.values())
