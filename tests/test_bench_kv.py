"""`pagechat bench-kv`: sharing n samples or beams of one prompt holds a fraction of the blocks
separate requests hold; a swap's bytes are its blocks' bytes; the command's JSON carries both."""

from __future__ import annotations

import json

from conftest import cli
from pagechat.core.config import EngineConfig
from pagechat.core.kv import block_bytes
from pagechat.tools.bench_kv import churn_rss, kv_engine, preempt_cost, sharing


def test_samples_and_beams_share_their_prompt(tiny_llama):
    engine = kv_engine(tiny_llama, EngineConfig(device="cpu", dtype="float32"), 300)
    prompt = list(range(3, 259))  # 256 tokens: 16 full blocks
    samples = sharing(engine, prompt, "samples", 8, 16)
    beams = sharing(engine, prompt, "beams", 4, 16)
    # separate requests hold the prompt 8 (4) times over; shared ones once, plus their tails
    assert samples.separate_blocks == 8 * 17 and samples.ratio <= 1 / 4
    assert beams.separate_blocks == 4 * 17 and beams.ratio <= 1 / 3
    assert engine.block_map.snapshot().num_used == 0


def test_preempt_cost_counts_the_sequences_blocks(tiny_llama):
    engine = kv_engine(tiny_llama, EngineConfig(device="cpu", dtype="float32"), 64)
    cost = preempt_cost(engine, 40, rounds=1)
    assert cost.blocks == 3 and cost.bytes == 3 * block_bytes(engine.spec, 16, engine.kv_dtype)
    assert cost.swap_ms > 0 and cost.recompute_ms > 0


def test_bench_kv_json(tiny_llama, capsys):
    args = ["--prompt-tokens", "64", "--new-tokens", "4", "--contexts", "32", "--rounds", "1"]
    code, out, err = cli(["bench-kv", str(tiny_llama), *args, "--json"], capsys)
    assert not code, err
    data = json.loads(out)
    assert [s["mode"] for s in data["sharing"]] == ["samples", "beams"]
    assert data["preemption"][0]["tokens"] == 32


def test_bench_kv_longer_than_the_model(tiny_llama, capsys):
    code, _, err = cli(
        ["bench-kv", str(tiny_llama), "--prompt-tokens", "600", "--contexts", "32"], capsys
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: the benchmark needs 632 tokens of context, the model has 512; lower "
        "--prompt-tokens, --new-tokens or --contexts"
    ]


def test_churn_releases_every_request(tiny_llama):
    engine = kv_engine(tiny_llama, EngineConfig(device="cpu", dtype="float32"), 64)
    points = churn_rss(engine, 20, marks=2)
    assert [n for n, _ in points] == [0, 10, 20] and all(rss > 0 for _, rss in points)
    assert not engine.requests and engine.block_map.snapshot().num_used == 0
