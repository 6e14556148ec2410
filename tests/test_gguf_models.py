"""GGUF models through the whole engine, with transformers as the oracle.

Tiny GGUFs of each architecture are written by the gguf package's writer from the tests' random
checkpoints (tests/gguf_files.py, as llama.cpp's converter writes them): in F32 the engine on the
GGUF computes what transformers computes on the checkpoint it came from; quantised, what
transformers computes on the same GGUF. The real model, SmolLM2-135M-Instruct's Q4_1 GGUF, is
the oracle's own case: greedy tokens equal transformers' on the same file, perplexity within
0.5% of it, weights held in the file's formats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import cli
from gguf_files import write_gguf
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.gguf import GGUFFile
from pagechat.core.loader import read_spec
from pagechat.core.memory import weight_report
from pagechat.core.params import SamplingParams
from pagechat.quant.evaluate import perplexity
from pagechat.tools.planner import estimate_gguf_weights
from transformers import AutoModelForCausalLM

F32 = EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", kv_blocks=64)
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "qkv_bias",
    "o_bias", "mlp_bias", "qk_norm",
)  # fmt: skip
IDS = [[5, 17, 42, 7, 99, 3, 64, 12], [8, 21, 33, 2, 150, 71]]
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_models, tmp_path_factory) -> dict:
    """arch -> an F32 GGUF of the tiny random checkpoint, in a folder of its own."""
    root = tmp_path_factory.mktemp("gguf")
    return {a: write_gguf(d, root / a / f"{a}.gguf") for a, d in tiny_models.items()}


def hf_logits(model_dir: Path, ids: list[int], **kw) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_an_f32_gguf_runs_as_the_checkpoint_it_was_written_from(arch, tiny_models, tiny_ggufs):
    """Sizes, biases, norms, tying and rope (the tiny llama's llama3 scaling, which the file keeps
    as rope_freqs) from the GGUF's metadata; q/k rows put back in the checkpoint's order."""
    hf, gguf = read_spec(tiny_models[arch]), read_spec(tiny_ggufs[arch])
    assert {f: getattr(gguf, f) for f in SHAPE_FIELDS} == {f: getattr(hf, f) for f in SHAPE_FIELDS}
    assert gguf.quantization is None and gguf.torch_dtype == "float32"
    e = Engine(tiny_ggufs[arch], F32)
    for ids in IDS:
        want = hf_logits(tiny_models[arch], ids)
        assert torch.allclose(e.runner.score(ids), want, atol=1e-4, rtol=1e-4)
    ref = Engine(tiny_models[arch], F32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [o.output_ids for o in e.generate(IDS, params)] == [
        o.output_ids for o in ref.generate(IDS, params)
    ]
    text = "Hello <|im_end|> world, 123"  # the file's tokenizer: the checkpoint's
    assert e.tokenizer(text).input_ids == ref.tokenizer(text).input_ids
    assert e.requests.encode("Hi", chat=True) == ref.requests.encode("Hi", chat=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_a_quantised_gguf_computes_what_transformers_computes_on_the_same_file(
    qtype, tiny_models, tmp_path
):
    """Every weight in qtype: kept as stored (Q8_0, Q4_0, Q4_1) or requantised (Q5_1 -> int8),
    the engine's logits on the file are transformers' (which dequantises it to float32) up to
    the kernels' rounding of the activations and, for Q5_1, the requantisation."""
    model_dir = tiny_models["qwen2"]  # transformers reads its metadata whole (module docstring)
    path = write_gguf(model_dir, tmp_path / f"m-{qtype}.gguf", default=qtype)
    e = Engine(path, F32)
    assert e.spec.quantization["types"].keys() == {qtype, "F32"}
    formats = {r.fmt for r in weight_report(e.model).rows if r.kind in ("attention", "mlp")}
    assert formats == {qtype if qtype != "Q5_1" else "Q5_1→int8"}
    for ids in IDS:
        want = hf_logits(tmp_path, ids, gguf_file=path.name)
        got = e.runner.score(ids)
        assert (got - want).norm() / want.norm() < (2e-2 if qtype == "Q5_1" else 1e-3)


