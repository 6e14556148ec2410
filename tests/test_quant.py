"""Quantisation: AWQ packing and layers, int8 layers, the quantize / eval / plan commands, errors.

Checkpoints are made here with transformers' own classes at hidden 128 (torch's int4 kernel wants
N % 16); the tokenizer is the tiny llama fixture's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import cli
from pagechat.core import native as native_mod
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.memory import weight_report
from pagechat.core.model import dense_head
from pagechat.core.params import SamplingParams
from pagechat.quant import layers as qlayers
from pagechat.quant.awq import BlockRunner, fold_scales, load_block, search_scales
from pagechat.quant.checkpoint import quantize_checkpoint
from pagechat.quant.evaluate import perplexity
from pagechat.quant.layers import Bf16WOLinear, Int4Linear, Int8WOLinear, bnb_int8_linear
from pagechat.quant.loaders import QuantPlan
from pagechat.quant.pack import AWQ_ORDER, dequantize, fake_quantize, pack_awq, to_awq, unpack_awq
from pagechat.tools.demo.corpus import calibration_texts
from pagechat.tools.planner import estimate_weights
from safetensors.torch import load_file, save_file
from torch import nn

CPU = torch.device("cpu")


def make_checkpoint(out, tokenizer_dir, arch="llama", kv_heads=2, seed=0, **extra):
    """A random hidden-128 checkpoint of arch, saved by transformers, with the tiny tokenizer."""
    shutil.copytree(
        tokenizer_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json")
    )
    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[arch]
    cfg = getattr(transformers, cls[0])(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        eos_token_id=[2, 0],
        pad_token_id=0,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    getattr(transformers, cls[1])(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_llama):
    return make_checkpoint(tmp_path_factory.mktemp("q") / "llama", tiny_llama)


@pytest.fixture(scope="module")
def rtn(llama, tmp_path_factory):
    return quantize_checkpoint(llama, tmp_path_factory.mktemp("q") / "rtn", "rtn", 128).out_dir


def engine(path, **kw) -> Engine:
    kw.setdefault("kv_dtype", "float32")  # transformers' float32 cache is the oracle
    return Engine(path, EngineConfig(kv_blocks=64, dtype=kw.pop("dtype", "float32"), **kw))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- packing ---------------------------------------------------------------------------------------


def test_pack_unpack_round_trip_is_exact_and_uses_awq_order():
    q = torch.randint(0, 16, (64, 48))
    q[0, :8] = 15  # top nibble set: the word is negative as int32
    packed = pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (64, 6) and (packed < 0).any()
    assert torch.equal(unpack_awq(packed).long(), q)
    word = packed[3, 2].item() & 0xFFFFFFFF
    assert [(word >> 4 * i) & 0xF for i in range(8)] == [
        q[3, 16 + AWQ_ORDER[i]].item() for i in range(8)
    ]


def test_to_awq_dequantises_to_the_fake_quantised_weight():
    w = torch.randn(96, 256)
    t = to_awq(w, 128)
    assert (
        t["qweight"].shape == (256, 12)
        and t["qzeros"].shape == (2, 12)
        and t["scales"].shape == (2, 96)
    )
    deq = dequantize(unpack_awq(t["qweight"]), unpack_awq(t["qzeros"]), t["scales"], 128).t()
    assert (
        rel(deq, fake_quantize(w, 128)) < 1e-2
    )  # differs only where fp16 scales move a value across a level
    assert (deq - w).abs().max() <= (w.max() - w.min()) / 15  # within one quantisation step


# -- layers ----------------------------------------------------------------------------------------


def awq_layer_inputs(k=256, n=96, group=128, seed=0):
    torch.manual_seed(seed)
    t = to_awq(torch.randn(n, k) * 0.05, group)
    return unpack_awq(t["qweight"]), unpack_awq(t["qzeros"]), t["scales"]


def test_awq_layer_matches_matmul_with_dequantised_weights():
    q, z, s = awq_layer_inputs()
    bias = torch.randn(96)
    x = torch.randn(2, 5, 256)
    ref = x @ dequantize(q, z, s, 128) + bias
    fast = Int4Linear(q, z, s, bias, 128, CPU)
    # pagechat's kernel where it builds (tests/test_kernels.py), else torch's int4pack
    assert fast.path in (qlayers.INT4_KERNEL_PATH, "int4pack-cpu")
    assert rel(fast(x), ref) <= (1e-4 if fast.path == qlayers.INT4_KERNEL_PATH else 5e-3)
    torch_int4 = Int4Linear(q, z, s, bias, 128, CPU, path="int4pack-cpu")
    assert rel(torch_int4(x), ref) <= 5e-3  # bf16 activations around torch's int4 kernel
    slow = Int4Linear(q, z, s, bias, 128, CPU, path="dequant")
    assert rel(slow(x), ref) <= 1e-5  # the fp32 fallback
    assert fast(x).dtype == x.dtype and fast(x).shape == (2, 5, 96)


def test_awq_path_falls_back_where_the_kernel_does_not_fit(monkeypatch):
    monkeypatch.setattr(qlayers.kernels, "loaded", lambda: False)  # torch's kernels only
    assert qlayers.awq_path(96, 256, 128, CPU) == "int4pack-cpu"
    assert qlayers.awq_path(40, 256, 128, CPU) == "dequant"  # N % 16 != 0
    assert qlayers.awq_path(96, 192, 96, CPU) == "dequant"  # group size the kernel lacks
    q, z, s = awq_layer_inputs(k=192, n=40, group=64)
    layer = Int4Linear(q, z, s, None, 64, CPU)
    assert layer.path == "int4pack-cpu" or layer.path == "dequant"
    x = torch.randn(3, 192)
    assert (
        rel(Int4Linear(q, z, s, None, 64, CPU, path="dequant")(x), x @ dequantize(q, z, s, 64))
        <= 1e-5
    )


def test_int8_weight_only_layer():
    w = torch.randn(96, 256)
    layer = Int8WOLinear.from_float(w, None, CPU)
    # pagechat's kernel where it builds (tests/test_kernels.py), else torch's int8pack
    assert layer.path in (f"{qlayers.kernels.INT8_PATH} <= 16 rows, else GEMM", "int8pack-cpu")
    assert layer.weight.dtype == torch.int8
    x = torch.randn(4, 256)
    q = qlayers.kernels.int8_rows(layer.weight)  # from the kernel's panels, where in them
    deq = q.float() * layer.scales.float().unsqueeze(1)
    assert rel(layer(x), x @ deq.t()) <= 5e-3
    slow = Int8WOLinear(q, layer.scales.float(), None, CPU, path="dequant")
    assert rel(slow(x), x @ deq.t()) <= 1e-5
    assert rel(layer(x), x @ w.t()) < 2e-2


def test_bnb_int8_layer_is_llm_int8_in_eval_mode_and_handles_outliers():
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    layer = bnb_int8_linear(None, CPU, weight=w.clone())
    assert not layer.training and layer.state.threshold == 6.0 and layer.weight.dtype == torch.int8
    x = torch.randn(4, 256)
    x[:, 7] = 40.0  # an outlier column: LLM.int8 runs it in fp16 instead of int8
    with torch.inference_mode():
        assert rel(layer(x), x @ w.t()) < 2e-2


# -- engine integration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,cls", [("int8", "Linear8bitLt"), ("int8-wo", "Int8WOLinear"), ("bf16-wo", "Bf16WOLinear")]
)
def test_quant_modes_swap_every_decoder_linear_and_the_head(llama, mode, cls):
    e = engine(llama, quant=mode)
    layer = e.model.layers[0]
    for lin in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert type(lin).__name__ == cls
    head, emb = e.model.lm_head, e.model.embed_tokens.weight
    # quantised modes quantise the head too (tests/test_lm_head.py); a float32 model's bf16-wo
    # keeps it in bf16, where a tied embedding would read the same table (test_memory checks it)
    assert type(head).__name__ == ("Bf16Head" if mode == "bf16-wo" else "Int8Head")
    assert not e.spec.tie_word_embeddings and emb.dtype == torch.float32
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.output_ids) == 6
    rep = weight_report(e.model)
    assert rep.total == estimate_weights(e.spec, mode, e.dtype, None, "cpu").total


@pytest.fixture(scope="module")
def llama_bf16(llama, tmp_path_factory):
    """The same checkpoint stored in bfloat16, as most published checkpoints are."""
    out = tmp_path_factory.mktemp("q") / "bf16"
    shutil.copytree(llama, out)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in load_file(out / "model.safetensors").items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    _edit_config(out, lambda c: c.update(torch_dtype="bfloat16", dtype="bfloat16"))
    return out


@pytest.mark.parametrize(
    "flags, torch_says, native",
    [
        # AVX512 without BF16 (a Xeon whose hypervisor hides it; Skylake to Ice Lake): torch's
        # check says yes, where oneDNN only emulates bf16
        ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, True, False),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, True, True),
        ({"avx2", "avx512f", "avx512bw", "amx_tile", "amx_bf16"}, True, True),
        ({"avx2", "fma", "f16c"}, False, False),
        (None, True, True),  # no x86 flags (another OS, ARM): torch's check decides
        (None, False, False),
    ],
)
def test_native_bf16_needs_the_cpus_bf16_instructions_not_only_avx512(
    monkeypatch, flags, torch_says, native
):
    monkeypatch.setattr(native_mod, "cpu_flags", lambda: flags and frozenset(flags))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: torch_says)
    native_mod.cpu_has_native_bf16.cache_clear()
    try:
        assert native_mod.cpu_has_native_bf16() is native
    finally:
        native_mod.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize("native", [False, True])
def test_auto_dtype_keeps_a_bf16_checkpoint_in_bf16_weights_only_where_the_cpu_lacks_bf16(
    llama_bf16, llama, monkeypatch, native
):
    monkeypatch.setattr("pagechat.core.checkpoint.cpu_has_native_bf16", lambda: native)
    e = Engine(llama_bf16, EngineConfig(kv_blocks=64, draft=str(llama_bf16)))
    qkv = e.model.layers[0].self_attn.qkv_proj
    if native:  # bf16 throughout, no weight-only mode
        # a dense bf16 layer (on pagechat's float kernel for decode rows where it builds)
        assert e.quant.mode is None and e.dtype == torch.bfloat16 and isinstance(qkv, nn.Linear)
        assert not hasattr(qkv, "quant_format")
        assert e.precision == "bfloat16"
    else:  # weights as stored (bf16), activations float32, KV float16; the status line says so
        assert (
            e.quant.mode == "bf16-wo"
            and e.dtype == torch.float32
            and type(qkv).__name__ == "Bf16WOLinear"
        )
        assert e.pool.dtype == torch.float16 and e.precision == "float32 · bf16-wo"
    draft = e.proposer.loaded  # a draft runs plainly, at the target's dtype
    assert draft.quant.mode is None and draft.dtype == e.dtype
    draft_qkv = draft.model.layers[0].self_attn.qkv_proj
    assert isinstance(draft_qkv, nn.Linear) and not hasattr(draft_qkv, "quant_format")
    # an explicit dtype, an explicit --quant, or a float32 checkpoint: no automatic mode
    assert Engine(llama_bf16, EngineConfig(kv_blocks=64, dtype="float32")).quant.mode is None
    assert Engine(llama_bf16, EngineConfig(kv_blocks=64, quant="int8-wo")).quant.mode == "int8-wo"
    assert Engine(llama, EngineConfig(kv_blocks=64)).quant.mode is None


def test_bf16_wo_linear_decode_rows_on_bf16_weights_prefill_rows_in_float32():
    w, bias = torch.randn(96, 64), torch.randn(96)
    layer = Bf16WOLinear(w, bias, CPU)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.nbytes == 96 * 64 * 2
    # pagechat's float kernel where it builds (tests/test_kernels.py), else torch's bf16 matmul
    assert layer.path == qlayers.bf16_wo_path(64, "cpu")
    wb = w.to(torch.bfloat16).float()
    many = torch.randn(layer.max_rows + 1, 64)
    # prefill: float32 math on the stored weight, on pagechat's GEMM where it builds (its sums in
    # another order than MKL's: within Higham's bound, tests/test_kernels.py), else torch's
    if layer.gemm:
        assert torch.equal(layer(many), torch.ops.pagechat.float_gemm(many, layer.weight) + bias)
        assert rel(layer(many), F.linear(many, wb, bias)) < 1e-6
    else:
        assert torch.equal(layer(many), F.linear(many, wb, bias))
    few = many[:3]
    y = layer(few)
    assert y.dtype == torch.float32
    if layer.path == qlayers.BF16_KERNEL_PATH:  # float32 activations times the bf16 weights
        assert rel(y, F.linear(few, wb, bias)) < 1e-6
    else:  # bf16 activations
        assert rel(y, F.linear(few, wb, bias)) < 1e-2
        assert not torch.equal(y, F.linear(few, wb, bias))


def test_rtn_checkpoint_is_autoawq_format_and_loads_fused(rtn, llama):
    cfg = json.loads((rtn / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": 128,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert (rtn / "tokenizer.json").is_file() and (rtn / "chat_template.jinja").is_file()
    t = load_file(rtn / "model.safetensors")
    assert t["model.layers.0.self_attn.k_proj.qweight"].shape == (128, 64 // 8)
    assert t["model.layers.1.mlp.down_proj.scales"].dtype == torch.float16
    assert (
        "model.layers.0.mlp.up_proj.weight" not in t and t["lm_head.weight"].dtype == torch.float16
    )
    e = engine(rtn)
    assert e.quant.mode == "awq"
    qkv = e.model.layers[0].self_attn.qkv_proj
    assert (
        isinstance(qkv, Int4Linear)
        and qkv.out_features == 128 + 64 + 64
        and qkv.path in (qlayers.INT4_KERNEL_PATH, "int4pack-cpu")
    )
    assert isinstance(e.model.layers[1].mlp.gate_up_proj, Int4Linear)
    assert (
        weight_report(e.model).total == estimate_weights(e.spec, "awq", e.dtype, 128, "cpu").total
    )


def test_awq_engine_equals_a_dense_model_of_the_dequantised_weights(rtn, monkeypatch):
    """Oracle: transformers' Llama, dequantised weights; our fallback runs that math in fp32."""
    monkeypatch.setattr("pagechat.quant.layers.awq_path", lambda *a: "dequant")
    # the float32 head, as transformers'
    monkeypatch.setattr(QuantPlan, "head", lambda self, device, dtype: dense_head(dtype))
    e = engine(rtn)
    t = load_file(rtn / "model.safetensors")
    dense = {}
    for k, v in t.items():
        if k.endswith(".qweight"):
            p = k.removesuffix(".qweight")
            dense[f"{p}.weight"] = dequantize(
                unpack_awq(v), unpack_awq(t[f"{p}.qzeros"]), t[f"{p}.scales"], 128
            ).t()
        elif not k.endswith((".qzeros", ".scales")):
            dense[k] = v.float()
    hf = (
        transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(str(rtn)))
        .float()
        .eval()
    )
    hf.load_state_dict(dense)
    ids = [5, 9, 3, 77, 120, 4, 18]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel(e.runner.score(ids), ref) < 1e-4


