"""A GGUF model as the engine loads it: its ModelSpec from the file's metadata, its tensors under
the names the decoder asks for, its tokenizer and chat template from the file itself.

llama.cpp's converter renames every tensor (`model.layers.3.self_attn.q_proj.weight` is
`blk.3.attn_q.weight`) and, for the llama architecture (Llama and Mistral), reorders the rows of
q and k so that ggml's rotary embedding, which rotates adjacent pairs, sees what the checkpoint's
rotation of half-split pairs saw; the rows are put back here, so the decoder runs GGUF and
safetensors checkpoints alike. Qwen2 and Qwen3 GGUFs keep the checkpoint's order (ggml rotates them
as the checkpoint does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize
from pagechat.core.errors import PagechatError
from pagechat.core.gguf import GGUFFile, TensorInfo
from pagechat.core.modelspec import MAX_POSITIONS, ModelSpec, dtype_name
from pagechat.core.ollama import OllamaModel, jinja_template

ARCHS = {  # GGUF general.architecture -> the decoder it runs as
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PERMUTED = ("llama", "mistral")  # q and k rows reordered for ggml's adjacent-pair rotation
FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_LAYER = {  # the decoder's module names under model.layers.N -> GGUF's under blk.N
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a decoder tensor name, or None for a name GGUF has no place for."""
    top, _, suffix = name.rpartition(".")
    if top in _TOP:
        return f"{_TOP[top]}.{suffix}"
    m = _NAME.match(name)
    if m is None or m[2] not in _LAYER:
        return None
    return f"blk.{m[1]}.{_LAYER[m[2]]}.{m[3]}"


def _meta(f: GGUFFile, key: str, kind: type, default=None):
    """Metadata `key` of a Python kind (int, float, str); PagechatError naming it when it is
    missing (no default) or of another kind."""
    value = f.fields.get(key, default)
    if value is None:
        raise PagechatError(f"{f.path}: metadata {key} is missing")
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise PagechatError(f"{f.path}: metadata {key} must be {kind.__name__}, got {value!r}")
    return value


def _positive(f: GGUFFile, key: str, default: int | None = None, most: int = MAX_POSITIONS) -> int:
    value = _meta(f, key, int, default)
    if not 1 <= value <= most:
        raise PagechatError(f"{f.path}: metadata {key} must be between 1 and {most}, got {value}")
    return value