def test_the_planner_says_what_a_loaded_gguf_holds(tiny_models, tmp_path):
    model_dir = tiny_models["qwen2"]  # biases: a fused layer's bias counted with it
    path = write_gguf(model_dir, tmp_path / "m.gguf", {"attention": "Q4_0", "mlp": "Q4_1"}, "Q8_0")
    for dtype in ("float32", "bfloat16"):
        e = Engine(path, EngineConfig(device="cpu", dtype=dtype, kv_blocks=8))
        with GGUFFile(path) as f:
            assert estimate_gguf_weights(f, e.dtype, "cpu") == weight_report(e.model)


def test_cli_commands_take_a_gguf_and_refuse_what_does_not_apply(
    tiny_models, tiny_ggufs, capsys, tmp_path
):
    gguf = str(tiny_ggufs["llama"])
    argv = ["generate", "-p", "The cat", "--max-tokens", "8", "--dtype", "float32"]
    code, out, _ = cli([argv[0], gguf, *argv[1:]], capsys)
    assert code in (None, 0)
    code, want, _ = cli([argv[0], str(tiny_models["llama"]), *argv[1:]], capsys)
    assert out == want  # the same greedy text as the checkpoint's
    # a folder holding one GGUF names it
    code, out, _ = cli([argv[0], str(Path(gguf).parent), *argv[1:]], capsys)
    assert out == want
    code, out, err = cli(["plan", gguf, "--gpu-memory", "1GiB"], capsys)
    assert code in (None, 0) and "KV blocks" in out, err
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 20)
    code, out, err = cli(["eval", gguf, "--text", str(text), "--dtype", "float32"], capsys)
    assert code in (None, 0) and out.startswith("perplexity "), err
    code, _, err = cli(["generate", gguf, "-p", "x", "--quant", "int8-wo"], capsys)
    assert code in (None, 0), err  # an all-float file takes --quant as a checkpoint does
    q8 = write_gguf(tiny_models["llama"], tmp_path / "q8.gguf", default="Q8_0")
    code, _, err = cli(["generate", str(q8), "-p", "x", "--quant", "int8-wo"], capsys)
    assert code == 2 and "its tensors are quantised as the file stores them" in err
    code, _, err = cli(["quantize", str(q8), str(tmp_path / "out")], capsys)
    assert code == 2 and "is a GGUF model" in err
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(Path(gguf).read_bytes())
    code, _, err = cli(["generate", str(two), "-p", "x"], capsys)
    assert code == 2 and "holds 2 GGUF models" in err


def test_a_split_gguf_loads_as_one(tiny_models, tmp_path):
    """A model in two files (llama.cpp's gguf-split names: -00001-of-00002.gguf) loads from its
    first part as the whole file does; a missing part is named."""
    import gguf

    whole = write_gguf(tiny_models["qwen3"], tmp_path / "whole.gguf")
    reader = gguf.GGUFReader(whole)
    names = [t.name for t in reader.tensors]
    half = len(names) // 2
    parts = [tmp_path / f"m-0000{i}-of-00002.gguf" for i in (1, 2)]
    for i, (path, chunk) in enumerate(zip(parts, (names[:half], names[half:]))):
        w = gguf.GGUFWriter(path, arch="qwen3")
        if i == 0:  # the metadata lives in the first part
            for field in reader.fields.values():
                if not field.name.startswith(("GGUF.", "general.architecture")):
                    _copy_field(w, field)
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", 2)
        for t in reader.tensors:
            if t.name in chunk:
                w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    e, ref = Engine(parts[1], F32), Engine(whole, F32)
    assert torch.equal(e.runner.score(IDS[0]), ref.runner.score(IDS[0]))
    parts[1].unlink()
    with pytest.raises(Exception, match="m-00002-of-00002.gguf is missing"):
        Engine(parts[0], F32)


