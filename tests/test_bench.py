"""`pagechat bench --json`: every figure the issue names is there, for both sides, with ratios."""

from __future__ import annotations

import json

from conftest import cli
from pagechat.tools.bench import KEYS, Workload, median_of


def test_bench_json_vs_hf(tiny_llama, capsys):
    code, out, err = cli(
        ["bench", str(tiny_llama), "--vs-hf", "--rounds", "1", "--ngram", "--json"], capsys
    )
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"pagechat", "transformers", "ratios", "machine"}
    for side in ("pagechat", "transformers"):
        for key in KEYS:
            assert key in data[side], (side, key)
        assert len(data[side]["turn_ttft_ms"]) == 8 and data[side]["decode_tok_s"] > 0
    assert data["transformers"]["dtype"] in ("float32", "bfloat16")
    # each figure against transformers' best dtype for it
    theirs = data["transformers"]["all_dtypes"]
    assert data["transformers"]["prefill_tok_s"] == max(r["prefill_tok_s"] for r in theirs.values())
    assert data["transformers"]["ttft_ms"] == min(r["ttft_ms"] for r in theirs.values())
    best = data["transformers"]["dtypes"]["batch8_tok_s"]
    assert data["transformers"]["batch8_tok_s"] == theirs[best]["batch8_tok_s"]
    assert (
        abs(
            data["ratios"]["decode_tok_s"]
            - data["pagechat"]["decode_tok_s"] / data["transformers"]["decode_tok_s"]
        )
        < 1e-9
    )
    spec = data["pagechat"]["speculation"]
    assert spec["proposer"] == "ngram" and spec["speedup"] > 0
    step = data["pagechat"]["step"]  # where a decode step's time went, from torch.profiler
    assert step["matmul_ms"] > 0 and step["attention_ms"] > 0 and step["other_ms"] > 0
    assert step["python_ms"] >= 0


def test_step_ops_are_put_where_they_belong():
    """An op counts by its own and its enclosing ops' names: a matmul inside linear is a weight
    matmul, one inside attention is attention, the pool's gather is attention, but an
    embedding's index_select is not."""
    from types import SimpleNamespace

    from pagechat.tools.step_profile import kind_of

    def op(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent)

    assert kind_of(op("aten::addmm", op("aten::linear"))) == "matmul"
    assert kind_of(op("pagechat::int8_linear")) == "matmul"
    assert kind_of(op("aten::copy_", op("aten::_weight_int8pack_mm"))) == "matmul"
    assert kind_of(op("aten::index_select")) == "attention"
    assert kind_of(op("aten::index_select", op("aten::embedding"))) == "other"
    assert kind_of(op("aten::bmm", op("aten::scaled_dot_product_attention"))) == "attention"
    assert kind_of(op("aten::rms_norm", op("step"))) == "other"
    assert kind_of(op("pagechat::decode_attention")) == "attention"
    assert kind_of(op("pagechat::qkv_decode_attention")) == "attention"
    assert kind_of(op("pagechat::add_rms_norm", op("step"))) == "other"


def test_workload_fits_short_context_and_is_deterministic():
    a = Workload.make(1024, {0, 1, 2}, max_len=512, seed=3)
    assert a == Workload.make(1024, {0, 1, 2}, max_len=512, seed=3)
    assert max(len(p) for p in a.batch) + 128 <= 512
    assert not {0, 1, 2} & {t for p in a.batch for t in p}


def test_median_of_rounds():
    rounds = [
        {"x": 1.0, "l": [1, 5], "d": {"y": 3}},
        {"x": 3.0, "l": [2, 4], "d": {"y": 1}},
        {"x": 2.0, "l": [9, 6], "d": {"y": 2}},
    ]
    assert median_of(rounds) == {"x": 2.0, "l": [2, 5], "d": {"y": 2}}


def test_bench_speculation_round_decodes_the_given_prompt(tiny_llama, capsys):
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine

    text = "blocks blocks blocks of sixteen tokens"
    code, out, err = cli(
        ["bench", str(tiny_llama), "--rounds", "1", "--ngram", "--spec-prompt", text, "--json"],
        capsys,
    )
    assert code == 0, err
    spec = json.loads(out)["pagechat"]["speculation"]
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32"))
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    assert (
        spec["prompt_tokens"] == len(engine.requests.encode(text, chat=chat)) != 128
    )  # not the workload's prompt


def test_bench_main_figures_decode_plainly_with_a_proposer(tiny_llama):
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.tools.bench import pagechat_round

    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", ngram=True))
    reports, step = [], engine.step
    engine.step = lambda: reports.append(step()) or reports[-1]
    w = Workload.make(
        engine.spec.vocab_size, set(engine.tokenizer.all_special_ids), engine.max_model_len, 0
    )
    pagechat_round(engine, w)
    assert reports and not any(r.drafts for r in reports) and engine.proposer is not None
