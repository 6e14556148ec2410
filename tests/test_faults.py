"""Faults found by trying pagechat as a hostile user: each bad value, file or text gets one line
naming what and where, exit code 2 and no traceback; odd but valid settings still give exact
results."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import cli
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line_error


@pytest.fixture
def model(tiny_llama, tmp_path):
    """A fresh copy of the tiny llama checkpoint to break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def generate(model, capsys, *args: str) -> tuple[int | None, str, str]:
    return cli(["generate", str(model), "--max-tokens", "3", *args], capsys)


def edit_config(model, **fields) -> None:
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def edit_weights(model, change) -> None:
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seed", str(2**70)], f"seed must be between 0 and 2^63 - 1, got {2**70}"),
        (["--seed", str(2**64)], f"seed must be between 0 and 2^63 - 1, got {2**64}"),
        (["--seed", "-1"], "seed must be between 0 and 2^63 - 1, got -1"),
        (["--kv-blocks", "0"], "--kv-blocks must be >= 1, got 0"),
        (["--kv-memory", "nan"], "cannot read 'nan' as a size; write e.g. 2GiB, 512MiB or 1000000"),
        (["--kv-memory", "inf"], "cannot read 'inf' as a size; write e.g. 2GiB, 512MiB or 1000000"),
        (["--kv-memory", "-3GiB"], "cannot read '-3GiB' as a size; write e.g. 2GiB, 512MiB or"),
        (["--kv-memory", "1e30"], "is more memory than this machine has"),
        (
            ["--kv-blocks", str(10**12)],
            f"a KV pool of {10**12} blocks (3.81e+06 GiB) is more memory than this machine has",
        ),
        (
            ["--kv-dtype", "int4"],
            "--kv-dtype must be auto, float32, bfloat16 or float16, got 'int4'",
        ),
    ],
)
def test_bad_engine_values(args, message, tiny_llama, capsys):
    code, _, err = generate(tiny_llama, capsys, "-p", "hi", *args)
    assert_one_line_error(code, err, message)


@pytest.mark.parametrize(
    "args,message",
    [
        (["-p", "ok", "-p", "a\udcffb"], "prompt 2 is not valid UTF-8 text"),
        (["-p", "hi", "--chat", "--system", "\udcfe"], "--system is not valid UTF-8 text"),
        (["-p", "hi", "--stop", "\udcfe"], "--stop is not valid UTF-8 text"),
    ],
)
def test_text_that_is_not_utf8(args, message, tiny_llama, capsys):
    """Python hands undecodable argv bytes on as lone surrogates, which the tokenizer rejects."""
    code, _, err = generate(tiny_llama, capsys, *args)
    assert_one_line_error(code, err, message)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_hidden_layers": [2]}, "num_hidden_layers must be an integer >= 1, got [2]"),
        ({"hidden_size": {"a": 1}}, "hidden_size must be an integer >= 1, got {'a': 1}"),
        ({"vocab_size": 0}, "vocab_size must be an integer >= 1, got 0"),
        ({"num_attention_heads": "4"}, "num_attention_heads must be an integer >= 1, got '4'"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number, got 'small'"),
        (
            {"max_position_embeddings": 10**15},
            f"max_position_embeddings must be an integer between 1 and 2^24, got {10**15}",
        ),
        (
            {"sliding_window": "abc", "use_sliding_window": True},
            "sliding_window must be an integer >= 1, got 'abc'",
        ),
        (
            {"sliding_window": 0, "use_sliding_window": True},
            "sliding_window must be an integer >= 1, got 0",
        ),
    ],
)
def test_odd_config_values(fields, message, model, capsys):
    edit_config(model, **fields)
    code, _, err = generate(model, capsys, "-p", "hi")
    assert_one_line_error(code, err, f"{model / 'config.json'}: {message}")


def test_checkpoint_with_more_layers_than_its_config(model, capsys):
    edit_config(model, num_hidden_layers=1)
    code, _, err = generate(model, capsys, "-p", "hi")
    assert_one_line_error(
        code, err, "model.safetensors: tensor model.layers.1.input_layernorm.weight is not used"
    )


def test_checkpoint_with_integer_weights(model, capsys):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    edit_weights(model, to_int)
    code, _, err = generate(model, capsys, "-p", "hi")
    assert_one_line_error(
        code, err, "model.safetensors: tensor model.norm.weight is int32, not floating point"
    )


