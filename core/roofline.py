"""What bounds a step: the machine's memory read speed and its peak matmul rate, measured once
when the engine loads, and what each step asked of them, from its StepReport. A decode step reads
every weight and the KV of every token its sequences attend to, so its bytes over its time against
the read speed is its memory-bandwidth use (MBU); a prefill step multiplies many rows, so its
FLOP/s against the peak says how far it is from compute-bound. The Timing panel shows both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from pagechat.core.memory import EngineMemory
from pagechat.core.report import BatchItem

READ_MIB = 256  # more than any CPU's last-level cache: the read comes from memory
GPU_READ_MIB = 2048  # ~0.5 ms at an H200's 4.8 TB/s: long beside a launch, 30x its L2
LINEAR_KINDS = ("attention", "mlp")  # their weights multiply every token a step computes


def sync(device: torch.device) -> None:
    """Wait for a GPU's queued work, so a timer stops when the work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, work, repeats: int) -> float:
    """Median seconds of `work` over the repeats after two warm-up runs."""
    if device.type == "cuda":
        return gpu_seconds(work, repeats)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def gpu_seconds(work, repeats: int) -> float:
    """Median seconds of one call of `work` by CUDA events around ten calls, after one: a GPU
    ends a product in microseconds, less than a host timer's synchronisation costs."""
    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10e3)
    return statistics.median(times)


def read_bandwidth(device: torch.device, mib: int | None = None) -> float:
    """Bytes a second of a plain streaming read of `mib` MiB (READ_MIB on a CPU, GPU_READ_MIB or
    a quarter of the free memory on a GPU): on a CPU pagechat's read loop (quant/kernels.cpp's
    stream_read, once quant has loaded it), else (and on a GPU) a float32 matrix-vector product,
    the decode floor's work, which reads about as fast."""
    if mib is None:
        mib = READ_MIB
        if device.type == "cuda":
            mib = min(GPU_READ_MIB, torch.cuda.mem_get_info(device)[0] // 4 // 2**20)
    n = int((mib * 2**20 / 4) ** 0.5)
    w = torch.ones(n, n, device=device)  # what is read does not matter; that it is in memory does
    x = torch.ones(n, device=device)
    read = _stream_read() if device.type == "cpu" else None
    seconds = median_seconds(
        device, (lambda: read(w)) if read is not None else lambda: torch.mv(w, x), 5
    )
    return w.numel() * 4 / seconds


def _stream_read():
    try:
        return torch.ops.pagechat.stream_read
    except (AttributeError, RuntimeError):  # pagechat's kernels are not built on this machine
        return None


def peak_flops(device: torch.device, dtype: torch.dtype, budget_s: float = 0.05) -> float:
    """FLOP/s of a square matmul in the model's compute dtype, about the best a prefill's GEMMs
    reach here: of 1024 rows (8192 on a GPU, which a smaller product leaves half idle), or fewer
    where a product that size would take longer than budget_s (float16 on a CPU without float16
    arithmetic: seconds)."""
    size, largest = 128, 8192 if device.type == "cuda" else 1024
    while True:
        # random, not constant: a GPU multiplies zeros and repeated values faster
        a = torch.randn(size, size, device=device).to(dtype)
        seconds = median_seconds(device, lambda a=a: torch.mm(a, a), 3)
        if size >= largest or 8 * seconds > budget_s:  # the next size: eight times the work
            return 2 * size**3 / seconds
        size *= 2


@dataclass(frozen=True, slots=True)
class Roofline:
    """The machine's limits for this engine: read bandwidth (bytes/s), matmul peak (FLOP/s)."""

    bandwidth: float
    peak_flops: float

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype) -> Roofline:
        return cls(read_bandwidth(device), peak_flops(device, dtype))


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step asked of the machine: bytes read (every weight, and the KV of the tokens
    each sequence attends to) and the FLOPs of its linear layers."""

    bytes_read: int
    flops: float

    @classmethod
    def of(cls, batch: tuple[BatchItem, ...], memory: EngineMemory) -> StepWork:
        """From what the step ran (StepReport.batch) and what the engine holds."""
        kv_per_token = memory.block_bytes // memory.block_size
        tokens = sum(item.tokens for item in batch)
        attended = sum(item.start + item.tokens for item in batch)
        params = {kind: 0 for kind in (*LINEAR_KINDS, "lm_head", "embedding")}
        for row in memory.weights.rows:
            if row.kind in params:
                params[row.kind] += row.params
        head = params["lm_head"] or params["embedding"]  # a tied head is the embedding's matrix
        # every token goes through the layers; the LM head runs once per sequence a step
        linear = sum(params[k] for k in LINEAR_KINDS) * tokens + head * len(batch)
        return cls(memory.weights.total + kv_per_token * attended, 2.0 * linear)


def step_rates(
    steps: Iterable[tuple[str, float, tuple[BatchItem, ...]]], memory: EngineMemory
) -> tuple[float | None, float | None]:
    """(bytes a second the decode steps read, FLOP/s the steps that computed prompts reached)
    over the given steps (kind, seconds, batch); None where no step of the kind ran."""
    read = [0.0, 0.0]  # bytes, seconds
    computed = [0.0, 0.0]  # FLOPs, seconds
    for kind, seconds, batch in steps:
        work = StepWork.of(batch, memory)
        if kind == "decode":
            read[0], read[1] = read[0] + work.bytes_read, read[1] + seconds
        elif kind in ("prefill", "mixed"):
            computed[0], computed[1] = computed[0] + work.flops, computed[1] + seconds
    return (
        read[0] / read[1] if read[1] else None,
        computed[0] / computed[1] if computed[1] else None,
    )
