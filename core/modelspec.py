"""ModelSpec: the architecture facts the engine's decoder needs, whichever file they came from
(config.json, a GGUF's metadata); and the dtypes the engine runs in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """Name of a torch dtype as torch_dtype and --dtype spell it: torch.bfloat16 -> bfloat16."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture facts the engine's decoder needs, read from config.json or a GGUF."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear"|"llama3", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    quantization: dict | None


MAX_POSITIONS = 2**24  # far beyond any released model; a larger value is a broken config