def test_awq_quantize_runs_folds_exactly_and_loads(llama, tmp_path):
    res = quantize_checkpoint(
        llama, tmp_path / "awq", "awq", 128, calibration_texts(), samples=2, seqlen=16
    )
    assert res.calib_shape == (2, 16) and len(res.alphas) == 2
    assert set(res.alphas[0]) == {"qkv", "gate_up", "down"}  # GQA: no v -> o group
    e = engine(res.out_dir)
    assert e.quant.mode == "awq"
    assert (
        len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].output_ids)
        == 4
    )


def test_scale_folding_leaves_the_float_block_unchanged(tmp_path, tiny_llama):
    """MHA with qkv bias (Qwen2): all groups, v -> o too, fold without changing the fp output."""
    path = make_checkpoint(tmp_path / "qwen2", tiny_llama, "qwen2", kv_heads=4)
    from pagechat.core.loader import WeightReader, read_spec

    spec = read_spec(path)
    blk = load_block(WeightReader(path), spec, 0)
    runner = BlockRunner(spec, 16, 0)
    x = torch.randn(2, 16, 128)
    ref, _ = runner.forward(blk, x)
    fold_scales(
        blk,
        {g: torch.rand(128 if g != "down" else 256) + 0.5 for g in ("qkv", "o", "gate_up", "down")},
    )
    assert rel(runner.forward(blk, x)[0], ref) < 1e-5
    assert "v" in blk.b  # the v bias was scaled along with v's rows


