"""The demo models shipped with pagechat: a tiny chat model, its 4-bit AWQ variant and a draft,
trained by `pagechat train-demo` and used whenever a command is given no MODEL_DIR."""

from __future__ import annotations

from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.core.sources import check_model_dir

DEMO_DIR = Path(__file__).resolve().parent
DEMO_DRAFT = "demo"  # `--draft demo`: the shipped draft model


def _shipped(name: str) -> Path:
    path = DEMO_DIR / name
    if not (path / "config.json").is_file():
        raise PagechatError(
            f"the demo {name} model is missing from {path}; reinstall pagechat, run "
            f"`pagechat train-demo {DEMO_DIR}`, or make a model with `pagechat make-model ./tiny`"
        )
    return path


def chat_model_dir() -> Path:
    """The shipped demo chat model's directory (what `pagechat run` opens without a MODEL_DIR)."""
    return _shipped("chat")


def awq_model_dir() -> Path:
    """The chat model quantised to 4-bit AWQ by pagechat (`--quant awq` without a MODEL_DIR)."""
    return _shipped("chat-awq")


def draft_model_dir() -> Path:
    """The shipped draft model's directory: same vocabulary, at most a quarter of the chat model."""
    return _shipped("draft")


def model_or_demo(model_dir: Path | None, quant: str | None = None) -> Path:
    """The given model directory (which must exist), else the demo chat model (its AWQ variant for
    --quant awq; int8 is made from the chat model's weights as it loads)."""
    if model_dir is None:
        return awq_model_dir() if quant == "awq" else chat_model_dir()
    return check_model_dir(model_dir)


def draft_or_demo(draft: Path | None) -> str | None:
    """--draft's value as EngineConfig takes it: `demo` (unless a directory of that name exists) is
    the shipped draft."""
    if draft is None:
        return None
    if str(draft) == DEMO_DRAFT and not draft.is_dir():
        return str(draft_model_dir())
    return str(draft)
