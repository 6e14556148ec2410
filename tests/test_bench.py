"""`pagechat bench --json`: every figure the issue names is there, for both sides, with ratios."""

from __future__ import annotations

import json

from conftest import cli

from pagechat.core.bench import KEYS, Workload, median_of


def test_bench_json_vs_hf(tiny_llama, capsys):
    code, out, err = cli(["bench", str(tiny_llama), "--vs-hf", "--rounds", "1", "--ngram", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"pagechat", "transformers", "ratios", "machine"}
    for side in ("pagechat", "transformers"):
        for key in KEYS:
            assert key in data[side], (side, key)
        assert len(data[side]["turn_ttft_ms"]) == 8 and data[side]["decode_tok_s"] > 0
    assert data["transformers"]["dtype"] in ("float32", "bfloat16")
    assert abs(data["ratios"]["decode_tok_s"] - data["pagechat"]["decode_tok_s"] / data["transformers"]["decode_tok_s"]) < 1e-9
    spec = data["pagechat"]["speculation"]
    assert spec["proposer"] == "ngram" and spec["speedup"] > 0


def test_workload_fits_short_context_and_is_deterministic():
    a = Workload.make(1024, {0, 1, 2}, max_len=512, seed=3)
    assert a == Workload.make(1024, {0, 1, 2}, max_len=512, seed=3)
    assert max(len(p) for p in a.batch) + 128 <= 512
    assert not {0, 1, 2} & {t for p in a.batch for t in p}


def test_median_of_rounds():
    rounds = [{"x": 1.0, "l": [1, 5], "d": {"y": 3}}, {"x": 3.0, "l": [2, 4], "d": {"y": 1}},
              {"x": 2.0, "l": [9, 6], "d": {"y": 2}}]
    assert median_of(rounds) == {"x": 2.0, "l": [2, 5], "d": {"y": 2}}
