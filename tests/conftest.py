"""Shared fixtures: tiny random checkpoints of every supported architecture, made once per test
session."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from pagechat.tools.make_model import make_model

# Tiny models run fastest on one thread, and a shared 2-core machine makes extra threads spin-wait.
torch.set_num_threads(1)
# ...and so does every Engine a test builds, here and in spawned engine processes: an engine
# without --threads takes OMP_NUM_THREADS when it is set (core/threads.py).
os.environ["OMP_NUM_THREADS"] = "1"

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """arch -> directory of a tiny random checkpoint (transformers' own classes, fp32)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch, "tiny", seed=1) for arch in ARCHS}


@pytest.fixture
def anyio_backend():
    """The app's Pilot tests run on asyncio, as the app does."""
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir():
    """The tiny llama the app's tests drive (drive.tiny_model_dir: one per process)."""
    from drive import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


def cli(argv: list[str], capsys) -> tuple[int | None, str, str]:
    """Run the pagechat CLI in-process (no torch import per call); (exit code, stdout, stderr)."""
    from pagechat.tui.cli import main

    old = sys.argv
    sys.argv = ["pagechat", *argv]
    try:
        main()
        code = None
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err
