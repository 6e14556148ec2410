"""Preemption by swapping: token-identical to recompute and to a pool with room for everyone,
greedy and seeded; every swap is recorded with its blocks and bytes; both pools end empty."""

from __future__ import annotations

import json

import pytest
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.kv import block_bytes
from pagechat.core.params import SamplingParams
from pagechat.core.sequence import Status

PROMPTS = [list(range(5 + i, 17 + 2 * i)) for i in range(6)]  # 12..22 tokens


def run(model, params, **config):
    engine = Engine(model, EngineConfig(device="cpu", dtype="float32", block_size=4, **config))
    reports = []
    seqs = engine.generate(PROMPTS, params, on_report=reports.append)
    return engine, [s.output_ids for s in seqs], reports


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_swap_equals_recompute_equals_room_for_all(params, tiny_llama):
    _, roomy, _ = run(tiny_llama, params)
    _, recompute, rec_reports = run(tiny_llama, params, kv_blocks=24)
    engine, swap, reports = run(tiny_llama, params, kv_blocks=24, preempt="swap")
    assert swap == recompute == roomy
    assert sum(len(r.preempted) for r in rec_reports) > 0
    outs = [s for r in reports for s in r.swaps if s.direction == "out"]
    ins = [s for r in reports for s in r.swaps if s.direction == "in"]
    assert outs and sorted(s.seq_id for s in outs) == sorted(s.seq_id for s in ins)
    per_block = block_bytes(engine.spec, 4, engine.kv_dtype)
    assert all(s.bytes == s.blocks * per_block and s.seconds >= 0 for s in outs + ins)
    # swapping saves the recompute: fewer prompt tokens are computed again
    assert sum(r.prefill_tokens for r in reports) < sum(r.prefill_tokens for r in rec_reports)
    assert engine.block_map.snapshot().num_used == 0
    assert engine.scheduler.host.num_free() == engine.scheduler.host.num_blocks


def test_a_full_host_pool_falls_back_to_recompute(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, roomy, _ = run(tiny_llama, params)
    engine, swap, reports = run(tiny_llama, params, kv_blocks=24, preempt="swap", swap_blocks=6)
    assert swap == roomy
    preempted = sum(len(r.preempted) for r in reports)
    swapped = sum(1 for r in reports for s in r.swaps if s.direction == "out")
    assert 0 < swapped < preempted


def test_a_swapped_request_can_be_aborted(tiny_llama):
    engine = Engine(
        tiny_llama,
        EngineConfig(device="cpu", dtype="float32", block_size=4, kv_blocks=24, preempt="swap"),
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.requests.add(p, params) for p in PROMPTS]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert victim.status is Status.SWAPPED
    engine.requests.abort(victim.seq_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[victim.seq_id].finish_reason == "abort"
    assert all(engine.requests[i].finished for i in ids)
    assert engine.scheduler.host.num_free() == engine.scheduler.host.num_blocks
    assert engine.block_map.snapshot().num_used == 0


def test_generate_json_counts_swaps(tiny_llama, capsys):
    from conftest import cli

    args = ["-p", "hello", "-p", "hello there", "-p", "a b c", "--max-tokens", "12"]
    tight = ["--kv-blocks", "4", "--block-size", "4", "--ignore-eos", "--preempt", "swap"]
    code, out, err = cli(["generate", str(tiny_llama), *args, *tight, "--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)["stats"]
    swaps, events = stats["swaps"], stats["block_events"]
    assert swaps["blocks_out"] == swaps["blocks_in"] > 0 and stats["preemptions"] > 0
    assert events["swapped_out"] == events["swapped_in"] > 0


def test_bad_preempt_mode():
    from pagechat.core.errors import PagechatError

    with pytest.raises(PagechatError, match="--preempt must be recompute or swap, got 'page'"):
        EngineConfig(preempt="page").validate()


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_the_chat_goes_first_under_background_load(preempt, tiny_llama):
    """Requests of priority 1 (the app's background load) fill a tight pool; one of priority 0
    (the chat) that comes later is admitted before the waiting ones and never preempted, while
    the others are; every output equals the one computed with room for all."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"load {i} " + "word " * 12 for i in range(6)]
    chat = "the chat " + "word " * 10
    # float32 KV: recomputed KV equals the decoded one to the last bits that greedy ties can see
    exact = {"dtype": "float32", "kv_dtype": "float32", "block_size": 4}
    roomy = Engine(tiny_llama, EngineConfig(kv_blocks=512, **exact))
    want = [s.output_ids for s in roomy.generate([*prompts, chat], greedy)]
    tight = Engine(tiny_llama, EngineConfig(kv_blocks=30, preempt=preempt, **exact))
    load = [tight.requests.add(p, greedy, priority=1) for p in prompts]
    for _ in range(3):
        tight.step()
    rid = tight.requests.add(chat, greedy)
    tight.step()
    assert tight.requests[rid].status is Status.RUNNING  # admitted ahead of waiting load
    while tight.has_unfinished():
        tight.step()
    seqs = [tight.requests[i] for i in [*load, rid]]
    assert [s.output_ids for s in seqs] == want
    assert seqs[-1].num_preemptions == 0 and sum(s.num_preemptions for s in seqs[:-1]) > 0
