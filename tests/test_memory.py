"""Memory accounting: the engine's weight report equals the real tensors' bytes, config-only
estimates equal the report, and `plan` turns a budget into KV blocks and concurrent sequences."""

from __future__ import annotations

import pytest
import torch
from conftest import cli
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.kv import block_bytes
from pagechat.core.memory import kv_bytes_per_token, weight_report
from pagechat.core.params import SamplingParams
from pagechat.quant import kernels
from pagechat.quant.checkpoint import quantize_checkpoint
from pagechat.quant.head import head_format
from pagechat.quant.layers import INT4_KERNEL_PATH
from pagechat.tools.planner import estimate_weights, plan_capacity


def unique_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer storage the model holds (once each), not rope tables."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in ("cos", "sin") or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.nbytes
    return total


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3"]
)  # untied; tied with qkv bias; tied with q/k norm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_report_equals_the_tensors_and_the_estimate(tiny_models, arch, dtype):
    e = Engine(tiny_models[arch], EngineConfig(dtype=dtype, kv_blocks=8))
    rep = weight_report(e.model)
    assert rep.total == unique_bytes(e.model)
    assert rep == estimate_weights(e.spec, None, e.dtype, device_type="cpu")
    lm = [r for r in rep.rows if r.kind == "lm_head"]
    assert (lm[0].fmt == "tied to embedding" and lm[0].bytes == 0) == e.spec.tie_word_embeddings
    assert sum(rep.by_kind().values()) == rep.total


@pytest.mark.parametrize("mode", ["int8", "int8-wo"])
def test_quantised_reports_count_scales_too(tiny_llama, mode):
    e = Engine(tiny_llama, EngineConfig(dtype="float32", kv_blocks=8, quant=mode))
    e.generate([[5, 6, 7]])  # bnb moves its row scales into the layer state on the first call
    rep = weight_report(e.model)
    assert rep.total == estimate_weights(e.spec, mode, e.dtype, device_type="cpu").total
    rows = {r.kind: r for r in rep.rows}
    h, kv, d, hid, inter = 4, 2, 16, 64, 128
    n_k = [((h + 2 * kv) * d, hid), (hid, h * d), (2 * inter, hid), (hid, inter)]
    scale = 4 if mode == "int8" else 2  # fp32 SCB vs bf16 scales
    linear = 2 * sum(n * k + scale * n for n, k in n_k)
    assert rows["attention"].bytes + rows["mlp"].bytes == linear
    assert rows["embedding"].fmt == "float32"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied; tied
def test_weight_only_modes_keep_lm_head_in_bf16(tiny_models, arch):
    e = Engine(tiny_models[arch], EngineConfig(dtype="float32", kv_blocks=8, quant="bf16-wo"))
    rep = weight_report(e.model)
    assert rep == estimate_weights(e.spec, "bf16-wo", e.dtype, device_type="cpu")
    assert rep.total == unique_bytes(e.model)
    rows, table = {r.kind: r for r in rep.rows}, e.spec.vocab_size * e.spec.hidden_size
    if e.spec.tie_word_embeddings:  # one bf16 table for both
        assert (rows["embedding"].fmt, rows["embedding"].bytes, rows["lm_head"].bytes) == (
            "bfloat16",
            2 * table,
            0,
        )
    else:
        assert (rows["embedding"].fmt, rows["lm_head"].fmt, rows["lm_head"].bytes) == (
            "float32",
            "bf16-wo",
            2 * table,
        )
    assert (
        len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].output_ids)
        == 4
    )


# pagechat's int4 kernel where it builds, else torch's; neither takes g16
@pytest.mark.parametrize("group,path", [(64, "kernel"), (16, "dequant")])
def test_awq_report_and_estimate_agree(tiny_llama, tmp_path, group, path):
    if path == "kernel":
        path = INT4_KERNEL_PATH if kernels.loaded() else "int4pack-cpu"
    out = quantize_checkpoint(tiny_llama, tmp_path / "awq", "rtn", group).out_dir
    e = Engine(out, EngineConfig(dtype="float32", kv_blocks=8))
    rep = weight_report(e.model)
    assert rep == estimate_weights(e.spec, "awq", e.dtype, group, "cpu")
    assert rep.total == unique_bytes(e.model)
    assert {r.path for r in rep.rows if r.kind in ("attention", "mlp")} == {path}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied; tied
