"""The LM head's formats (--lm-head, quant/head.py): int8 and 4-bit heads against a dequantise-then-
matmul reference, a tied embedding that reads the head's own table, the default per --quant mode,
the refusals, the memory figures and `pagechat eval`'s comparison with a float head."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import cli
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.quant import kernels
from pagechat.quant.checkpoint import quantize_checkpoint
from pagechat.quant.head import (
    Int4Head,
    Int8Head,
    check_int4_tie,
    check_lm_head,
    head_format,
)
from pagechat.quant.layers import INT4_KERNEL_PATH
from pagechat.quant.pack import dequantize, quantize_groups

CPU = torch.device("cpu")
# 1040 rows: 16 full blocks of 64 (AVX512) or 32 (AVX2) rows in torch's int4 packing, and a 16-row
# tail block that torch packs differently
N, K = 1040, 96
INT4_PATHS = [INT4_KERNEL_PATH, "int4pack-cpu"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def int4_table(w: torch.Tensor, path: str) -> torch.Tensor:
    """The weights [N, K] a 4-bit head of w computes with: (q - z) * s from the stored fp16 scales;
    torch's kernel takes bf16 scale and zero, w = (q - 8) * scale + (8 - z) * scale."""
    q, z, s = quantize_groups(w, 32)
    s = s.half().float()
    if path != "int4pack-cpu":
        return dequantize(q.t(), z.t(), s.t(), 32).t()
    scale, zero = s.bfloat16().float(), ((8 - z.float()) * s).bfloat16().float()
    grouped = q.float().view(w.shape[0], -1, 32) - 8
    return (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view_as(w)


def int4_head(w: torch.Tensor, path: str) -> Int4Head:
    """A 4-bit head of w on the given kernel path: pagechat's, or torch's (where g++ is missing)."""
    if path == INT4_KERNEL_PATH and not kernels.loaded():
        pytest.skip("pagechat's kernels do not build here")
    q, z, s = (x.t().contiguous() for x in quantize_groups(w, 32))
    head = Int4Head(q, z, s.half(), None, 32, CPU, path=path)
    auto = Int4Head.from_float(w, CPU)  # what the engine builds: the same tensors
    assert auto.path in INT4_PATHS
    return head


def test_int8_head_logits_and_tied_rows_are_the_dequantised_table():
    torch.manual_seed(0)
    w, x = torch.randn(N, K), torch.randn(5, K)
    head = Int8Head.from_float(w, None, CPU)
    q = kernels.int8_rows(head.weight)[:N]  # from the kernel's panels, where in them
    table = q.float() * head.scales[:N].float().unsqueeze(1)
    assert rel(table, w) < 1e-2  # a scale per row
    # int8 activations per block of 32 in pagechat's kernel, bf16 in torch's int8pack
    assert rel(head(x), x @ table.t()) < 1e-2
    emb, ids = head.embedding(), torch.tensor([0, 1039, 5, 5, 640])
    assert torch.equal(emb(ids), table[ids])
    assert emb.weight.data_ptr() == head.weight.data_ptr()  # the head's table, not a copy


@pytest.mark.parametrize("path", INT4_PATHS)
def test_int4_head_logits_and_tied_rows_are_the_dequantised_table(path):
    torch.manual_seed(0)
    w, x = torch.randn(N, K), torch.randn(5, K)
    head, table = int4_head(w, path), int4_table(w, path)
    assert rel(table, w) < 0.15  # 4 bits: the reference itself is coarse, the kernels are not
    # pagechat's kernel: int16 activations per block; torch's: bf16 activations
    assert rel(head(x), x @ table.t()) < (1e-3 if path == INT4_KERNEL_PATH else 1e-2)
    emb = head.embedding()
    assert torch.equal(emb(torch.arange(N)), table)  # every row, the tail block's too
    ids = torch.tensor([1039, 0, 7, 7])
    assert torch.equal(emb(ids), table[ids])
    held = {t.data_ptr() for t in emb.buffers()}
    assert {t.data_ptr() for t in head.buffers()} <= held  # the head's tensors, not copies


def test_a_tied_int4_head_is_refused_where_its_rows_cannot_be_read():
    check_int4_tie("int4pack-cpu")
    with pytest.raises(PagechatError, match="--lm-head int4 cannot share .* int4pack-cuda"):
        check_int4_tie("int4pack-cuda")


def test_the_default_head_per_mode():
    f32, bf16 = torch.float32, torch.bfloat16
    assert [head_format("auto", m, f32) for m in (None, "int8", "int8-wo", "awq", "bf16-wo")] == [
        "dense",
        "int8",
        "int8",
        "int8",
        "bf16",
    ]
    assert head_format("auto", "int8-wo", bf16) == "int8"
    assert head_format("auto", "bf16-wo", bf16) == "dense"
    assert head_format("float", "int8-wo", f32) == "bf16"  # as before quantised heads
    assert head_format("float", "awq", bf16) == "dense"
    assert head_format("int4", None, f32) == "int4"


@pytest.fixture(scope="module")
def rtn(tiny_models, tmp_path_factory):
    """The tied tiny qwen3, quantised to AWQ 4-bit."""
    out = tmp_path_factory.mktemp("head") / "rtn"
    return quantize_checkpoint(tiny_models["qwen3"], out, "rtn", 32).out_dir


def engine(path, **kw) -> Engine:
    return Engine(path, EngineConfig(dtype="float32", kv_blocks=16, **kw))


def test_engines_build_the_head_each_mode_asks_for(tiny_models, rtn):
    qwen3 = tiny_models["qwen3"]
    dense = "FloatLinear" if kernels.loaded() else "Linear"  # a float head on pagechat's kernel
    for path, kw, cls in (
        (qwen3, {}, dense),
        (qwen3, {"quant": "int8-wo"}, "Int8Head"),
        (qwen3, {"quant": "int8"}, "Int8Head"),
        (qwen3, {"quant": "bf16-wo"}, "Bf16Head"),
        (rtn, {}, "Int8Head"),
        (rtn, {"lm_head": "int4"}, "Int4Head"),
        (qwen3, {"quant": "int8-wo", "lm_head": "float"}, "Bf16Head"),
        (qwen3, {"lm_head": "int8"}, "Int8Head"),  # a float model with a quantised head
    ):
        e = engine(path, **kw)
        assert type(e.model.lm_head).__name__ == cls, (path, kw)
        out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.output_ids) == 3


