"""The shipped demo models load through the engine and answer held-out questions; the draft fits."""

import json
import math
import re

import pagechat.tools.demo as demo
import pytest
from conftest import cli
from pagechat.core.errors import PagechatError
from pagechat.tools.demo import corpus
from pagechat.tools.demo.train import CHAT, Recipe, Shape, evaluate, train_demo
from safetensors import safe_open


def _params(model_dir) -> int:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.fixture(scope="module")
def chat_result():
    return evaluate(demo.chat_model_dir())


def test_chat_model_answers_heldout_questions_through_the_engine(chat_result):
    misses = [(r["question"], r["reply"]) for r in chat_result["replies"] if not r["ok"]]
    assert chat_result["total"] == 10 and chat_result["correct"] >= 8, misses


def test_shipped_metrics_match_what_the_engine_gives_now(chat_result):
    metrics = json.loads((demo.DEMO_DIR / "metrics.json").read_text())
    assert metrics["chat"]["heldout_correct"] == chat_result["correct"]
    assert metrics["chat"]["heldout_replies"] == chat_result["replies"]
    assert (
        metrics["speculation"]["acceptance_rate"] >= 0.6 and metrics["speculation"]["same_as_plain"]
    )
    assert (
        evaluate(demo.awq_model_dir())["correct"] == metrics["variants"]["awq"]["heldout_correct"]
    )


def test_demo_draft_records_are_what_the_reply_got():
    """With the demo draft most replies end inside an accepted draft: the records show no bonus
    after the end of sequence, and the emitted tokens are exactly the reply's after the first."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.core.params import SamplingParams

    engine = Engine(
        demo.chat_model_dir(),
        EngineConfig(device="cpu", dtype="float32", draft=str(demo.draft_model_dir())),
    )
    records = []
    [seq] = engine.generate(
        [engine.requests.encode("Explain speculative decoding.", chat=True)],
        SamplingParams(temperature=0.0, max_tokens=80),
        on_report=lambda r: records.extend(r.drafts),
    )
    assert seq.finish_reason == "stop" and seq.output_ids[-1] in engine.requests.eos_ids
    assert [t for r in records for t in r.emitted] == seq.output_ids[1:]
    assert sum(r.accepted for r in records) / sum(len(r.drafted) for r in records) >= 0.6


def test_a_chat_turn_reuses_every_token_the_last_one_computed():
    """The next turn's prompt re-renders the reply through the chat template; the prefix cache then
    serves every token whose KV the finished turn holds, its partly filled last block included."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.core.params import SamplingParams

    engine = Engine(demo.chat_model_dir(), EngineConfig(device="cpu", dtype="float32"))
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    [first] = engine.generate(
        [engine.requests.encode_chat(messages)], SamplingParams(temperature=0.0, max_tokens=60)
    )
    assert first.num_computed % engine.blocks.block_size, "the turn was meant to end inside a block"
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the KV cache?"},
    ]
    [second] = engine.generate(
        [engine.requests.encode_chat(messages)], SamplingParams(temperature=0.0, max_tokens=4)
    )
    assert second.num_cached_tokens == first.num_computed


def test_commands_without_a_model_dir_use_the_demo_models(capsys):
    code, out, err = cli(["generate", "-p", "What is the KV cache?", "--max-tokens", "40"], capsys)
    assert code == 0 and "without recomputing" in out  # the chat template is on for the demo model
    assert demo.model_or_demo(None, "awq") == demo.awq_model_dir()
    assert demo.model_or_demo(None, "int8") == demo.chat_model_dir()
    assert demo.draft_or_demo(demo.Path("demo")) == str(demo.draft_model_dir())


def test_draft_is_at_most_a_quarter_of_the_chat_model_with_the_same_vocabulary():
    chat, draft = demo.chat_model_dir(), demo.draft_model_dir()
    assert _params(draft) * 4 <= _params(chat)
    cfg = {p: json.loads((p / "config.json").read_text()) for p in (chat, draft)}
    assert cfg[chat]["vocab_size"] == cfg[draft]["vocab_size"]
    assert (chat / "tokenizer.json").read_text() == (draft / "tokenizer.json").read_text()
    for c in cfg.values():  # shapes the int4/int8 kernels take
        assert c["hidden_size"] % 128 == 0 and c["intermediate_size"] % 128 == 0
        assert c["architectures"] == ["LlamaForCausalLM"]


def test_corpus_is_deterministic_under_a_seed():
    assert corpus.training_dialogues(300, seed=5) == corpus.training_dialogues(300, seed=5)
    assert corpus.training_dialogues(300, seed=5) != corpus.training_dialogues(300, seed=6)
    assert corpus.heldout(10) == corpus.heldout_pool()[:10]


def test_heldout_questions_are_not_in_the_training_text():
    text = "".join(corpus.render(d) for d in corpus.training_dialogues(CHAT.dialogues, seed=0))
    pool = corpus.heldout_pool()
    assert (
        len({it.key for it in pool}) == len(pool) == corpus.HELDOUT_ROUNDS * len(corpus.HELDOUT_MIX)
    )
    compared = {
        tuple(sorted(int(x) for x in m if x))
        for m in re.findall(r"(\d+) or (\d+)\?|Is (\d+) larger than (\d+)\?", text)
    }
    for item in pool:
        assert item.question not in text, item
        if item.kind == "repeat":  # the sentence is never trained, in any phrasing
            assert item.expect not in text, item
        if item.kind == "cmp":  # nor the pair of numbers, in any order or phrasing
            assert item.key[1:] not in compared, item


def test_a_missing_demo_model_is_one_actionable_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    with pytest.raises(PagechatError, match="train-demo"):
        demo.chat_model_dir()
    code, _, err = cli(["generate", "-p", "hi"], capsys)
    assert code == 2 and "make-model" in err and len(err.strip().splitlines()) == 1


def test_train_demo_refuses_bad_input_in_one_line(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    code, _, err = cli(["train-demo", str(tmp_path)], capsys)
    assert code == 2 and "not empty" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    code, _, err = cli(["train-demo", str(tmp_path / "new"), "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err


TINY = Recipe(Shape(128, 256, 1, 2, 1), dialogues=300, drills=40, rows=8)


def test_train_demo_pipeline_is_deterministic_under_a_seed(tmp_path):
    """The whole script on a tiny recipe, twice: same files, same metrics (timings aside); every
    part is made and checked through the engine."""
    runs = [
        train_demo(tmp_path / str(i), seed=3, threads=1, log=lambda s: None, chat=TINY, draft=TINY)
        for i in range(2)
    ]
    for m in runs:
        m.pop("total_seconds")
        for name in ("chat", "draft"):
            m[name].pop("train_seconds")
    assert runs[0] == runs[1]
    for part in ("chat", "chat-awq", "draft"):
        a, b = ((tmp_path / str(i) / part / "model.safetensors").read_bytes() for i in range(2))
        assert a == b, part
    awq = json.loads((tmp_path / "0" / "chat-awq" / "config.json").read_text())
    assert awq["quantization_config"]["quant_method"] == "awq"
    m = runs[0]
    assert set(m["variants"]) == {"awq", "int8", "int8-wo"} and m["chat"]["heldout_total"] == 10
    assert 0.0 <= m["speculation"]["acceptance_rate"] <= 1.0 and m["speculation"]["same_as_plain"]