@pytest.mark.parametrize("lm_head", ["auto", "int8", "int4", "float"])
@pytest.mark.parametrize("quant", [None, "int8-wo"])
def test_weight_report_equals_the_estimate_for_each_head(tiny_models, arch, lm_head, quant):
    e = Engine(
        tiny_models[arch], EngineConfig(dtype="float32", kv_blocks=8, quant=quant, lm_head=lm_head)
    )
    rep = weight_report(e.model)
    assert rep == estimate_weights(e.spec, quant, e.dtype, None, "cpu", lm_head)
    assert rep.total == unique_bytes(e.model)  # a tied table once, the int4 row tables too
    fmt = head_format(lm_head, quant, e.dtype)
    want = {"int8": "int8-wo", "int4": "awq-int4 g32", "bf16": "bfloat16", "dense": "float32"}
    assert rep.head.fmt == want[fmt] or (fmt == "bf16" and rep.head.fmt == "bf16-wo")
    assert rep.head_label.endswith("tied to the embedding") == e.spec.tie_word_embeddings


def test_torchs_int4_layout_tables_are_counted(tiny_models, monkeypatch):
    monkeypatch.setattr(kernels, "loaded", lambda: False)  # torch's int4 kernel, as without g++
    e = Engine(tiny_models["qwen3"], EngineConfig(dtype="float32", kv_blocks=8, lm_head="int4"))
    rep = weight_report(e.model)
    assert rep.head.path == "int4pack-cpu"
    assert rep == estimate_weights(e.spec, None, e.dtype, None, "cpu", "int4")
    assert rep.total == unique_bytes(e.model)
    n, k = e.spec.vocab_size, e.spec.hidden_size
    assert rep.head.bytes == n * k // 2 + 4 * n * (k // 32) + 10 * n


def test_kv_figures_match_the_pool(tiny_llama):
    e = Engine(tiny_llama, EngineConfig(dtype="float32", kv_blocks=8))
    per_token = kv_bytes_per_token(e.spec, e.kv_dtype)
    assert per_token * e.blocks.block_size * e.blocks.num_blocks == e.pool.nbytes
    assert per_token * 16 == block_bytes(e.spec, 16, e.kv_dtype)


def test_plan_capacity_arithmetic(tiny_llama):
    from pagechat.core.loader import read_spec

    spec = read_spec(tiny_llama)
    w = estimate_weights(spec, None, torch.float16)
    cap = plan_capacity(spec, w, torch.float16, budget=10 * 2**20, context=100, block_size=16)
    per_block = 2 * 2 * 16 * 2 * 16 * 2  # layers x (K, V) x block x kv heads x head_dim x fp16
    assert cap.kv_per_block == per_block
    assert cap.num_blocks == int((10 * 2**20 - w.total) * 0.8) // per_block
    assert cap.max_seqs == cap.num_blocks // 7  # 100 tokens need 7 blocks
    assert cap.concurrency == pytest.approx(cap.num_blocks * 16 / 100)


def test_plan_command(tiny_llama, capsys):
    code, out, _ = cli(
        ["plan", str(tiny_llama), "--gpu-memory", "1GiB", "--context", "256"], capsys
    )
    assert code in (None, 0)
    assert "# KV blocks:" in out and "Maximum concurrency for 256 tokens per request" in out
    code, out, _ = cli(["plan", str(tiny_llama), "--quant", "awq", "--group-size", "64"], capsys)
    assert "awq-int4 g64" in out and "after pagechat quantize" in out
    code, _, err = cli(["plan", str(tiny_llama), "--context", "100000"], capsys)
    assert code == 2 and "--context 100000" in err
    code, _, err = cli(["plan", str(tiny_llama), "--gpu-memory", "lots"], capsys)
    assert code == 2 and "cannot read 'lots' as a size" in err


@pytest.mark.parametrize("mode", ["int8-wo", "awq"])
def test_estimate_counts_the_rows_the_kernels_pad(mode):
    """37 rows: in the int kernels' panels (a CPU with AVX512-VNNI), 48 are stored."""
    from pagechat.quant.layers import Int4Linear, Int8WOLinear
    from pagechat.quant.pack import quantize_groups
    from pagechat.tools.planner import _linear_bytes

    n, k, cpu = 37, 64, torch.device("cpu")
    w = torch.randn(n, k)
    if mode == "int8-wo":
        layer = Int8WOLinear.from_float(w, None, cpu)
    else:
        q, z, s = (t.t() for t in quantize_groups(w, 32))
        layer = Int4Linear(q, z, s.half(), None, 32, cpu)
    stored = sum(t.nbytes for t in layer.buffers())
    assert _linear_bytes(n, k, False, mode, 4, 32, "cpu")[2] == stored
    panels = mode == "awq" or kernels.INT8_PANELS  # int4 is in panels on every CPU
    rows = 48 if panels and kernels.loaded() else n
    assert stored >= rows * k // (2 if mode == "awq" else 1)
