"""What a model argument names on disk: a Hugging Face directory, a GGUF file (or a folder holding
one), or an Ollama model (`ollama:NAME[:TAG]`). Light to import: `pagechat history` and the app's
resume checks use it without loading torch.
"""

from __future__ import annotations

from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.core.gguf import SPLIT, is_gguf, split_parts
from pagechat.core.ollama import OllamaModel, find_model


def ollama_model(path: Path) -> OllamaModel | None:
    """The Ollama model `ollama:NAME[:TAG]` names, or None for any other path."""
    text = str(path)
    return find_model(text.removeprefix("ollama:")) if text.startswith("ollama:") else None


def resolve_model(path: Path) -> Path:
    """What a model argument names on disk: `ollama:NAME[:TAG]` -> its GGUF blob in Ollama's
    store; a directory without config.json that holds one GGUF model (or one split of one) ->
    that file; anything else as it is."""
    ollama = ollama_model(path)
    if ollama is not None:
        return ollama.model
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.glob("*.gguf") if first_part(p))
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:3])
            raise PagechatError(f"{path} holds {len(found)} GGUF models ({names}...); name one")
        if found:
            return found[0]
    return path


def first_part(path: Path) -> bool:
    """Whether a .gguf file is a whole model or the first part of a split one."""
    m = SPLIT.match(path.name)
    return m is None or int(m["no"]) == 1


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a model argument names (of a split model, the first part, which holds the
    metadata), or None for a Hugging Face directory."""
    found = resolve_model(path)
    return split_parts(found)[0] if found.is_file() and is_gguf(found) else None


def check_model_dir(path: Path) -> Path:
    """The model must exist: a directory, a GGUF file, or an Ollama model."""
    if str(path).startswith("ollama:"):
        resolve_model(path)  # says what is missing from the store
        return path
    if not path.exists():
        raise PagechatError(
            f"model directory {path} does not exist; make one with `pagechat make-model {path}`"
        )
    if path.is_file() and not is_gguf(path):
        raise PagechatError(
            f"{path} is a file but not a GGUF model (give a GGUF file or the folder holding "
            "config.json)"
        )
    return path