def _copy_field(w, field) -> None:
    """One metadata field of a GGUFReader into a GGUFWriter, as it was typed."""
    import gguf

    value = field.contents()
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_array(field.name, value)
    else:
        w.add_key_value(field.name, value, vtype)


# -- the real model -------------------------------------------------------------------------------

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def smol_engine(smollm2) -> Engine:
    return Engine(smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf", F32)


@pytest.fixture(scope="module")
def smol_hf(smollm2):
    """transformers' own reading of the same file, dequantised to float32."""
    return AutoModelForCausalLM.from_pretrained(
        smollm2, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()


def test_smollm2_greedy_tokens_equal_transformers_on_the_same_file(smol_engine, smol_hf):
    e = smol_engine
    prompts = [e.requests.encode(p, chat=True) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    smol_hf.generation_config.eos_token_id = None  # as ignore_eos: every token a plain one
    for ids, out in zip(prompts, e.generate(prompts, params)):
        x = torch.tensor([ids])  # its mask given: the prompt holds the pad id, <|im_end|>
        want = smol_hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False
        )
        assert out.output_ids == want[0, len(ids) :].tolist()
    [paris] = e.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in paris.text and paris.finish_reason == "stop"


def test_smollm2_perplexity_within_half_a_percent_of_transformers(smol_engine, smol_hf, smollm2):
    ids = smol_engine.tokenizer((smollm2 / "LICENSE").read_text()).input_ids[:512]
    ours = perplexity(smol_engine, ids, window=512)
    with torch.no_grad():
        logits = smol_hf(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert abs(ours.nll - nll) / nll < 0.005 and ours.tokens == 511


def test_smollm2_keeps_the_files_formats_and_lets_go_of_the_file(smol_engine, smollm2):
    """Weights held as the file stores them (within 1.3x its tensor bytes: no 16-bit copy), the
    planner's figure exact, and no page of the file left mapped once the model is loaded."""
    path = smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf"
    report = weight_report(smol_engine.model)
    with GGUFFile(path) as f:
        tensor_bytes = sum(t.nbytes for t in f.tensors.values())
        assert estimate_gguf_weights(f, smol_engine.dtype, "cpu") == report
    assert report.total <= 1.3 * tensor_bytes
    assert {r.fmt for r in report.rows if r.bytes} == {"Q8_0", "Q4_1", "float32"}
    assert str(path) not in Path("/proc/self/maps").read_text()


def test_smollm2_answers_through_the_cli(smollm2, capsys):
    path = str(smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf")
    argv = ["generate", path, "--chat", "-p", "What is the capital of France?", "--json"]
    code, out, err = cli([*argv, "--max-tokens", "24"], capsys)
    assert code in (None, 0), err
    [result] = json.loads(out)["results"]
    assert re.search(r"\bParis\b", result["text"])


def test_serve_answers_from_a_gguf_as_from_its_checkpoint(tiny_models, tiny_ggufs):
    """The server names a GGUF model by its file (without .gguf) and answers with the tokenizer and
    chat template the file carries: the checkpoint's greedy text, through the openai client."""
    import openai
    from drive import listening
    from pagechat.server.app import create_app
    from pagechat.server.serve import ServerSettings, build_state

    engine = Engine(tiny_ggufs["qwen2"], F32)
    [want] = Engine(tiny_models["qwen2"], F32).generate(
        [engine.requests.encode_chat(HELLO)], SamplingParams(temperature=0.0, max_tokens=12)
    )
    with listening(create_app(build_state(engine, ServerSettings()))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["qwen2"]
        got = client.chat.completions.create(
            model="qwen2", messages=HELLO, temperature=0, max_tokens=12
        )
    assert got.choices[0].message.content == want.text