def test_scale_search_protects_salient_channels():
    """The AWQ mechanism: with a few large-activation input channels, its scales beat plain RTN."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    x = torch.randn(512, 256)
    x[:, :4] *= 30

    def run(ws):
        return x @ ws[0].t()

    s, alpha = search_scales(x, [w], run, 128)
    rtn_err = (run([fake_quantize(w, 128)]) - run([w])).pow(2).mean()
    awq_err = (run([fake_quantize(w * s, 128) / s]) - run([w])).pow(2).mean()
    assert alpha > 0 and awq_err < 0.7 * rtn_err


# -- pre-quantised int8 checkpoints ----------------------------------------------------------------


def test_transformers_load_in_8bit_checkpoint_loads_directly(llama, tmp_path):
    """Saved as transformers saves load_in_8bit models: bnb's state_dict (int8, SCB, format)."""
    out = tmp_path / "int8"
    shutil.copytree(llama, out)
    tensors = load_file(out / "model.safetensors")
    for name in [
        k for k in tensors if k.startswith("model.layers.") and k.endswith("_proj.weight")
    ]:
        p = name.removesuffix(".weight")
        layer = bnb_int8_linear(None, CPU, weight=tensors.pop(name))
        for k, v in layer.state_dict().items():
            tensors[f"{p}.{k}"] = v
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = transformers.BitsAndBytesConfig(load_in_8bit=True).to_dict()
    (out / "config.json").write_text(json.dumps(cfg))
    assert "model.layers.0.self_attn.q_proj.SCB" in tensors
    pre, fresh = engine(out), engine(llama, quant="int8")
    assert pre.quant.mode == "int8" and pre.quant.checkpoint == "bnb-int8"
    ids = [5, 9, 3, 77, 120]
    assert torch.equal(pre.runner.score(ids), fresh.runner.score(ids))  # same int8 rows and scales
    wo = engine(out, quant="int8-wo")
    assert isinstance(wo.model.layers[0].mlp.down_proj, Int8WOLinear)
    assert rel(wo.runner.score(ids), fresh.runner.score(ids)) < 2e-2


