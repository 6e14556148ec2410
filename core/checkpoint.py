"""Loading: a checkpoint (an HF directory, a GGUF file, an Ollama model) read, checked,
quantised as asked and placed on its device, with the dtypes the settings and the CPU call for."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from pagechat.core.gguf_model import FLOATS
from pagechat.core.loader import load_tokenizer, open_weights, read_spec
from pagechat.core.model import DecoderModel
from pagechat.core.modelspec import DTYPES, ModelSpec, dtype_name
from pagechat.core.native import cpu_has_native_bf16
from pagechat.core.quantization import QuantPlan, resolve_quant
from pagechat.core.spec import DraftModelProposer, NgramProposer


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; asking for cuda without one is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise PagechatError("--device cuda was asked for, but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """auto -> the checkpoint's dtype on CUDA; bfloat16 on a CPU with native bf16; float32
    otherwise."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_kv_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """auto -> float16 where the model computes in float32 on a CPU (half the KV memory, and half
    the bytes attention reads a step, as llama.cpp keeps its cache), else the compute dtype."""
    if name != "auto":
        return DTYPES[name]
    return torch.float16 if device.type == "cpu" and compute == torch.float32 else compute


def resolve_quant_mode(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> str | None:
    """--quant, else bf16-wo for a bf16 checkpoint under --dtype auto on a CPU without native bf16:
    its linear weights stay in bf16 as stored, so decode streams half the bytes float32 would,
    while prefill, activations and the KV pool stay float32."""
    if (
        cfg.quant is None
        and cfg.dtype == "auto"
        and device.type == "cpu"
        and spec.quantization is None
        and spec.torch_dtype == "bfloat16"
        and not cpu_has_native_bf16()
    ):
        return "bf16-wo"
    return cfg.quant


@dataclass(slots=True)
class LoadedModel:
    """A checkpoint ready to run: its spec, tokenizer, quantisation mode and decoder on the
    device."""

    spec: ModelSpec
    quant: QuantPlan
    tokenizer: object
    model: DecoderModel
    dtype: torch.dtype
    max_len: int

    @property
    def precision(self) -> str:
        """The activation dtype, and the weights' quantisation mode if any: 'float32', 'float32 ·
        bf16-wo'; a GGUF's its most common quantised type: 'bfloat16 · Q4_K'."""
        dtype = dtype_name(self.dtype)
        mode = self.quant.mode
        if mode == "gguf":
            floats = {t.name for t in FLOATS}
            mode = next((t for t in self.spec.quantization["types"] if t not in floats), mode)
        return f"{dtype} · {mode}" if mode else dtype


def load_checkpoint(model_dir: Path, cfg: EngineConfig, device: torch.device) -> LoadedModel:
    """Read, check and load one checkpoint directory (the target model, or a speculative draft)."""
    spec = read_spec(model_dir)
    quant = resolve_quant(
        spec, resolve_quant_mode(cfg, spec, device), model_dir, cfg.lm_head
    )  # refuses what cannot run
    dtype = resolve_dtype(cfg.dtype, device, spec.torch_dtype)
    tokenizer = load_tokenizer(model_dir)
    max_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    weights = open_weights(model_dir, spec)
    weights.check_layers(spec.num_layers)
    try:
        model = DecoderModel(
            spec,
            weights,
            dtype,
            max_len,
            device,
            load=quant.loader(device),
            head=quant.head(device, dtype),
            embed=quant.embedding(device, dtype),
        )
    finally:
        weights.close()  # the model holds its own tensors: the file's pages are let go
    return LoadedModel(spec, quant, tokenizer, model.to(device).eval(), dtype, max_len)


def load_proposer(
    target: LoadedModel,
    source: Path,
    cfg: EngineConfig,
    device: torch.device,
    num_blocks: int,
    graphs,
) -> NgramProposer | DraftModelProposer | None:
    """The speculative proposer the config asks for, or None, for the target loaded from source
    (graphs: quant plan -> whether its model's small steps run as traced graphs)."""
    if cfg.ngram:
        return NgramProposer()
    if not cfg.draft:
        return None
    # --quant and --lm-head name the target's; a draft is quantised only if its own checkpoint
    # is, and its head follows (auto). It runs at the target's dtype, never as an automatic
    # bf16-wo: a draft is small, so bound by per-op overhead, which bf16-wo's casts add to
    # (docs/benchmarks.md).
    draft_cfg = replace(cfg, quant=None, lm_head="auto", dtype=dtype_name(target.dtype))
    draft = load_checkpoint(Path(cfg.draft), draft_cfg, device)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise PagechatError(
            f"the draft model's tokenizer ({cfg.draft}) differs from the target's "
            f"({source}); a draft must share the target's vocabulary"
        )
    vocab = target.spec.vocab_size
    return DraftModelProposer(
        draft, num_blocks, cfg.block_size, device, vocab, graphs(draft.quant), cfg.max_seqs
    )
