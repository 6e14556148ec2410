"""GGUF files of Hugging Face checkpoints, written as llama.cpp's convert_hf_to_gguf.py writes them,
with only the `gguf` package (no llama.cpp checkout or build).

    write_gguf(model_dir, out, types={"attention": "Q4_K", "mlp": "Q4_K"}, default="Q8_0")

Covers what `pagechat make-model` writes (llama, mistral, qwen2, qwen3; byte-level BPE tokenizer
with a chat template): the metadata keys, tensor names, Q/K row order and tokenizer metadata are
llama.cpp's, so llama.cpp, transformers and gguf all read the same model from the file.

transformers' GGUF loader (5.x) reads neither llama3 rope scaling (the rope_freqs tensor) nor
qwen3's attention.key_length (it takes Qwen3Config's default head_dim, 128): for the tiny llama
and qwen3 models, load with `config=` set from the checkpoint's config to compare logits.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType, TokenType
from safetensors.torch import load_file

# HF model_type -> GGUF architecture: convert_hf_to_gguf writes Mistral checkpoints as llama
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# tokenizer.ggml.pre: how text is split before BPE, chosen to split as the checkpoint's tokenizer
# does when transformers loads it (AutoTokenizer, as the engine does). tokenizer.json says plain
# ByteLevel (GPT-2's regex): llama.cpp's "gpt-2", which transformers' GGUF converter also leaves
# as GPT-2's regex. But transformers 5 loads a qwen2 checkpoint as Qwen2Tokenizer, which replaces
# that split with Qwen2's regex (digits one by one, a symbol glued to the word after it): that is
# llama.cpp's "qwen2" (Qwen2Tokenizer's NFC normalizer has no GGUF counterpart: only text not
# in NFC differs). qwen3 keeps tokenizer.json's split (the class it names is trusted).
PRE_TOKENIZER = {"qwen2": "qwen2"}
KINDS = ("embedding", "attention", "mlp", "lm_head")

# HF module name -> (GGUF name, kind); `kind` picks the type from write_gguf's `types`
_TOP = {
    "model.embed_tokens": ("token_embd", "embedding"),
    "model.norm": ("output_norm", None),
    "lm_head": ("output", "lm_head"),
}
_LAYER = {  # under model.layers.N. -> under blk.N.
    "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None),
    "self_attn.q_proj": ("attn_q", "attention"),
    "self_attn.k_proj": ("attn_k", "attention"),
    "self_attn.v_proj": ("attn_v", "attention"),
    "self_attn.o_proj": ("attn_output", "attention"),
    "self_attn.q_norm": ("attn_q_norm", None),
    "self_attn.k_norm": ("attn_k_norm", None),
    "mlp.gate_proj": ("ffn_gate", "mlp"),
    "mlp.up_proj": ("ffn_up", "mlp"),
    "mlp.down_proj": ("ffn_down", "mlp"),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")

# general.file_type of a file mostly of one type, where llama.cpp's name is not MOSTLY_<type>
# (Q4_K: its usual Q4_K_M mix, which has Q6_K in places)
_FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}


def write_gguf(
    model_dir: Path, out: Path, types: dict[str, str] | None = None, default: str = "F32"
) -> Path:
    """Write the checkpoint in `model_dir` to the GGUF file `out`; returns `out`.

    `types` maps a tensor kind ("embedding": token_embd, "attention": attn_q/k/v/output, "mlp":
    ffn_gate/up/down, "lm_head": output, present only when untied) to a GGML type name; kinds not
    in it get `default`. Type names: F32, F16, BF16, whatever `gguf.quants.quantize` implements
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, ...), and Q4_K / Q6_K (quantized here). Norms and biases are
    F32 whatever is asked, as llama.cpp writes them. Raises ValueError for an unknown kind or
    type, and for a tensor whose rows do not split into whole blocks of its type (32 values; 256
    for K-quants, which the tiny models' rows of 64 and 128 never do).
    """
    model_dir, out = Path(model_dir), Path(out)
    types = dict(types or {})
    if unknown := set(types) - set(KINDS):
        raise ValueError(f"unknown tensor kinds {sorted(unknown)}; kinds: {', '.join(KINDS)}")
    for name in [default, *types.values()]:
        if name not in GGMLQuantizationType.__members__:
            raise ValueError(f"unknown GGML type {name!r}")
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]

    tensors = []  # (GGUF name, array, kind), in checkpoint order as convert_hf_to_gguf goes
    if (freqs := _llama3_rope_freqs(cfg)) is not None:
        tensors.append(("rope_freqs.weight", freqs, None))
    for path in sorted(model_dir.glob("*.safetensors")):
        for hf_name, value in load_file(path).items():
            name, kind = _gguf_name(hf_name)
            data = value.float().numpy()
            if arch == "llama" and name.startswith("blk.") and ".attn_q." in name:
                data = _permute(data, cfg["num_attention_heads"])
            if arch == "llama" and name.startswith("blk.") and ".attn_k." in name:
                data = _permute(data, cfg["num_key_value_heads"])
            tensors.append((name, data, kind))

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch)
    # general.name and size_label as convert_hf_to_gguf gets them: gguf's heuristics on the
    # directory's name ("tiny-llama" -> "Tiny Llama") and the parameter count ("205K")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(gguf.Metadata.load(model_path=model_dir).name)
    n_params = sum(data.size for _, data, _ in tensors)
    writer.add_size_label(gguf.size_label(n_params, n_params, 0, 0))
    _write_metadata(writer, cfg, _file_type(tensors, types, default))
    pre = PRE_TOKENIZER.get(cfg["model_type"], "gpt-2")
    _write_tokenizer(writer, model_dir, cfg["vocab_size"], pre)
    for name, data, kind in tensors:
        # 1-D tensors stay F32: llama.cpp's kernels take norms and biases in F32 only
        type_name = types.get(kind, default) if data.ndim > 1 else "F32"
        encoded, qtype = _encode(name, data, type_name)
        writer.add_tensor(name, encoded, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _gguf_name(hf_name: str) -> tuple[str, str | None]:
    """(llama.cpp's tensor name, kind) of a checkpoint tensor."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in _TOP:
        name, kind = _TOP[module]
        return f"{name}.{suffix}", kind
    if (m := _LAYER_NAME.fullmatch(module)) and m[2] in _LAYER:
        name, kind = _LAYER[m[2]]
        return f"blk.{m[1]}.{name}.{suffix}", kind
    raise ValueError(f"no GGUF name for checkpoint tensor {hf_name!r}")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF's rotary pairs each dimension i with i + d/2
    (rotate_half); llama.cpp's llama arch pairs 2i with 2i + 1, so Q and K rows are reordered
    within each head. Qwen archs use the rotate_half (NeoX) order in llama.cpp too."""
    head_rows = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return head_rows.swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict) -> dict:
    """The rope parameters, from either spelling (transformers 5 rope_parameters, 4.x
    rope_scaling + rope_theta), with rope_type and rope_theta filled in."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _llama3_rope_freqs(cfg: dict) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: llama3 rope scaling as one factor per rotary frequency
    (the rope_freqs tensor), which llama.cpp divides each frequency by."""
    rope = _rope(cfg)
    if rope["rope_type"] != "llama3":
        return None
    dim = _head_dim(cfg)
    factor, low = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0)
    high = rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _file_type(tensors: list, types: dict[str, str], default: str) -> LlamaFileType:
    """general.file_type: the type holding most of the 2-D weights' values."""
    counts: dict[str, int] = {}
    for _, data, kind in tensors:
        if data.ndim > 1:
            name = types.get(kind, default)
            counts[name] = counts.get(name, 0) + data.size
    main = max(counts, key=counts.__getitem__)
    return _FILE_TYPE[main] if main in _FILE_TYPE else LlamaFileType[f"MOSTLY_{main}"]


def _write_metadata(w: gguf.GGUFWriter, cfg: dict, ftype: LlamaFileType) -> None:
    """TextModel/LlamaModel.set_gguf_parameters' keys. convert_hf_to_gguf leaves out key/value
    length where config.json has no head_dim, and rope.dimension_count and vocab_size for the qwen
    archs; they are written here for every arch (llama.cpp reads them where present)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    rope = _rope(cfg)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise ValueError(f"rope type {rope['rope_type']!r} is not supported here")
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(_head_dim(cfg))
    w.add_value_length(_head_dim(cfg))
    w.add_file_type(ftype)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(_head_dim(cfg))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre: str) -> None:
    """TextModel._set_vocab_gpt2 for a byte-level BPE tokenizer.json, read directly."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    split = tok["pre_tokenizer"] or {}
    byte_level = split.get("type") == "ByteLevel" and split.get("use_regex", True)
    if tok["model"]["type"] != "BPE" or not byte_level or split.get("add_prefix_space"):
        raise ValueError(f"{model_dir}: not a plain byte-level BPE tokenizer")
    # ids past the tokenizer's own are padding rows of the embedding: llama.cpp's [PAD<id>] tokens
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    toktypes = [TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], toktypes[i] = text, TokenType.NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        toktypes[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)):
        if (text := tok_cfg.get(f"{key}_token")) is not None:
            add(ids[text])
    if (text := tok_cfg.get("pad_token")) is not None:
        w.add_pad_token_id(ids[text])
    # the ChatML template writes every special token itself
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    template = tok_cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()  # transformers 5 keeps it here
    if template is not None:
        w.add_chat_template(template)


def _encode(name: str, data: np.ndarray, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """(`data` in GGML type `type_name`, as the writer takes it, the type)."""
    qtype = GGMLQuantizationType[type_name]
    block = GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        raise ValueError(
            f"{name}: rows of {data.shape[-1]} values do not split into {type_name} blocks of "
            f"{block}"
        )
    quantize = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(type_name)
    return (quantize(data) if quantize else gguf.quants.quantize(data, qtype)), qtype


def _f16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to float16 (how the block stores it), as float32 to compute with."""
    return x.astype(np.float16).astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero sub-block)."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K blocks (ggml's block_q4_K, 144 bytes per 256 values), round-to-nearest.

    A block is d, dmin (fp16), 12 bytes of 6-bit scales and mins for its 8 sub-blocks of 32, and
    128 bytes of 4-bit q; a value is d * scale * q - dmin * min. Each sub-block spans its own
    [min(x, 0), max(x)]. Packing is gguf's Q4_K.get_scale_min / dequantize_blocks run backwards.
    """
    x = data.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0)  # ggml keeps the offset <= 0, so mins are stored positive
    step, offset = (x.max(-1) - lo) / 15, -lo
    d, dmin = _f16(step.max(-1) / 63), _f16(offset.max(-1) / 63)
    sc = np.clip(np.round(_div(step, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_div(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.round(_div(x + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    # scales: bytes 0-3 scales 0-3, 4-7 mins 0-3, each with 2 high bits of scale/min 4-7 on top;
    # bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)
    scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4 << 6),
            mn[:, :4] | (mn[:, 4:] >> 4 << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    # qs: 4 runs of 32 bytes, sub-block 2j in the low nibbles of run j and 2j + 1 in the high
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = [_bytes(d, np.float16), _bytes(dmin, np.float16), scales, qs]
    return _rows(np.concatenate(blocks, axis=1), data.shape, GGMLQuantizationType.Q4_K)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K blocks (ggml's block_q6_K, 210 bytes per 256 values), round-to-nearest.

    A block is 128 bytes of the low 4 bits of q, 64 of the high 2 bits, 16 int8 scales (one per
    16 values) and d (fp16); a value is d * scale * (q - 32). Each group of 16 is symmetric
    around 0 with q - 32 in [-31, 31]. Packing is gguf's Q6_K.dequantize_blocks run backwards.
    """
    x = data.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(x).max(-1) / 31
    d = _f16(step.max(-1) / 127)
    sc = np.clip(np.round(_div(step, d[:, None])), 0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.round(_div(x, step[..., None])), -32, 31) + 32).astype(np.uint8)
    # each half block of 128 values: ql holds values 0-63 in low nibbles and 64-127 in high
    # nibbles of its 64 bytes; qh holds the 2 high bits of values 32k + l in bits 2k of byte l
    q = q.reshape(-1, 2, 128)
    lo = (q & 0xF).reshape(-1, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = np.bitwise_or.reduce(hi, axis=2).reshape(-1, 64)
    blocks = [ql, qh, sc.view(np.uint8), _bytes(d, np.float16)]
    return _rows(np.concatenate(blocks, axis=1), data.shape, GGMLQuantizationType.Q6_K)


def _bytes(x: np.ndarray, dtype) -> np.ndarray:
    """One row of bytes per entry of 1-D `x`, stored as `dtype` (little-endian, as GGUF is)."""
    return x.astype(dtype).view(np.uint8).reshape(len(x), -1)


def _rows(blocks: np.ndarray, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    """Blocks regrouped into `shape`'s rows: the byte shape gguf.quants.quantize returns."""
    return blocks.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