# -- eval / agreement ------------------------------------------------------------------------------


def test_perplexity_through_the_engine_matches_transformers(llama):
    e = engine(llama)
    ids = [(7 * i + 3) % 1000 + 3 for i in range(70)]
    res = perplexity(e, ids, window=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 32):
            w = torch.tensor([ids[s : s + 32]])
            if w.shape[1] < 2:
                continue
            nll += hf(w, labels=w).loss.item() * (w.shape[1] - 1)
            n += w.shape[1] - 1
    assert res.tokens == n and res.windows == 3
    assert abs(res.nll - nll / n) < 1e-4


# -- bad input: one line, exit 2 -------------------------------------------------------------------


def _edit_config(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _shrink_qweight(p):
    t = load_file(p / "model.safetensors")
    t["model.layers.0.mlp.up_proj.qweight"] = t["model.layers.0.mlp.up_proj.qweight"][
        :, :16
    ].contiguous()
    save_file(t, p / "model.safetensors")


def _set_quant(**kw):
    return lambda p: _edit_config(p, lambda c: c["quantization_config"].update(**kw))


AWQ_BREAKS = {
    "gptq": (_set_quant(quant_method="gptq"), "'gptq' is not supported"),
    "gemv": (_set_quant(version="gemv"), "AWQ version 'gemv'"),
    "llm-awq": (_set_quant(backend="llm-awq"), "llm-awq"),
    "3-bit": (_set_quant(bits=3), "bits=3"),
    "group": (_set_quant(group_size=96), "group_size 96 does not divide in_features 128"),
    "qweight shape": (_shrink_qweight, "model.layers.0.mlp.up_proj.qweight has shape (128, 16)"),
    "bnb 4-bit": (
        lambda p: _edit_config(
            p,
            lambda c: c.update(
                quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}
            ),
        ),
        "4-bit checkpoints (load_in_4bit) are not supported",
    ),
}


