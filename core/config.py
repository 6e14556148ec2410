"""EngineConfig: the settings one engine runs under (device, dtype, KV pool, batch limits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagechat.core.errors import PagechatError
from pagechat.core.modelspec import DTYPES
from pagechat.core.quantization import backend, lm_heads, quant_modes
from pagechat.core.threads import check_threads

_UNITS = {
    "": 1,
    "B": 1,
    "K": 2**10,
    "KB": 2**10,
    "KIB": 2**10,
    "M": 2**20,
    "MB": 2**20,
    "MIB": 2**20,
    "G": 2**30,
    "GB": 2**30,
    "GIB": 2**30,
}


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs: device and dtype, KV pool size, and the scheduler's per-step limits."""

    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # the KV cache's: auto = float16 where the model computes in float32 on a CPU, else the same
    kv_dtype: str = "auto"
    block_size: int = 16
    kv_blocks: int | None = None  # fixed pool size; wins over kv_memory
    kv_memory: int | None = None  # bytes for the KV pool; default: see kv.default_kv_bytes
    max_batch_tokens: int = 2048  # tokens computed per step (prefill chunks + decodes)
    max_seqs: int = 64
    preempt: str = "recompute"  # recompute | swap (a preempted sequence's KV waits in host memory)
    swap_blocks: int | None = (
        None  # host pool size in blocks with --preempt swap; None: as the KV pool
    )
    prefix_cache: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    draft: str | None = None  # draft model directory for speculative decoding
    ngram: bool = False  # prompt-lookup speculation
    num_draft: int = 4  # tokens drafted per step
    # None | int8 | int8-wo | bf16-wo | awq (AWQ and bnb-int8 checkpoints are detected anyway)
    quant: str | None = None
    # auto | float, and with pagechat.quant int8 | int4: the LM head's format (quant/head.py)
    lm_head: str = "auto"
    graphs: bool = (
        True  # small unpadded steps as traced graphs (core/graphs.py), on a GPU decode steps as
        # CUDA graphs (core/cuda_graphs.py); False: --eager
    )
    threads: int | None = None  # torch CPU threads; None: core/threads.py's default

    def validate(self) -> EngineConfig:
        """Raise PagechatError naming the first bad setting; return self when all are valid."""
        if self.device not in ("auto", "cpu", "cuda"):
            raise PagechatError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        check_dtype(self.dtype)
        check_dtype(self.kv_dtype, "--kv-dtype")
        if self.quant is not None:
            check_backend_choice("--quant", self.quant, quant_modes())
        check_backend_choice("--lm-head", self.lm_head, lm_heads())
        if self.preempt not in ("recompute", "swap"):
            raise PagechatError(f"--preempt must be recompute or swap, got {self.preempt!r}")
        check_threads(self.threads)
        if self.draft and self.ngram:
            raise PagechatError("choose one proposer: --draft DIR or --ngram, not both")
        for name, value in (
            ("--num-draft", self.num_draft),
            ("--block-size", self.block_size),
            ("--max-batch-tokens", self.max_batch_tokens),
            ("--max-seqs", self.max_seqs),
            ("--kv-blocks", 1 if self.kv_blocks is None else self.kv_blocks),
            ("--kv-memory", 1 if self.kv_memory is None else self.kv_memory),
            ("--swap-blocks", 1 if self.swap_blocks is None else self.swap_blocks),
        ):
            if value < 1:
                raise PagechatError(f"{name} must be >= 1, got {value}")
        return self


def check_backend_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise PagechatError unless value is one of the choices, which depend on the quantisation
    backend: without one, a quantised value names the package it needs."""
    if value in choices:
        return
    if backend() is None:
        raise PagechatError(f"{option} {value} needs pagechat.quant, which is not installed")
    raise PagechatError(
        f"{option} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}"
    )


def check_dtype(name: str, option: str = "--dtype") -> None:
    """Raise PagechatError unless name is auto or a dtype the engine runs: the one check of
    --dtype and --kv-dtype."""
    if name != "auto" and name not in DTYPES:
        names = ["auto", *DTYPES]
        choices = f"{', '.join(names[:-1])} or {names[-1]}"
        raise PagechatError(f"{option} must be {choices}, got {name!r}")


def parse_bytes(text: str) -> int:
    """'2GiB' / '512M' / '1048576' -> bytes; PagechatError on anything else."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGIB")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value < math.inf:  # also refuses nan
        raise PagechatError(f"cannot read {text!r} as a size; write e.g. 2GiB, 512MiB or 1000000")
    return int(value * _UNITS[unit])