def test_chat_template_that_raises(model, capsys):
    (model / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    code, _, err = generate(model, capsys, "-p", "hi", "--chat")
    assert_one_line_error(code, err, "the chat template failed: no system role")


def test_unwritable_output_folder(capsys):
    code, _, err = cli(["make-model", "/proc/no/such"], capsys)
    assert_one_line_error(code, err, "/proc/no: No such file or directory")


def test_tiny_batch_budget_chunks_long_prompts_exactly(tiny_llama, capsys):
    """A step budget smaller than a decode graph's width still prefills in chunks, and the
    text equals the one computed with the default budget."""
    prompt = "word " * 40
    runs = [
        generate(tiny_llama, capsys, "-p", prompt, "--ignore-eos", "--json", *extra)
        for extra in ([], ["--max-batch-tokens", "5"], ["--max-batch-tokens", "1"])
    ]
    assert all(code == 0 for code, _, _ in runs), runs[1][2]
    ids = [json.loads(out)["results"][0]["token_ids"] for _, out, _ in runs]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 3


def test_logits_that_are_not_numbers_are_one_line(model, capsys):
    def to_nan(t):
        t["model.norm.weight"] = torch.full_like(t["model.norm.weight"], float("nan"))

    edit_weights(model, to_nan)
    code, out, err = generate(model, capsys, "-p", "hi")
    assert_one_line_error(
        code, err, "prompt 1: the model's logits are not finite (NaN or inf): its weights are"
    )


def test_a_temperature_too_small_to_divide_by_samples_the_argmax(tiny_llama, capsys):
    """1e-38 overflows the logits it divides; its limit (the greedy token) is what it samples."""
    runs = [
        generate(tiny_llama, capsys, "-p", "hello", "--ignore-eos", "--json", "--temperature", t)
        for t in ("0", "1e-38", "1e-300")
    ]
    assert all(code == 0 for code, _, _ in runs), runs
    ids = [json.loads(out)["results"][0]["token_ids"] for _, out, _ in runs]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 3


STAGES = {  # where to break a step: (the engine, its sampler or its beam searches; the method)
    "forward": ("engine", "_forward"),
    "draft": ("engine", "_draft"),
    "sample": ("sampler", "sample"),
    "verify": ("engine", "_verify_drafts"),
    "append": ("engine", "_append"),
    "beam pick": ("beams", "advance"),
}


@pytest.mark.parametrize("stage", STAGES)
def test_an_engine_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    stage, tiny_llama, monkeypatch
):
    """Fault injection at each phase of a step: the requests it ran end with the error in one
    line, every block comes back, and the next request is computed as by a fresh engine."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.core.params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    beams = SamplingParams(max_tokens=6, ignore_eos=True, beam_width=2)
    engine = Engine(tiny_llama, EngineConfig(ngram=True, num_draft=2))
    want = Engine(tiny_llama, EngineConfig()).generate(["one two one two one"], greedy)
    where, name = STAGES[stage]
    target = {"engine": engine, "sampler": engine.sampler, "beams": engine.requests.beams}[where]
    real, calls = getattr(target, name), []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second call: requests have started, some KV is written
            raise RuntimeError("boom\nat line 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, broken)
    prompts = ["one two one two one two", "a b c d e f g", "x y z"]
    ids = [engine.requests.add(p, beams if i == 1 else greedy) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert len(calls) >= 2, "the stage never ran twice"
    failed = [engine.requests[i] for i in ids if engine.requests[i].error]
    assert failed and all(s.finish_reason == "error" for s in failed)
    assert {s.error for s in failed} == {"engine step failed: RuntimeError: boom at line 2"}
    assert engine.blocks.num_free_blocks() == engine.blocks.num_blocks
    monkeypatch.undo()
    again = engine.generate(["one two one two one"], greedy)
    assert again[0].output_ids == want[0].output_ids and not again[0].error


def test_a_chat_template_that_never_ends_is_stopped(model, capsys, monkeypatch):
    import pagechat.core.requests

    monkeypatch.setattr(pagechat.core.requests, "TEMPLATE_LIMIT_S", 0.5)
    (model / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    code, _, err = generate(model, capsys, "-p", "hi", "--chat")
    assert_one_line_error(code, err, f"the chat template of {model} did not finish within 0.5 s")
