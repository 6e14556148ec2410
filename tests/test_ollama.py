"""Models in Ollama's store (`ollama:NAME[:TAG]`) and `pagechat models`, on a store laid out as
Ollama lays it out: manifests under registry host / namespace / model / tag naming content-
addressed blobs (the GGUF, the template, the parameters, the system prompt)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jinja2
import pytest
from conftest import cli
from gguf_files import write_gguf
from pagechat.cli.launch import model_system
from pagechat.core.errors import PagechatError
from pagechat.core.loader import load_tokenizer, read_spec
from pagechat.core.ollama import find_model, jinja_template, parse_name

LLAMA3 = """{{ if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>

{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

{{ .Response }}<|eot_id|>"""
CHATML = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}<|im_start|>user
{{ .Prompt }}<|im_end|>
<|im_start|>assistant
{{ .Response }}<|im_end|>
"""


def blob(store: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def add_model(store: Path, name: str, gguf: Path, **layers: str) -> None:
    """A manifest as `ollama pull` leaves one: the model layer, then the others given."""
    items = [{"mediaType": "application/vnd.ollama.image.model", **blob(store, gguf.read_bytes())}]
    for kind, text in layers.items():
        items.append(
            {"mediaType": f"application/vnd.ollama.image.{kind}", **blob(store, text.encode())}
        )
    host, namespace, model, tag = parse_name(name)
    path = store / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "layers": items}))


@pytest.fixture(scope="module")
def store(tiny_models, tmp_path_factory) -> Path:
    """A store holding the tiny llama as `tiny` (its own template) and as `user/bare:v1` (a GGUF
    without a chat template, with Ollama's ChatML one)."""
    root = tmp_path_factory.mktemp("ollama")
    gguf = write_gguf(tiny_models["llama"], root / "src" / "tiny.gguf")
    params = json.dumps({"stop": ["<|im_end|>", "User:"], "temperature": 0.5})
    add_model(root, "tiny", gguf, params=params, system="You are terse.\n")
    bare = root / "bare"
    shutil.copytree(tiny_models["llama"], bare)
    for name in ("chat_template.jinja",):
        (bare / name).unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    add_model(root, "user/bare:v1", write_gguf(bare, root / "src" / "bare.gguf"), template=CHATML)
    return root


@pytest.fixture
def ollama(store, monkeypatch) -> Path:
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return store


def test_names_resolve_as_ollama_resolves_them():
    assert parse_name("llama3.2") == ("registry.ollama.ai", "library", "llama3.2", "latest")
    assert parse_name("qwen2:0.5b") == ("registry.ollama.ai", "library", "qwen2", "0.5b")
    assert parse_name("me/mine:v1") == ("registry.ollama.ai", "me", "mine", "v1")
    assert parse_name("hf.co/org/m:Q4_K_M") == ("hf.co", "org", "m", "Q4_K_M")
    for bad in ("../etc/passwd", "a/b/c/d", "x:../y", "", "a//b"):
        with pytest.raises(PagechatError, match="not an Ollama model name"):
            parse_name(bad)


def test_a_model_loads_from_the_store_with_its_parameters(ollama, tiny_models, capsys):
    model = find_model("tiny")
    assert model.name == "tiny:latest" and model.stops == ("<|im_end|>", "User:")
    spec = read_spec(Path("ollama:tiny"))
    tok = load_tokenizer(Path("ollama:tiny"))
    # a stop string that is one token ends a reply as eos does; "User:" is several tokens
    assert tok.convert_tokens_to_ids("<|im_end|>") in spec.eos_token_ids
    assert model_system(Path("ollama:tiny")) == "You are terse."
    argv = ["-p", "The cat", "--max-tokens", "8", "--dtype", "float32"]
    code, out, err = cli(["generate", "ollama:tiny", *argv], capsys)
    assert code in (None, 0), err
    assert out == cli(["generate", str(tiny_models["llama"]), *argv], capsys)[1]


def test_ollamas_template_serves_a_gguf_without_its_own(ollama):
    tok = load_tokenizer(Path("ollama:user/bare:v1"))
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    got = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert got == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_single_turn_templates_translate_and_others_are_left_to_the_gguf():
    render = jinja2.Environment().from_string(jinja_template(LLAMA3)).render
    text = render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    want = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    assert text == want + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert jinja_template("{{ range .Messages }}{{ .Content }}{{ end }}") is None
    assert jinja_template("{{ if .Tools }}x{{ end }}") is None


def test_what_is_missing_from_the_store_is_named(ollama, tmp_path, monkeypatch, capsys):
    code, _, err = cli(["generate", "ollama:nope", "-p", "x"], capsys)
    assert code == 2 and "ollama:nope: not in the Ollama store" in err
    manifest = next((ollama / "manifests").rglob("tiny/latest"))
    digest = json.loads(manifest.read_text())["layers"][0]["digest"]
    blob_path = ollama / "blobs" / digest.replace(":", "-")
    moved = tmp_path / "blob"
    blob_path.rename(moved)
    try:
        code, _, err = cli(["generate", "ollama:tiny", "-p", "x"], capsys)
        assert code == 2 and "its weights" in err and "are missing from the store" in err
    finally:
        moved.rename(blob_path)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    code, _, err = cli(["run", "ollama:tiny"], capsys)
    assert code == 2 and "no Ollama store at" in err and "OLLAMA_MODELS" in err


def test_models_lists_what_a_user_has(ollama, tiny_models, tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"
    write_gguf(tiny_models["qwen2"], here / "ggufs" / "q.gguf", default="Q8_0")
    shutil.copytree(tiny_models["qwen3"], here / "hf" / "qwen3")
    (here / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    monkeypatch.chdir(here)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = cli(["models", "--json"], capsys)
    assert code in (None, 0), err
    found = {m["name"]: m for m in json.loads(out)["models"]}
    assert set(found) == {
        str(here / "ggufs" / "q.gguf"),
        str(here / "hf" / "qwen3"),
        str(here / "broken.gguf"),
        "ollama:tiny:latest",
        "ollama:user/bare:v1",
    }
    q = found[str(here / "ggufs" / "q.gguf")]
    assert q["arch"] == "Qwen2ForCausalLM" and q["quant"].startswith("Q8_0") and q["fits"]
    assert found[str(here / "hf" / "qwen3")]["precision"] == "float32"
    assert "GGUF version 0" in found[str(here / "broken.gguf")]["error"]
    modified = [m["modified"] for m in json.loads(out)["models"]]
    assert modified == sorted(modified, reverse=True)  # newest first
    code, out, _ = cli(["models"], capsys)
    assert "./ggufs/q.gguf" in out and "ollama:tiny:latest" in out and "cannot load" in out
