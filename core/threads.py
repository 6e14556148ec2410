"""How many CPU threads torch runs the engine on: --threads, or a default from the cores the
machine's other processes leave free when the engine starts (docs/benchmarks.md, "Threads"); and
the one thread an engine that does not run on the main thread loads and steps on."""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch
from pagechat.core.errors import PagechatError

T = TypeVar("T")

# How long the machine's CPU use is watched to pick the default: long enough to see a process
# that keeps a core busy, short next to loading a model.
WATCH_S = 0.3
# A core counts as taken when other processes use more than this share of it: a torch thread
# that shares its core gets preempted for whole time slices while its partners wait for it, and
# even a quarter of a core used elsewhere made two threads slower than one (docs/benchmarks.md).
TAKEN = 0.1


def default_threads(cores: int, busy: float) -> int:
    """The default thread count on `cores` usable cores while other processes keep `busy` cores'
    worth of CPU in use: one thread per core they leave free, at least one.

    A parallel torch op ends when its slowest thread does; a thread whose core another process
    also wants is descheduled for whole time slices, and its partners spin waiting for it."""
    return max(1, cores - max(0, math.ceil(busy - TAKEN)))


def check_threads(threads: int | None) -> None:
    """PagechatError unless threads is None (the default) or at least 1."""
    if threads is not None and threads < 1:
        raise PagechatError(f"--threads must be >= 1, got {threads}")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def others_busy(seconds: float = WATCH_S) -> float:
    """Cores' worth of CPU that other processes used over the next `seconds` (Linux /proc/stat,
    less this process's own use); 0.0 where /proc/stat cannot be read."""
    try:
        start, own = _busy_s(), time.process_time()
        time.sleep(seconds)
        used = _busy_s() - start - (time.process_time() - own)
    except OSError:
        return 0.0
    return max(0.0, used / seconds)


def _busy_s() -> float:
    """Seconds of CPU all processes have used since boot (every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def env_threads() -> int | None:
    """OMP_NUM_THREADS when it is set to a count (torch itself reads it at start), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) >= 1 else None


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU threads to `threads`, or when None to OMP_NUM_THREADS or the default for
    the cores free now; returns the count set."""
    check_threads(threads)
    count = threads or env_threads() or default_threads(usable_cores(), others_busy())
    torch.set_num_threads(count)
    return count


class EngineThread:
    """A daemon thread that runs the calls handed to it, in order: an engine's load, then its loop.

    Every torch op of an engine must run on one thread. libgomp (torch's OpenMP) keeps a pool of
    workers for each thread that ever ran a parallel op; once the process holds more of them than
    it has cores, an idle worker spins ~100 times instead of ~300,000 before it sleeps, so each of
    a step's hundreds of parallel ops waits for its workers to wake. Loaded on the main thread and
    stepped on another, a 135M model decoded at 18-22 ms a token instead of 10-13
    (docs/benchmarks.md, "Serving"). Not a one-worker ThreadPoolExecutor: the interpreter joins
    its worker at exit, and the loop this thread runs returns only when stopped."""

    def __init__(self, name: str = "pagechat-engine") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn() on the thread after what was handed to it before; its future."""
        future: Future[T] = Future()
        self._calls.put((future, fn))
        return future

    def close(self) -> None:
        """End the thread once what was handed to it has run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn = call
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - raised again by the caller's future
                future.set_exception(e)
