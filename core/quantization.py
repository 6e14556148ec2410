"""The interface quantisation plugs into: the engine asks a registry, and never names a quantised
class.

A backend (pagechat.quant is the one this package ships) is found through the `pagechat.quant`
entry-point group, as vLLM finds its plugins, so the engine imports nothing above itself. It turns
a checkpoint and the `--quant` and `--lm-head` requests into a `QuantPlan`: how each decoder linear
and the LM head are built. With no backend installed the engine runs float checkpoints and refuses
quantised ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

import torch
from pagechat.core.errors import PagechatError
from pagechat.core.model import (
    LinearLoader,
    TableLoader,
    dense_embedding,
    dense_head,
    dense_linear,
)
from pagechat.core.modelspec import ModelSpec
from torch import nn

ENTRY_POINT_GROUP = "pagechat.quant"
Storage = tuple[str, str, list[torch.Tensor]]  # (format, kernel path, every tensor the layer holds)


class QuantPlan(Protocol):
    """How one checkpoint's linears load: what the model builder and the step graphs need to
    know."""

    mode: str | None  # the --quant name in force, None for plain weights

    @property
    def label(self) -> str: ...

    @property
    def traceable(self) -> bool:
        """Whether a trace records these layers faithfully (no data-dependent Python per call)."""
        ...

    def loader(self, device: torch.device) -> LinearLoader: ...

    def head(self, device: torch.device, dtype: torch.dtype) -> TableLoader: ...

    def embedding(self, device: torch.device, dtype: torch.dtype) -> TableLoader: ...


class QuantBackend(Protocol):
    """What a quantisation package registers under the entry-point group."""

    modes: tuple[str, ...]
    lm_heads: tuple[str, ...]  # --lm-head's choices

    def resolve(
        self, spec: ModelSpec, requested: str | None, model_dir: Path, lm_head: str
    ) -> QuantPlan:
        """The plan for this checkpoint and requests; PagechatError (one line) for what cannot
        run."""
        ...

    def storage(self, module: nn.Module) -> Storage | None:
        """A quantised layer's format, kernel path and tensors; None for any other module."""
        ...


@dataclass(frozen=True, slots=True)
class DensePlan:
    """Weights as the checkpoint stores them, in the model's dtype."""

    mode: None = None
    label: str = "none (weights in the model dtype)"
    traceable: bool = True

    def loader(self, device: torch.device) -> LinearLoader:
        return dense_linear

    def head(self, device: torch.device, dtype: torch.dtype) -> TableLoader:
        return dense_head(dtype)

    def embedding(self, device: torch.device, dtype: torch.dtype) -> TableLoader:
        return dense_embedding(dtype)


@cache
def backend() -> QuantBackend | None:
    """The installed quantisation backend, loaded once; None when there is none."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    return next(iter(found)).load() if found else None


def quant_modes() -> tuple[str, ...]:
    """The --quant names the installed backend accepts."""
    found = backend()
    return found.modes if found is not None else ()


def lm_heads() -> tuple[str, ...]:
    """The --lm-head names: the backend's, or without one the model's own head (auto, float)."""
    found = backend()
    return found.lm_heads if found is not None else ("auto", "float")


def resolve_quant(
    spec: ModelSpec, requested: str | None, model_dir: Path, lm_head: str = "auto"
) -> QuantPlan:
    """Ask the backend for a plan; without one, plain weights, and a refusal for anything
    quantised (EngineConfig.validate has refused a quantised --lm-head already)."""
    found = backend()
    if found is not None:
        return found.resolve(spec, requested, model_dir, lm_head)
    if requested is not None or spec.quantization is not None:
        what = f"--quant {requested}" if requested else f"the quantised checkpoint in {model_dir}"
        raise PagechatError(f"{what} needs pagechat's quantisation package (pagechat.quant)")
    return DensePlan()


def weight_storage(module: nn.Module) -> Storage | None:
    """How a quantised layer stores its weights, as its backend says; None for a plain module."""
    found = backend()
    return found.storage(module) if found is not None else None
