"""pagechat's own CPU matmul kernels (kernels.cpp), compiled on first use and cached.

`op(name)` is torch.ops.pagechat.<name> (int8_linear, int4_linear, float_linear) once the extension
is loaded, or None when it cannot run here: PAGECHAT_KERNELS=0, a CPU without AVX2, FMA and F16C, or
no compiler (g++ and ninja) or a build that fails. Then the layers keep torch's own kernels, and the
reason is logged once. The build
(about 11 s with g++ 12 on 2 cores) lands in ~/.cache/pagechat/kernels ($PAGECHAT_CACHE/kernels if
set), in a folder named by a hash of the source, the flags and the torch version, so an edit or
another torch builds anew and every later process loads the cached library in about a millisecond.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# AVX2 and FMA only, not -march=native: the cached build must run on any host that passes _cpu_ok
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
# the paths layers report when they run these kernels
INT8_PATH, INT4_PATH, FLOAT_PATH = "int8-avx2", "int4-avx2", "avx2"
# decode and small batches, as measured (1-16 rows); prefill's many rows are a GEMM, torch's part
MAX_ROWS = 16
BLOCK = 32  # activations are quantised per block of 32: K must be a multiple
FLOAT_STEP = 8  # float kernels take K in steps of 8


def enabled() -> bool:
    """Whether PAGECHAT_KERNELS allows pagechat's kernels (unset or anything but 0/false/no/off)."""
    return os.environ.get("PAGECHAT_KERNELS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _cpu_ok() -> bool:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):  # not Linux: trust torch's own dispatch level
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return {"avx2", "fma", "f16c"} <= set(flags)


def cache_dir() -> Path:
    """Where built kernels are kept: $PAGECHAT_CACHE/kernels, else ~/.cache/pagechat/kernels."""
    root = os.environ.get("PAGECHAT_CACHE") or Path.home() / ".cache" / "pagechat"
    return Path(root) / "kernels"


def _build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode())
    return h.hexdigest()[:16]


def _load() -> None:
    """Load the cached library, building it first where there is none."""
    name = f"pagechat_kernels_{_build_key()}"
    build = cache_dir() / name
    lib = build / f"{name}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
        return
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
    )


def op(name: str):
    """torch.ops.pagechat.<name>, or None where pagechat's kernels cannot run (why is logged once):
      int8_linear(x [M, K], weight int8 [N, K], scales [N])
      int4_linear(x [M, K], packed uint8 [N, K/2], scales float32 [N, K/g], zeros uint8 [N, K/g], g)
      float_linear(x [M, K], weight float32 or bf16 [N, K])
    each -> float32 [M, N]; and int4_dequantize(packed, scales, zeros, g) -> float32 [N, K]."""
    return getattr(torch.ops.pagechat, name) if loaded() else None


@functools.cache
def loaded() -> bool:
    """Whether the kernels are loaded, building them first where needed; why not is logged once."""
    if not enabled():
        log.info("pagechat kernels off: PAGECHAT_KERNELS=0; layers use torch's")
        return False
    why = None
    if not _cpu_ok():
        why = "this CPU lacks AVX2/FMA/F16C"
    elif not (shutil.which("ninja") or _has_ninja_module()) or not shutil.which("c++"):
        why = "no C++ compiler and ninja to build them"
    if why is None:
        try:
            _load()
            return True
        except Exception as e:  # a failed build or load must leave torch's path working
            why = f"the build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else e!r})"
    log.warning("pagechat kernels off: %s; layers use torch's", why)
    return False


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True
