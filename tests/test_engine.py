"""Engine behaviour beyond matching transformers: seeds, live parameter updates, abort, stops,
failures."""

from __future__ import annotations

import pytest
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4))


def sampled(seed: int | None, n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=n, seed=seed, ignore_eos=True)


def test_fixed_seed_gives_same_tokens_twice(engine):
    a = engine.generate(["The block table"], sampled(7))[0].output_ids
    b = engine.generate(["The block table"], sampled(7))[0].output_ids
    c = engine.generate(["The block table"], sampled(8))[0].output_ids
    assert a == b and a != c


def test_seeded_request_ignores_batch_mates(engine):
    alone = engine.generate(["Sampling"], sampled(3))[0].output_ids
    together = engine.generate(
        ["Sampling", "Other prompt here", "x"], [sampled(3), sampled(None), sampled(None)]
    )
    assert together[0].output_ids == alone


def test_update_params_applies_from_next_token(engine):
    rid = engine.requests.add("Decode", sampled(5, n=30))
    seq = engine.requests[rid]
    while seq.num_output_tokens < 3:
        engine.step()
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.requests.update_params(rid, greedy)
    seen = []
    while not seq.finished:
        seen += [r.params.temperature for r in engine.step().samples if r.seq_id == rid]
    assert seen and all(t == 0.0 for t in seen)
    assert seq.num_output_tokens == 30


def test_update_params_rejects_bad_values(engine):
    rid = engine.requests.add("x", sampled(1, n=2))
    with pytest.raises(PagechatError, match="top-p"):
        engine.requests.update_params(rid, SamplingParams(top_p=2.0))
    engine.requests.abort(rid)


def test_abort_keeps_output_and_frees_blocks(engine):
    rid = engine.requests.add("Abort me", sampled(1, n=100))
    seq = engine.requests[rid]
    while seq.num_output_tokens < 5:
        engine.step()
    engine.requests.abort(rid)
    assert seq.finish_reason == "abort" and seq.num_output_tokens == 5
    assert engine.block_map.snapshot().num_used == 0 and not engine.has_unfinished()


def test_stop_string_cuts_text(engine):
    free = engine.generate(
        ["Stop"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )[0]
    stop = free.text[5:8]
    assert stop.strip(), free.text
    [seq] = engine.generate(
        ["Stop"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,))
    )
    assert seq.finish_reason == "stop" and stop not in seq.text and free.text.startswith(seq.text)


def test_streamed_deltas_add_up_to_text(engine):
    rid = engine.requests.add(
        "Stream", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    assert "".join(engine.stream(rid)) == engine.requests[rid].text


def test_request_larger_than_pool_fails_alone(tiny_llama):
    engine = Engine(
        tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4, kv_blocks=6)
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = engine.requests.add(list(range(5, 35)), params)  # 30 prompt tokens > 24 slots
    small = engine.requests.add(
        [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()
    assert (
        engine.requests[big].finish_reason == "error"
        and "raise --kv-blocks" in engine.requests[big].error
    )
    assert engine.requests[small].finish_reason == "length"


def test_growth_past_pool_fails_with_output_kept(tiny_llama):
    engine = Engine(
        tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4, kv_blocks=4)
    )
    [seq] = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    assert seq.finish_reason == "error" and seq.num_output_tokens >= 12
    assert engine.block_map.snapshot().num_used == 0


def test_context_limit_finishes_with_length(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", max_model_len=20))
    [seq] = engine.generate(
        [list(range(5, 15))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    )
    assert seq.finish_reason == "length" and len(seq.token_ids) == 20


@pytest.mark.parametrize(
    "prompt,needle", [([], "empty"), ([5, 10**6], "outside the model's vocabulary")]
)
def test_bad_prompts(engine, prompt, needle):
    with pytest.raises(PagechatError, match=needle):
        engine.requests.add(prompt, sampled(1))


def test_step_report_counts(engine):
    rid = engine.requests.add(
        list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    first = engine.step()
    assert (
        first.kind == "prefill"
        and first.prefill_tokens == 20
        and first.outputs[0].request_id == rid
    )
    second = engine.step()
    assert second.kind == "decode" and second.decode_tokens == 1
    assert second.blocks.num_used == 6  # 21 tokens in blocks of 4
    while engine.has_unfinished():
        engine.step()


def test_n_samples_fork_and_copy_on_write(tiny_llama):
    """n = 3 samples share the prompt's blocks; each equals an independent run with its seed
    (seed + j)."""
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4))
    prompt = list(
        range(5, 15)
    )  # 10 tokens: the third block is shared and partial, so writes must copy it
    copies = []
    seqs = engine.generate(
        [prompt],
        SamplingParams(temperature=1.0, max_tokens=12, seed=5, n=3, ignore_eos=True),
        on_report=lambda r: copies.append(r.cow_copies),
    )
    assert len(seqs) == 3 and sum(copies) >= 2
    assert len({tuple(s.output_ids) for s in seqs}) == 3
    alone = Engine(
        tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4, prefix_cache=False)
    )
    for j, seq in enumerate(seqs):
        [ref] = alone.generate(
            [prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=5 + j, ignore_eos=True)
        )
        assert seq.output_ids == ref.output_ids
    assert engine.block_map.snapshot().num_used == 0


def test_step_reports_carry_every_block_event(tiny_llama):
    """The events the step reports carry are all the allocator announced, step after step."""
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4))
    seen = []
    engine.blocks.observers.append(seen.append)
    engine.requests.add("Blocks fill up", SamplingParams(max_tokens=20, n=2, ignore_eos=True))
    reported = []
    while engine.has_unfinished():
        reported += engine.step().block_events
    kinds = {e.kind for e in reported}
    assert reported == seen and {"allocated", "shared", "copied", "cached"} <= kinds


def test_released_requests_leave_nothing_behind(tiny_llama):
    """A long-running caller releases each finished request; then no table of the engine,
    scheduler or allocator grows with the number of requests served."""
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", block_size=4))
    kinds = [
        SamplingParams(max_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True, n=3, temperature=1.0),
        SamplingParams(max_tokens=3, temperature=0.0, beam_width=2),
    ]
    rid = engine.requests.add("not yet", kinds[0])
    with pytest.raises(PagechatError, match=f"request {rid} has not finished"):
        engine.requests.release(rid)
    engine.requests.abort(rid)
    assert engine.requests.release(rid).finish_reason == "abort"
    for i in range(30):
        rid = engine.requests.add(f"request {i}", kinds[i % 3])
        while engine.has_unfinished():
            engine.step()
        assert engine.requests.release(rid).finished
    assert (
        not engine.requests and not engine.requests.beams._groups and not engine.requests.beams._of
    )
    s = engine.scheduler
    assert not (s.running or s.waiting or s.swapped or s.idle)
    assert not engine.blocks._tables and engine.block_map.snapshot().num_used == 0
