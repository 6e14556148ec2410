"""Every bad input gets one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import cli
from safetensors.torch import load_file, save_file


@pytest.fixture
def broken(tiny_llama, tmp_path):
    """A fresh copy of the tiny llama checkpoint to break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def rewrite_weights(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def set_arch(path, arch: str) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))


BREAKS = {
    "no config.json": (lambda p: (p / "config.json").unlink(), "no config.json"),
    "unsupported architecture": (lambda p: set_arch(p, "GPT2LMHeadModel"), "LlamaForCausalLM"),
    "missing safetensors": (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "truncated safetensors": (
        lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:5000]
        ),
        "truncated",
    ),
    "missing tensor": (
        lambda p: rewrite_weights(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "model.layers.1.mlp.up_proj.weight is missing",
    ),
    "wrong shape": (
        lambda p: rewrite_weights(
            p, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:10].clone()})
        ),
        "model.norm.weight has shape (10,)",
    ),
    "no tokenizer": (lambda p: (p / "tokenizer.json").unlink(), "no tokenizer"),
    "pickle only": (
        lambda p: ((p / "model.safetensors").unlink(), (p / "pytorch_model.bin").write_bytes(b"x")),
        "arbitrary code",
    ),
}


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("case", BREAKS)
def test_broken_checkpoint(case, broken, capsys):
    breaker, needle = BREAKS[case]
    breaker(broken)
    code, _, err = cli(["generate", str(broken), "-p", "hi"], capsys)
    assert_one_line_error(code, err, needle)


def test_missing_path(tmp_path, capsys):
    code, _, err = cli(["generate", str(tmp_path / "nope"), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "does not exist")


def test_file_instead_of_directory(tiny_llama, capsys):
    code, _, err = cli(["generate", str(tiny_llama / "config.json"), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "is a file")


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--temperature", "-0.5", "temperature must be >= 0"),
        ("--top-p", "0", "top-p must be in (0, 1]"),
        ("--top-p", "1.5", "top-p must be in (0, 1]"),
    ],
)
def test_bad_sampling_values(flag, value, needle, tiny_llama, capsys):
    code, _, err = cli(["generate", str(tiny_llama), "-p", "hi", flag, value], capsys)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--spec-prompt", "hi"], "--spec-prompt needs --draft DIR or --ngram"),
        (["--ngram", "--spec-prompt", " "], "--spec-prompt is empty"),
    ],
)
def test_bad_bench_speculation_prompt(args, needle, tiny_llama, capsys):
    code, _, err = cli(["bench", str(tiny_llama), *args], capsys)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["plan"]])
def test_bad_dtype(command, tiny_llama, capsys):
    code, _, err = cli([command[0], str(tiny_llama), *command[1:], "--dtype", "int3"], capsys)
    assert_one_line_error(
        code, err, "--dtype must be auto, float32, bfloat16 or float16, got 'int3'"
    )


def test_prompt_longer_than_context(tiny_llama, capsys):
    code, _, err = cli(["generate", str(tiny_llama), "-p", "word " * 2000], capsys)
    assert_one_line_error(code, err, "the model's context is 512")


def test_generate_json(tiny_llama, capsys):
    code, out, err = cli(
        [
            "generate",
            str(tiny_llama),
            "-p",
            "Hello",
            "-p",
            "Blocks",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    assert [len(r["token_ids"]) for r in data["results"]] == [5, 5]
    assert all(r["finish_reason"] == "length" and r["prompt_ids"] for r in data["results"])
    assert data["stats"]["decode_tokens"] > 0 and data["stats"]["kv_blocks_total"] > 0


def test_generate_streams_text_and_stats_line(tiny_llama, capsys):
    code, out, err = cli(
        ["generate", str(tiny_llama), "-p", "Hello", "--max-tokens", "4", "--ignore-eos"], capsys
    )
    assert code == 0
    assert out.endswith("\n") and err.count("\n") == 1 and "TTFT" in err and "KV blocks" in err
