"""What a loop running the engine tells those who watch it, besides each StepReport: a request
started, its first token, its end, the pool changed between steps, a memory reading, and first of
all what engine it is (EngineInfo). The app's loop and the server's loop send the same records;
core/wire.py writes them as JSON for a server's watchers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.engine import Engine
from pagechat.core.memory import EngineMemory, Readings
from pagechat.core.report import BeamResult, SeqRecord
from pagechat.core.roofline import Roofline
from pagechat.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Started:
    """A reply's request was admitted to the engine's queue."""

    ticket: int | None  # None: not the app's own reply (background load, another API client)
    request_id: int
    prompt_tokens: int
    label: str = "chat"  # what the request is, as the scheduler panel names it
    dropped: int = 0  # the conversation's oldest messages left out so that it fits the context
    ref: str = ""  # a served request's response id (with the client's X-Request-Id in it), or ""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request produced its first token; ttft_s is the engine's arrival-to-first-token time."""

    request_id: int
    ttft_s: float

    @classmethod
    def of(cls, seq: Sequence) -> FirstToken:
        return cls(seq.seq_id, seq.first_token_time - seq.arrival)


@dataclass(frozen=True, slots=True)
class Finished:
    """The request finished (stop, length, abort or error), with the engine's own timestamps."""

    request_id: int
    reason: str | None
    error: str | None
    output_tokens: int
    cached_tokens: int
    ttft_s: float | None
    total_s: float
    beams: tuple[BeamResult, ...] = ()  # a beam search's hypotheses, best first
    fault: bool = False  # the error is the engine's own (a step failed), not the request's

    @classmethod
    def of(cls, seq: Sequence) -> Finished:
        """A request as it ends (or is aborted: no finish time yet, so now)."""
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        total = (seq.finish_time or time.perf_counter()) - seq.arrival
        return cls(
            seq.seq_id,
            seq.finish_reason,
            seq.error,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            ttft,
            total,
            seq.beams,
            seq.fault,
        )


@dataclass(frozen=True, slots=True)
class BlocksChanged:
    """The pool changed outside a step (an abort freed blocks): the block map's new snapshot, and
    the scheduler's sequences as they are now."""

    snapshot: BlockSnapshot
    seqs: tuple[SeqRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryRead:
    """The engine's process or device memory, read where the engine runs (at start, when it goes
    idle, and every MEMORY_EVERY_S while it works)."""

    readings: Readings


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the app shows of the loaded engine before its first event."""

    model_dir: str
    precision: str
    device: torch.device
    graphs: bool  # decode steps replayed from traced graphs (CUDA graphs on a GPU)
    threads: int  # torch's CPU threads where the engine runs
    memory: EngineMemory
    blocks: BlockSnapshot  # the pool as the first event finds it (a watcher: as it joins)
    proposer: str | None  # the speculation proposer's name, if one was loaded
    speculate: bool
    num_draft: int
    roofline: Roofline  # this machine's read speed and matmul peak, measured as it loaded

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        proposer = engine.proposer.name if engine.proposer is not None else None
        return cls(
            str(engine.model_dir),
            engine.precision,
            engine.device,
            engine.graphs,
            torch.get_num_threads(),
            EngineMemory.of(engine),
            engine.block_map.snapshot(),
            proposer,
            engine.speculate,
            engine.num_draft,
            Roofline.measure(engine.device, engine.dtype),
        )

    @property
    def model_name(self) -> str:
        return Path(self.model_dir).name
