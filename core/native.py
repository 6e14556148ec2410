"""pagechat's C++ CPU code, compiled on first use and cached: the decoder's fused small ops
(core/ops.cpp) and the matmul kernels (quant/kernels.cpp) are each one such library.

`library(source, what)` loads the library built from `source`, or says why it cannot once (logged)
and returns False: PAGECHAT_KERNELS=0, a CPU without AVX2, FMA and F16C, no compiler (g++ and
ninja), or a build that fails. Then the callers keep torch's own ops. A build (about 10 s with
g++ 12 on 2 cores) lands in ~/.cache/pagechat/kernels ($PAGECHAT_CACHE/kernels if set), in a folder
named by a hash of the source, the flags and the torch version, so an edit or another torch builds
anew and every later process loads the cached library in about a millisecond. Each library
registers its ops as torch.ops.pagechat.*, so that traced steps record them.
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

# AVX2, FMA and F16C only, not -march=native: a cached build must run on any host that passes
# _cpu_ok (code for newer CPUs is compiled per function, under a target pragma, and called only
# where the CPU has it)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 natively: there bf16 is the faster compute dtype,
    elsewhere it is emulated. On x86 Linux that is AVX512-BF16 or AMX in /proc/cpuinfo, not
    torch's check alone, which says yes for any AVX512 CPU: there oneDNN emulates bf16, and a
    bf16 prefill ran 3x slower than float32 (docs/benchmarks.md, "bf16 weights on a CPU without
    native bf16")."""
    flags = cpu_flags()
    if flags and not {"avx512_bf16", "amx_bf16"} & flags:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def enabled() -> bool:
    """Whether PAGECHAT_KERNELS allows pagechat's C++ code (unset, or not 0/false/no/off)."""
    return os.environ.get("PAGECHAT_KERNELS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo), or None elsewhere."""
    try:
        line = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return None
    return frozenset(line.split(":", 1)[1].split())


def avx2_only() -> bool:
    """PAGECHAT_KERNELS=avx2: pagechat's C++ code without its AVX512 parts (int weights in rows,
    not panels), to compare the two or to step around the newer one."""
    return os.environ.get("PAGECHAT_KERNELS", "").strip().lower() == "avx2"


def _cpu_ok() -> bool:
    flags = cpu_flags()
    if flags is None:  # not Linux: trust torch's own dispatch level
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return {"avx2", "fma", "f16c"} <= flags


def cache_dir() -> Path:
    """Where built libraries are kept: $PAGECHAT_CACHE/kernels, else ~/.cache/pagechat/kernels."""
    root = os.environ.get("PAGECHAT_CACHE") or Path.home() / ".cache" / "pagechat"
    return Path(root) / "kernels"


INCLUDE = Path(__file__).parent  # simd.h, the helpers both libraries share


def _load(source: Path) -> None:
    """Load the cached library built from source, building it first where there is none."""
    h = hashlib.sha256(source.read_bytes())
    for header in sorted({*INCLUDE.glob("*.h"), *source.parent.glob("*.h")}):
        h.update(header.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode())
    name = f"pagechat_{source.stem}_{h.hexdigest()[:16]}"
    build = cache_dir() / name
    lib = build / f"{name}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
        return
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(INCLUDE)],
        build_directory=str(build),
        is_python_module=False,
    )


@functools.cache
def library(source: Path, what: str) -> bool:
    """Whether the library built from source is loaded, building it first where needed; why not
    is logged once per library, naming it by `what`."""
    if not enabled():
        log.info("pagechat %s off: PAGECHAT_KERNELS=0; torch's ops run instead", what)
        return False
    why = None
    if not _cpu_ok():
        why = "this CPU lacks AVX2/FMA/F16C"
    elif not (shutil.which("ninja") or _has_ninja_module()) or not shutil.which("c++"):
        why = "no C++ compiler and ninja to build them"
    if why is None:
        try:
            _load(source)
            return True
        except Exception as e:  # a failed build or load must leave torch's path working
            why = f"the build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else e!r})"
    log.warning("pagechat %s off: %s; torch's ops run instead", what, why)
    return False


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True
