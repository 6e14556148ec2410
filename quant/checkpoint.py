"""`pagechat quantize`: an AutoAWQ GEMM checkpoint (safetensors, config, tokenizer) by AWQ or RTN.

Memory stays bounded: weights are read one block at a time, and AWQ holds one block's calibration
activations (the block's input, output and the four groups' inputs) at a time.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.loader import WeightReader, load_tokenizer, read_spec
from pagechat.core.modelspec import ModelSpec
from pagechat.core.sources import check_model_dir, gguf_file
from pagechat.quant.awq import LINEARS, BlockRunner, awq_block, load_block
from pagechat.quant.pack import to_awq
from safetensors.torch import save_file

METHODS = ("awq", "rtn")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

Progress = Callable[[int, int, str], None]  # (block index, number of blocks, stage)


@dataclass(slots=True)
class QuantizeResult:
    """What `quantize` did: where it wrote, and the AWQ alpha chosen per block and group."""

    out_dir: Path
    method: str
    group_size: int
    calib_shape: tuple[int, int] | None  # (samples, seqlen) actually used
    alphas: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def awq_quant_config(group: int) -> dict:
    """config.json's quantization_config for an AutoAWQ GEMM checkpoint (transformers, vLLM)."""
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def calibration_ids(tokenizer, texts: Iterable[str], samples: int, seqlen: int) -> torch.Tensor:
    """[n, seqlen] token ids: the texts concatenated and cut into windows (n <= samples)."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False, verbose=False).input_ids
        if len(ids) >= samples * seqlen:
            break
    n = min(samples, len(ids) // seqlen)
    if n == 0:
        raise PagechatError(
            f"the calibration text has {len(ids)} tokens; "
            f"--seqlen {seqlen} needs at least that many"
        )
    return torch.tensor(ids[: n * seqlen]).view(n, seqlen)


def check_quantizable(spec: ModelSpec, group: int, where: Path) -> None:
    """Every decoder linear must split into whole groups and packed words (8 outputs per int32)."""
    if spec.quantization is not None:
        raise PagechatError(
            f"{where} is already quantised ({spec.quantization.get('quant_method', '?')}); "
            "quantize a float checkpoint"
        )
    if group < 1:
        raise PagechatError(f"--group-size must be >= 1, got {group}")
    d = spec.head_dim
    for name, k in (
        ("hidden_size", spec.hidden_size),
        ("num_attention_heads x head_dim", spec.num_heads * d),
        ("intermediate_size", spec.intermediate_size),
    ):
        if k % group:
            raise PagechatError(
                f"--group-size {group} does not divide in_features {k} ({name}) of {where}"
            )
    for name, n in (
        ("q/o", spec.num_heads * d),
        ("k/v", spec.num_kv_heads * d),
        ("hidden", spec.hidden_size),
        ("intermediate", spec.intermediate_size),
    ):
        if n % 8:
            raise PagechatError(
                f"out_features {n} ({name}) of {where} is not a multiple of 8, "
                "which 4-bit packing needs"
            )


def check_request(
    model_dir: Path, out_dir: Path, method: str, group: int, samples: int, seqlen: int
) -> ModelSpec:
    """Refuse a quantize request that cannot succeed, before heavy work; return the model spec."""
    if method not in METHODS:
        raise PagechatError(f"--method must be awq or rtn, got {method!r}")
    if gguf_file(check_model_dir(model_dir)) is not None:
        raise PagechatError(
            f"{model_dir} is a GGUF model: quantize writes an AWQ checkpoint from a Hugging Face "
            "directory's float weights (a GGUF runs as it is quantised)"
        )
    spec = read_spec(model_dir)
    check_quantizable(spec, group, model_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise PagechatError("OUT_DIR must differ from MODEL_DIR")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PagechatError(
            f"{out_dir} already exists and is not an empty directory; choose a new OUT_DIR"
        )
    if method == "awq" and (samples < 1 or seqlen < 2):
        raise PagechatError(f"--samples must be >= 1 and --seqlen >= 2, got {samples} and {seqlen}")
    if method == "awq" and seqlen > spec.max_position_embeddings:
        raise PagechatError(
            f"--seqlen {seqlen} exceeds the model's context ({spec.max_position_embeddings})"
        )
    return spec


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    method: str = "awq",
    group: int = 128,
    texts: Iterable[str] | None = None,
    samples: int = 128,
    seqlen: int = 512,
    progress: Progress | None = None,
) -> QuantizeResult:
    """Quantise a float checkpoint's decoder linears to 4-bit (AWQ or RTN) in AutoAWQ format."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    spec = check_request(model_dir, out_dir, method, group, samples, seqlen)
    reader = WeightReader(model_dir)
    tokenizer = load_tokenizer(model_dir)
    report = progress or (lambda i, n, stage: None)
    hid, vocab = spec.hidden_size, spec.vocab_size
    embed = reader.get("model.embed_tokens.weight", (vocab, hid))
    out = {"model.embed_tokens.weight": embed.half()}
    result = QuantizeResult(out_dir, method, group, None)
    x = None
    if method == "awq":
        if texts is None:
            raise PagechatError("AWQ needs calibration text (texts=...); RTN does not")
        ids = calibration_ids(tokenizer, texts, samples, seqlen)
        result.calib_shape = tuple(ids.shape)
        x = embed.float()[ids]  # [samples, seqlen, hidden]: the first block's input
    with torch.inference_mode():
        for i in range(spec.num_layers):
            report(i, spec.num_layers, "quantising" if x is None else "calibrating")
            blk = load_block(reader, spec, i)
            if x is not None:
                runner = BlockRunner(spec, x.shape[1], i)
                x_next, feats = runner.forward(
                    blk, x
                )  # the fp block: next block's input, this block's group inputs
                result.alphas.append(awq_block(blk, runner, feats, group))
                x = x_next
                del feats
            p = f"model.layers.{i}"
            for short, name in LINEARS.items():
                for key, t in to_awq(blk.w[short], group, blk.b.get(short)).items():
                    out[f"{p}.{name}.{key}"] = t
            for short, name in (
                ("ln1", "input_layernorm"),
                ("ln2", "post_attention_layernorm"),
                ("q_norm", "self_attn.q_norm"),
                ("k_norm", "self_attn.k_norm"),
            ):
                if short in blk.norms:
                    out[f"{p}.{name}.weight"] = blk.norms[
                        short
                    ].half()  # AWQ folded its scales into the norms
        report(spec.num_layers, spec.num_layers, "writing")
    out["model.norm.weight"] = reader.get("model.norm.weight", (hid,)).half()
    if not spec.tie_word_embeddings and reader.has("lm_head.weight"):
        out["lm_head.weight"] = reader.get("lm_head.weight", (vocab, hid)).half()
    _write(model_dir, out_dir, out, group)
    result.seconds = time.perf_counter() - t0
    return result


def _write(model_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], group: int) -> None:
    """model.safetensors, config.json (quantization_config), quant_config.json, non-weight files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = awq_quant_config(group)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "torch_dtype":
            cfg[key] = "float16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # AutoAWQ also writes quant_config.json; older loaders look for it
    legacy = {
        "zero_point": True,
        "q_group_size": group,
        "w_bit": 4,
        "version": "GEMM",
        "modules_to_not_convert": None,
    }
    (out_dir / "quant_config.json").write_text(json.dumps(legacy, indent=2) + "\n")
    for f in model_dir.iterdir():
        if (
            f.is_file()
            and f.name not in ("config.json", "quant_config.json", "model.safetensors.index.json")
            and f.suffix not in _WEIGHT_SUFFIXES
        ):
            shutil.copy2(f, out_dir / f.name)