def architecture(f: GGUFFile) -> str:
    """general.architecture, refused unless the engine's decoder runs it."""
    arch = _meta(f, "general.architecture", str)
    if arch not in ARCHS:
        raise PagechatError(
            f"{f.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    return arch


def _rope(f: GGUFFile, arch: str, head_dim: int) -> tuple[float, dict | None]:
    """rope theta and scaling: linear from the metadata, Llama 3's as the per-frequency factors
    llama.cpp's converter stores in rope_freqs.weight (ggml divides each frequency by its
    factor)."""
    theta = _meta(f, f"{arch}.rope.freq_base", float, 10000.0)
    dims = _positive(f, f"{arch}.rope.dimension_count", head_dim)
    if dims != head_dim:
        raise PagechatError(
            f"{f.path}: rope over {dims} of {head_dim} dimensions (partial rotary) is not supported"
        )
    kind = _meta(f, f"{arch}.rope.scaling.type", str, "none")
    factor = f.fields.get(f"{arch}.rope.scale_linear")  # older files' key for linear scaling
    if kind == "linear" or (kind == "none" and factor is not None):
        factor = _meta(f, f"{arch}.rope.scaling.factor", float, factor)
        return theta, None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    if kind != "none":
        raise PagechatError(
            f"{f.path}: rope scaling {kind!r} is not supported (supported: linear, Llama 3's)"
        )
    if "rope_freqs.weight" in f.tensors:
        info = f.tensors["rope_freqs.weight"]
        if info.type != GGMLQuantizationType.F32 or info.shape != (head_dim // 2,):
            raise PagechatError(
                f"{f.path}: rope_freqs.weight must be F32 of {head_dim // 2} values, "
                f"got {info.type.name} {list(info.shape)}"
            )
        factors = f.bytes_of("rope_freqs.weight").view(np.float32).reshape(-1)
        return theta, {"rope_type": "factors", "factors": tuple(float(x) for x in factors)}
    return theta, None


def _eos_ids(f: GGUFFile) -> tuple[int, ...]:
    """End-of-generation ids: eos, and the end-of-turn and end-of-message ids llama.cpp also stops
    at."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [f.fields.get(f"tokenizer.ggml.{k}") for k in keys]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)))


def _torch_dtype(f: GGUFFile) -> str | None:
    """The file's float dtype where its 2-D weights are all F32/F16/BF16 (bf16 before fp16 before
    float32, as a file of half weights keeps its norms in F32), else None."""
    types = {t.type for t in f.tensors.values() if len(t.shape) == 2}
    if not types or not types <= set(FLOATS):
        return None
    for t in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        if t in types:
            return dtype_name(FLOATS[t])
    return None


def quant_types(f: GGUFFile) -> dict[str, int]:
    """Tensor type name -> how many tensors have it, most common first."""
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        counts[t.type.name] = counts.get(t.type.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def read_gguf_spec(path: Path, stops: tuple[str, ...] = ()) -> ModelSpec:
    """The ModelSpec of the GGUF model at path (its header only); stop strings that are one token
    of its vocabulary (an Ollama model's parameters) end a reply as its eos does."""
    with GGUFFile(path) as f:
        spec = gguf_spec(f)
        tokens = f.fields.get("tokenizer.ggml.tokens") or []
    ids = {t: i for i, t in enumerate(tokens) if t in stops}
    return replace(spec, eos_token_ids=tuple(dict.fromkeys((*spec.eos_token_ids, *ids.values()))))


def gguf_spec(f: GGUFFile) -> ModelSpec:
    """The ModelSpec of a GGUF: sizes from the metadata, checked against the tensors as they load;
    a model with a quantised 2-D weight says so in `quantization` (quant_method gguf)."""
    arch = architecture(f)
    if "token_embd.weight" not in f.tensors:
        raise PagechatError(f"{f.path}: tensor token_embd.weight is missing")
    vocab, hidden = _embedding_shape(f)
    heads = _positive(f, f"{arch}.attention.head_count")
    head_dim = _positive(f, f"{arch}.attention.key_length", max(1, hidden // heads))
    theta, scaling = _rope(f, arch, head_dim)
    n = _positive(f, f"{arch}.block_count")
    torch_dtype = _torch_dtype(f)
    return ModelSpec(
        arch=ARCHS[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_positive(f, f"{arch}.feed_forward_length"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=_positive(f, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_meta(f, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_positive(f, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors,
        mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        sliding_windows=(None,) * n,
        eos_token_ids=_eos_ids(f),
        torch_dtype=torch_dtype,
        quantization=None if torch_dtype else {"quant_method": "gguf", "types": quant_types(f)},
    )


def _embedding_shape(f: GGUFFile) -> tuple[int, int]:
    shape = f.tensors["token_embd.weight"].shape
    if len(shape) != 2:
        raise PagechatError(f"{f.path}: token_embd.weight must be 2-D, got shape {list(shape)}")
    return shape


def dequantized(blocks: np.ndarray, qtype: GGMLQuantizationType, what: str) -> np.ndarray:
    """Blocks of a quantised type as float32 values, by the gguf package's own dequantisation;
    PagechatError naming `what` (the file and tensor) for a type it cannot read."""
    try:
        return np.ascontiguousarray(dequantize(blocks, qtype), dtype=np.float32)
    except NotImplementedError:
        raise PagechatError(f"{what} has type {qtype.name}, which pagechat cannot read") from None


@dataclass(frozen=True, slots=True)
class GGMLTensor:
    """A tensor's blocks as the file stores them (uint8 [rows, row bytes], rows in the decoder's
    order), its ggml type and its logical shape [rows, row length]: what quant/ggml.py turns into
    pagechat's kernels' layouts."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, int]
    blocks: torch.Tensor
    file: str = ""  # where it was read, for messages


class GGUFWeights:
    """A GGUF's tensors under the decoder's names, as WeightReader gives a safetensors
    checkpoint's: floats for the dense path, and each quantised tensor's blocks (`ggml`) for the
    quantisation backend. Tensors are copied out of the memory map as they are read; close()
    unmaps the file."""

    def __init__(self, f: GGUFFile, spec: ModelSpec) -> None:
        self.file, self.spec = f, spec
        self.arch = architecture(f)

    def _info(self, name: str, shape: tuple[int, ...] | None) -> TensorInfo:
        gname = gguf_name(name)
        info = self.file.tensors.get(gname) if gname else None
        if info is None:
            raise PagechatError(f"{self.file.path}: tensor {gname or name} is missing")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise PagechatError(
                f"{self.file.path}: tensor {info.name} has shape {list(info.shape)}, "
                f"the metadata implies {list(shape)}"
            )
        return info

    def has(self, name: str) -> bool:
        gname = gguf_name(name)
        return gname is not None and gname in self.file.tensors

    def type_of(self, name: str) -> GGMLQuantizationType:
        return self._info(name, None).type

    def _rows(self, name: str, rows: int) -> torch.Tensor | None:
        """The row order that undoes the converter's q/k permutation, or None (no reordering)."""
        if self.arch not in PERMUTED or not re.search(r"self_attn\.[qk]_proj\.", name):
            return None
        heads = self.spec.num_heads if ".q_proj." in name else self.spec.num_kv_heads
        half = rows // heads // 2
        # the decoder's row h * half + i of a head is the file's row 2 i + h
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)

    def ggml(self, name: str, shape: tuple[int, ...]) -> GGMLTensor:
        """The blocks of tensor `name` of `shape` [rows, row length], rows in the decoder's
        order."""
        info = self._info(name, shape)
        raw = torch.from_numpy(np.array(self.file.bytes_of(info.name)))  # copied out of the map
        order = self._rows(name, shape[0])
        blocks = raw if order is None else raw[order]
        return GGMLTensor(info.name, info.type, (shape[0], shape[-1]), blocks, str(self.file.path))

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor `name` as floats: F32, F16 and BF16 as stored, any other type dequantised to
        float32 by the gguf package."""
        info = self._info(name, shape)
        raw = np.array(self.file.bytes_of(info.name))
        if info.type in FLOATS:
            t = torch.from_numpy(raw.view(np.uint8)).view(FLOATS[info.type])
        else:
            t = torch.from_numpy(
                dequantized(raw, info.type, f"{self.file.path}: tensor {info.name}")
            )
        t = t.reshape(info.shape)
        order = self._rows(name, info.shape[0])
        return t if order is None else t[order]

    def floats(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.get(name, shape).to(dtype)

    def check_layers(self, num_layers: int) -> None:
        """Refuse a file with decoder layers its metadata does not declare."""
        for name in self.file.tensors:
            m = re.match(r"blk\.(\d+)\.", name)
            if m and int(m[1]) >= num_layers:
                raise PagechatError(
                    f"{self.file.path}: tensor {name} is not used: block_count is {num_layers}"
                )

    def close(self) -> None:
        self.file.close()


def gguf_tokenizer(path: Path, ollama: OllamaModel | None = None):
    """The tokenizer and chat template the GGUF carries, built by transformers' GGUF tokenizer
    converters (the reference for what the file's vocabulary and pre-tokenizer type mean); where
    the file has no template, an Ollama model's own, translated (core/ollama.py). Built as a
    PreTrainedTokenizerFast rather than through AutoTokenizer, which reads the whole header again
    to pick a class (4 s more for SmolLM2) and may swap in a model class's own pre-tokenizer for
    the one the file names."""
    from transformers import PreTrainedTokenizerFast  # slow import: only when a model is loaded

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PagechatError(f"cannot build the tokenizer of {path}: {why}") from None
    if not tokenizer.chat_template and ollama is not None and ollama.template:
        tokenizer.chat_template = jinja_template(ollama.template)
    return tokenizer