@pytest.mark.parametrize("lm_head", ["int8", "int4"])
def test_a_tied_embedding_looks_up_the_heads_table(tiny_models, lm_head):
    e = engine(tiny_models["qwen3"], lm_head=lm_head)
    head, emb = e.model.lm_head, e.model.embed_tokens
    ids = torch.tensor([3, 1023, 3, 500])
    table = emb(torch.arange(e.spec.vocab_size))
    assert torch.equal(emb(ids), table[ids])
    x = torch.randn(2, e.spec.hidden_size)
    assert rel(head(x), x @ table.t()) < 1e-2  # the head computes with the same table
    held = {t.data_ptr() for t in emb.buffers()}
    assert {t.data_ptr() for t in head.buffers()} <= held  # one table, not two


def test_an_untied_embedding_stays_float(tiny_models):
    e = engine(tiny_models["llama"], lm_head="int8")
    assert type(e.model.lm_head).__name__ == "Int8Head"
    assert type(e.model.embed_tokens).__name__ == "Embedding"
    assert e.model.embed_tokens.weight.dtype == torch.float32


def test_impossible_heads_are_refused(tiny_models, monkeypatch):
    spec = engine(tiny_models["qwen3"]).spec
    with pytest.raises(PagechatError, match="^--lm-head must be auto, int8, int4 or float"):
        EngineConfig(lm_head="int2").validate()
    with pytest.raises(PagechatError, match="hidden_size a multiple of 32 .* has 48 and 1024"):
        check_lm_head("int4", dataclasses.replace(spec, hidden_size=48), "x/config.json")
    check_lm_head("int8", dataclasses.replace(spec, hidden_size=48), "x/config.json")
    monkeypatch.setattr("pagechat.core.quantization.backend", lambda: None)
    monkeypatch.setattr("pagechat.core.config.backend", lambda: None)
    with pytest.raises(PagechatError, match="^--lm-head int8 needs pagechat.quant"):
        EngineConfig(lm_head="int8").validate()
    EngineConfig(lm_head="float").validate()


def test_commands_refuse_impossible_heads_in_one_line(tiny_models, capsys):
    qwen3 = str(tiny_models["qwen3"])
    code, _, err = cli(["generate", qwen3, "-p", "hi", "--lm-head", "int2"], capsys)
    assert code == 2 and "--lm-head must be auto, int8, int4 or float, got 'int2'" in err
    code, _, err = cli(["plan", qwen3, "--lm-head", "int4"], capsys)  # planned for CUDA
    assert code == 2 and "--lm-head int4 cannot share" in err
    code, out, _ = cli(["plan", qwen3, "--quant", "int8-wo"], capsys)
    assert "lm_head int8 weight-only, a scale per row (int8-wo, tied to the embedding)" in out


def test_eval_compares_a_quantised_head_with_a_float_one(tiny_models, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The KV cache keeps keys and values of earlier tokens. " * 8)
    args = ["eval", str(tiny_models["qwen3"]), "--text", str(text), "--dtype", "float32"]
    code, out, _ = cli([*args, "--quant", "int8-wo", "--seqlen", "32"], capsys)
    assert code in (None, 0)
    lines = out.strip().splitlines()
    assert len(lines) == 3
    assert "lm_head int8-wo, tied to the embedding" in lines[0]
    assert "lm_head bfloat16, tied to the embedding" in lines[1]  # --lm-head float of int8-wo
    assert lines[2].startswith(
        "the int8 lm_head (and the tied embedding) vs a float one: perplexity "
    )
    code, out, _ = cli([*args, "--lm-head", "float"], capsys)
    assert code in (None, 0) and len(out.strip().splitlines()) == 1
