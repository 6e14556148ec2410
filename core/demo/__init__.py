"""The demo models shipped with pagechat: a tiny chat model and its draft, trained by `pagechat train-demo`."""
from __future__ import annotations

from pathlib import Path

from pagechat.core.errors import PagechatError

DEMO_DIR = Path(__file__).resolve().parent


def _shipped(name: str) -> Path:
    path = DEMO_DIR / name
    if not (path / "config.json").is_file():
        raise PagechatError(f"the demo {name} model is missing from {path}; reinstall pagechat or run "
                            f"`pagechat train-demo {DEMO_DIR}`")
    return path


def chat_model_dir() -> Path:
    """The shipped demo chat model's directory (what `pagechat run` opens without a MODEL_DIR)."""
    return _shipped("chat")


def draft_model_dir() -> Path:
    """The shipped draft model's directory: same vocabulary, at most a quarter of the chat model's size."""
    return _shipped("draft")
