"""`pagechat models`: every model pagechat can open on this machine, a line each, newest first.

It looks where users keep them: the Hugging Face cache's snapshots ($HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub), Ollama's store, and GGUF files and Hugging Face
directories under the current directory (a few levels down, past hidden folders). Each is read as
the engine would read it (config.json or the GGUF's header, never the weights), so what it says
of a model is what loading it would find, and a model that would not load says why in its line.
Whether it fits is the planner's figure (the weights as the engine would hold them here, plus
the KV of one context of up to 4k tokens) against the memory free now.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.gguf import GGUFFile, is_gguf
from pagechat.core.gguf_model import gguf_spec, quant_types
from pagechat.core.loader import read_spec
from pagechat.core.memory import kv_bytes_per_token, meminfo
from pagechat.core.modelspec import ModelSpec
from pagechat.core.ollama import list_models
from pagechat.core.sources import first_part

SEARCH_DEPTH = 3  # folders below the current one searched for models
SKIP = {"node_modules", "__pycache__", "site-packages", "venv"}
FIT_CONTEXT = 4096  # the context a model must hold one of to "fit"


@dataclass(frozen=True, slots=True)
class FoundModel:
    """One model found: what to pass to `pagechat run`, where it was found, and what it is."""

    name: str  # a path, or ollama:NAME:TAG
    source: str  # hf-cache | ollama | gguf | hf-dir
    modified: float
    arch: str = ""
    params: int = 0
    precision: str = ""  # the weights' dtype, or their quantisation
    quant: str = ""  # a GGUF's tensor types, most common first
    weight_bytes: int = 0
    need_bytes: int = 0  # weights and one context's KV
    error: str = ""  # why it would not load


def hf_cache() -> Path:
    """Where the Hugging Face hub keeps downloads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def _candidates(root: Path, depth: int) -> Iterator[tuple[Path, str]]:
    """GGUF models and Hugging Face directories under root, depth folders down."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    if (root / "config.json").is_file():
        yield root, "hf-dir"
    for p in entries:
        if p.suffix == ".gguf" and p.is_file() and first_part(p):
            yield p, "gguf"
        elif depth > 0 and p.is_dir() and not p.name.startswith(".") and p.name not in SKIP:
            yield from _candidates(p, depth - 1)


def find_models(here: Path) -> list[FoundModel]:
    """Every model found, newest first."""
    seen: set[Path] = set()
    found = []
    snapshots = sorted(hf_cache().glob("models--*/snapshots/*"))
    places = [(p, "hf-cache") for s in snapshots for p, _ in _candidates(s, 1)]
    places += list(_candidates(here, SEARCH_DEPTH))
    for path, source in places:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            found.append(describe(path, source))
    for m in list_models():
        found.append(describe(m.model, "ollama", f"ollama:{m.name}", m.manifest))
    return sorted(found, key=lambda m: -m.modified)


def describe(
    path: Path, source: str, name: str | None = None, stamp: Path | None = None
) -> FoundModel:
    """A model's line: its spec and the planner's figures, or why it cannot be read."""
    name = name or str(path)
    try:
        modified = (stamp or path).stat().st_mtime
    except OSError:
        modified = 0.0
    try:
        if path.is_file() and is_gguf(path):
            return _gguf(path, source, name, modified)
        return _hf(path, source, name, modified)
    except PagechatError as e:
        return FoundModel(name, source, modified, error=str(e))


def _gguf(path: Path, source: str, name: str, modified: float) -> FoundModel:
    from pagechat.tools.planner import estimate_gguf_weights

    with GGUFFile(path) as f:
        spec = gguf_spec(f)
        types = quant_types(f)
        weights = estimate_gguf_weights(f, _dtype(spec), _device())
    precision = spec.torch_dtype or next(iter(types))
    return _found(name, source, modified, spec, precision, " · ".join(types), weights)


def _hf(path: Path, source: str, name: str, modified: float) -> FoundModel:
    from pagechat.core.checkpoint import resolve_quant_mode
    from pagechat.core.config import EngineConfig
    from pagechat.quant.loaders import resolve_quant
    from pagechat.tools.planner import estimate_weights

    spec = read_spec(path)
    device = torch.device(_device())
    plan = resolve_quant(spec, resolve_quant_mode(EngineConfig(), spec, device), path)
    weights = estimate_weights(spec, plan.mode, _dtype(spec), plan.group_size, device.type)
    precision = plan.mode or spec.torch_dtype or "float32"
    if plan.mode == "awq":
        precision = f"awq g{plan.group_size}"
    return _found(name, source, modified, spec, precision, "", weights)


def _found(name, source, modified, spec: ModelSpec, precision, quant, weights) -> FoundModel:
    context = min(FIT_CONTEXT, spec.max_position_embeddings)
    kv = kv_bytes_per_token(spec, _kv_dtype(spec)) * context
    params = sum(r.params for r in weights.rows)
    return FoundModel(
        name,
        source,
        modified,
        spec.arch,
        params,
        precision,
        quant,
        weights.total,
        weights.total + kv,
    )


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype(spec: ModelSpec) -> torch.dtype:
    from pagechat.core.checkpoint import resolve_dtype

    return resolve_dtype("auto", torch.device(_device()), spec.torch_dtype)


def _kv_dtype(spec: ModelSpec) -> torch.dtype:
    from pagechat.core.checkpoint import resolve_kv_dtype

    return resolve_kv_dtype("auto", _dtype(spec), torch.device(_device()))


def free_memory() -> int | None:
    """The memory a model could take now: the GPU's free memory, else the machine's available."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return meminfo("MemAvailable")
