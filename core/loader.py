"""Read a local Hugging Face checkpoint directory: config, safetensors weights and tokenizer.

Every way a directory can be wrong ends in a one-line PagechatError that names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.gguf import GGUFFile
from pagechat.core.gguf_model import GGUFWeights, gguf_tokenizer, read_gguf_spec
from pagechat.core.modelspec import MAX_POSITIONS, ModelSpec, dtype_name
from pagechat.core.sources import check_model_dir, gguf_file, ollama_model
from safetensors import safe_open

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PagechatError(f"cannot read {path}: {e}") from None


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 keeps rope settings in rope_parameters (rope_theta inside), 4.x in rope_theta
    # and rope_scaling
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise PagechatError(
            f"config.json: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return theta, (None if rope_type == "default" else {**params, "rope_type": rope_type})


def _int(cfg: dict, key: str, default: int | None = None, most: int | None = None) -> int:
    """config.json's integer field `key` (>= 1, and <= most when given); ValueError naming it."""
    value = cfg.get(key) if cfg.get(key) is not None else default
    if value is None:
        raise ValueError(f"{key} is missing")
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if most is not None and not (ok and value <= most):
        raise ValueError(f"{key} must be an integer between 1 and 2^24, got {value!r}")
    if not ok:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def _number(cfg: dict, key: str, default: float) -> float:
    """config.json's numeric field `key`; ValueError naming it."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _windows(cfg: dict, arch: str, n: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if window is not None:
        _int(cfg, "sliding_window")
    layer_types = cfg.get("layer_types")
    if window is None:
        return (None,) * n
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM":
        return (window,) * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n


def _read_config(model_dir: Path) -> tuple[Path, dict]:
    """config.json's path and contents; PagechatError if the directory has none."""
    path = check_model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise PagechatError(
            f"{model_dir} has no config.json: is it a Hugging Face model directory?"
        )
    return path, _read_json(path)


def _check_arch(path: Path, cfg: dict) -> str:
    """The config's architecture; refuse one the engine does not run, or a non-silu activation."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHS:
        raise PagechatError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise PagechatError(f"{path}: hidden_act {act!r} is not supported (only silu)")
    return arch


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    """The end-of-sequence ids: generation_config.json's when it has them, else config.json's."""
    eos = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen).get("eos_token_id", eos)
    return tuple([eos] if isinstance(eos, int) else (eos or []))


def _spec_from(model_dir: Path, cfg: dict, arch: str) -> ModelSpec:
    """Build the ModelSpec from config.json's fields (KeyError/TypeError/ValueError when bad)."""
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    n = _int(cfg, "num_hidden_layers")
    theta, scaling = _rope(cfg)
    eos = _eos_ids(model_dir, cfg)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelSpec(
        arch=arch,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048, MAX_POSITIONS),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=(not is_qwen2) and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=_windows(cfg, arch, n),
        eos_token_ids=eos,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        quantization=cfg.get("quantization_config"),
    )


def read_spec(model_dir: Path) -> ModelSpec:
    """Parse config.json (or a GGUF's metadata) into a ModelSpec; refuse architectures and
    settings it does not run."""
    gguf = gguf_file(check_model_dir(model_dir))
    if gguf is not None:
        ollama = ollama_model(model_dir)
        return read_gguf_spec(gguf, ollama.stops if ollama else ())
    path, cfg = _read_config(model_dir)
    arch = _check_arch(path, cfg)
    try:
        return _spec_from(model_dir, cfg, arch)
    except ValueError as e:
        raise PagechatError(f"{path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise PagechatError(f"{path}: missing or bad field {e}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single or sharded); refuse pickle-only checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise PagechatError(f"{index} names {missing[0]}, which is not in {model_dir}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise PagechatError(
            f"{model_dir} holds only pickle weights ({pickles[0]}); pagechat loads safetensors "
            "only, because unpickling can run arbitrary code. Convert once in a trusted "
            "environment: AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out, safe_serialization=True)"
        )
    raise PagechatError(
        f"{model_dir} has no model.safetensors (nor a sharded model.safetensors.index.json)"
    )


class WeightReader:
    """Reads named tensors from a checkpoint's safetensors files, checking each name and shape."""

    def __init__(self, model_dir: Path) -> None:
        self.files = weight_files(model_dir)
        self.where: dict[str, Path] = {}
        self._handles = {}
        for f in self.files:
            try:
                h = safe_open(str(f), framework="pt")
            # safetensors raises its own error types for truncated / bad headers
            except Exception as e:
                raise PagechatError(f"{f} is truncated or not a safetensors file ({e})") from None
            self._handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `name`; PagechatError if it is missing, unreadable or not of `shape`."""
        f = self.where.get(name)
        if f is None:
            raise PagechatError(
                f"tensor {name} is missing from the checkpoint "
                f"({', '.join(p.name for p in self.files)})"
            )
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:
            raise PagechatError(
                f"{f.name}: cannot read tensor {name} ({e}); the file may be truncated"
            ) from None
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise PagechatError(
                f"{f.name}: tensor {name} has shape {tuple(t.shape)}, "
                f"config.json implies {tuple(shape)}"
            )
        return t

    def floats(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A float tensor of `shape`, in `dtype`; PagechatError if the checkpoint stores it as
        integers (a quantised tensor where config.json declares none)."""
        t = self.get(name, shape)
        if not t.is_floating_point():
            raise PagechatError(
                f"{self.where[name].name}: tensor {name} is {dtype_name(t.dtype)}, "
                "not floating point"
            )
        return t.to(dtype)

    def close(self) -> None:
        """Let go of the files (the loaded model holds its own tensors)."""
        self._handles.clear()

    def check_layers(self, num_layers: int) -> None:
        """Refuse a checkpoint with decoder layers its config.json does not declare."""
        for name, f in self.where.items():
            parts = name.split(".")
            layer = parts[2] if parts[:2] == ["model", "layers"] and len(parts) > 2 else ""
            if layer.isdigit() and int(layer) >= num_layers:
                raise PagechatError(
                    f"{f.name}: tensor {name} is not used: config.json declares {num_layers} layers"
                )


def open_weights(model_dir: Path, spec: ModelSpec):
    """The reader of a checkpoint's tensors: WeightReader, or GGUFWeights for a GGUF model."""
    gguf = gguf_file(model_dir)
    if gguf is None:
        return WeightReader(model_dir)
    return GGUFWeights(GGUFFile(gguf), spec)


def load_tokenizer(model_dir: Path):
    """The checkpoint's own tokenizer, from local files only, never remote code (a GGUF's from
    the file itself)."""
    gguf = gguf_file(model_dir)
    if gguf is not None:
        return gguf_tokenizer(gguf, ollama_model(model_dir))
    from transformers import AutoTokenizer  # slow import: only when a model is loaded

    if not any(
        (model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise PagechatError(
            f"{model_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)"
        )
    try:
        return AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:
        raise PagechatError(
            f"cannot load the tokenizer in {model_dir}: {str(e).splitlines()[0]}"
        ) from None
