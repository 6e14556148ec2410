"""The command line as a user meets it: --version, and generate's samples (--n) and beams
(--beams) in text and in --json."""

from __future__ import annotations

import json
from importlib.metadata import version

from conftest import cli
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams


def generate_json(model, capsys, *args: str) -> list[dict]:
    code, out, err = cli(["generate", str(model), "-p", "Hello", *args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["results"]


def test_version(capsys):
    code, out, _ = cli(["--version"], capsys)
    assert code == 0 and out == f"pagechat {version('pagechat')}\n"


def test_samples_do_not_depend_on_the_pool(tiny_llama, capsys):
    """Seeded samples are the same in a roomy pool and in one so small that they are
    preempted; the result's own tokens are its first sample's."""
    args = ("--n", "3", "--seed", "7", "--temperature", "1", "--max-tokens", "12", "--ignore-eos")
    [roomy] = generate_json(tiny_llama, capsys, *args)
    [tight] = generate_json(tiny_llama, capsys, *args, "--block-size", "4", "--kv-blocks", "6")
    assert roomy["samples"] == tight["samples"] and len(roomy["samples"]) == 3
    assert len({tuple(s["token_ids"]) for s in roomy["samples"]}) == 3
    assert roomy["token_ids"] == roomy["samples"][0]["token_ids"]
    assert all(s["finish_reason"] == "length" for s in roomy["samples"])


def test_beams_in_json_are_the_engines_best_first(tiny_llama, capsys):
    [result] = generate_json(
        tiny_llama, capsys, "--beams", "3", "--max-tokens", "6", "--length-penalty", "0.5"
    )
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=6, beam_width=3, length_penalty=0.5)
    [seq] = engine.generate([engine.requests.encode("Hello", chat=False)], params)
    beams = result["beams"]
    assert [b["token_ids"] for b in beams] == [list(b.token_ids) for b in seq.beams]
    assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    assert result["token_ids"] == beams[0]["token_ids"] and result["text"] == beams[0]["text"]


def test_samples_print_under_headers(tiny_llama, capsys):
    code, out, err = cli(
        ["generate", str(tiny_llama), "-p", "Hi", "--n", "2", "--max-tokens", "3", "--ignore-eos"],
        capsys,
    )
    assert code == 0, err
    heads = [line for line in out.splitlines() if line.startswith("[sample ")]
    assert heads == ["[sample 1/2, length]", "[sample 2/2, length]"]


def test_bad_early_stopping(tiny_llama, capsys):
    code, _, err = cli(
        ["generate", str(tiny_llama), "-p", "hi", "--beams", "2", "--early-stopping", "maybe"],
        capsys,
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: --early-stopping must be true, false or never, got 'maybe'"
    ]


def test_generate_takes_the_four_constraints(tiny_llama, capsys, tmp_path):
    """Each flag constrains the output as the engine's own constraint does; a bad one, or two,
    is one line and exit code 2 before any model loads."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= "up" | "down"')
    sampled = ("--temperature", "1", "--seed", "3", "--max-tokens", "40")
    [r] = generate_json(tiny_llama, capsys, "--json-schema", str(tmp_path / "s.json"), *sampled)
    if r["finish_reason"] == "stop":
        jsonschema.validate(json.loads(r["text"]), schema)
    assert r["text"].startswith("{")
    [r] = generate_json(tiny_llama, capsys, "--regex", "[a-c]{2,4}!", *sampled)
    assert re.fullmatch("[a-c]{2,4}!", r["text"])
    [r] = generate_json(tiny_llama, capsys, "--choice", "red,green,blue", *sampled)
    assert r["text"] in ("red", "green", "blue") and r["finish_reason"] == "stop"
    [r] = generate_json(tiny_llama, capsys, "--grammar", str(tmp_path / "g.gbnf"), *sampled)
    assert r["text"] in ("up", "down")
    for bad, says in [
        (("--regex", "[a-"), "regex"),
        (("--regex", "a", "--choice", "b"), "give one constraint"),
        (("--grammar", str(tmp_path / "nope")), "cannot read"),
    ]:
        code, _, err = cli(["generate", str(tiny_llama), "-p", "Hi", *bad], capsys)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_bench_grammar_compares_a_constraint_with_none(tiny_llama, capsys):
    args = ["bench-grammar", str(tiny_llama), "--streams", "1,2", "--rounds", "1"]
    code, out, err = cli([*args, "--max-tokens", "4", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["streams"] for r in rows] == [1, 2]
    assert all(r["tok_s"] > 0 and r["tok_s_constrained"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["mask_ms_per_step"] > 0 for r in rows)