@pytest.mark.parametrize("name", AWQ_BREAKS)
def test_bad_awq_checkpoints_give_one_line(rtn, tmp_path, capsys, name):
    path = _copy(rtn, tmp_path)
    breaker, expect = AWQ_BREAKS[name]
    breaker(path)
    code, _, err = cli(["generate", str(path), "-p", "hi", "--max-tokens", "2"], capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err


def test_quant_mode_mismatches_give_one_line(rtn, llama, capsys):
    code, _, err = cli(["generate", str(rtn), "-p", "hi", "--quant", "int8"], capsys)
    assert code == 2 and "already an AWQ 4-bit checkpoint" in err and err.count("\n") == 1
    code, _, err = cli(["generate", str(llama), "-p", "hi", "--quant", "awq"], capsys)
    assert code == 2 and "needs an AWQ checkpoint" in err and err.count("\n") == 1
    code, _, err = cli(["generate", str(llama), "-p", "hi", "--quant", "int4"], capsys)
    assert code == 2 and "--quant must be" in err


def test_quantize_refuses_bad_requests(llama, rtn, tmp_path, capsys):
    code, _, err = cli(
        ["quantize", str(llama), str(tmp_path / "o"), "--method", "rtn", "--group-size", "96"],
        capsys,
    )
    assert (
        code == 2
        and "--group-size 96 does not divide in_features 128" in err
        and err.count("\n") == 1
    )
    code, _, err = cli(["quantize", str(rtn), str(tmp_path / "o"), "--method", "rtn"], capsys)
    assert code == 2 and "already quantised" in err
    code, _, err = cli(["quantize", str(llama), str(rtn), "--method", "rtn"], capsys)
    assert code == 2 and "not an empty directory" in err
    code, _, err = cli(["quantize", str(llama), str(tmp_path / "o"), "--method", "gptq"], capsys)
    assert code == 2 and "--method must be awq or rtn" in err


# -- commands --------------------------------------------------------------------------------------


def test_quantize_and_eval_commands(llama, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text("The KV cache keeps keys and values of earlier tokens. " * 40)
    code, out, _ = cli(
        [
            "quantize",
            str(llama),
            str(tmp_path / "awq"),
            "--calib",
            str(calib),
            "--samples",
            "2",
            "--seqlen",
            "32",
        ],
        capsys,
    )
    assert code is None or code == 0
    assert "wrote awq 4-bit g128" in out and "calibrated on 2 x 32 tokens" in out
    code, out, _ = cli(
        ["eval", str(tmp_path / "awq"), "--text", str(calib), "--seqlen", "64"], capsys
    )
    kernel = qlayers.INT4_KERNEL_PATH if qlayers.kernels.loaded() else "int4pack-cpu"
    assert "perplexity" in out and f"quant awq ({kernel})" in out


def test_transformers_reads_the_awq_config_and_names(rtn):
    """transformers reads our quantization_config as AwqConfig (GEMM); all its tensors are there."""
    cfg = transformers.AutoConfig.from_pretrained(str(rtn))
    qc = transformers.AwqConfig.from_dict(cfg.quantization_config)
    assert (qc.bits, qc.group_size, qc.zero_point, qc.format) == (4, 128, True, "gemm")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    expected = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            expected |= {f"{name}.qweight", f"{name}.qzeros", f"{name}.scales"}
        elif name and not isinstance(mod, torch.nn.Linear):
            expected |= {f"{name}.{k}" for k, _ in mod.named_parameters(recurse=False)}
    expected.add("lm_head.weight")
    assert set(load_file(rtn / "model.safetensors")) == expected
