"""What crosses between the app and the engine's loop: commands down, events up, all small frozen
dataclasses (they are pickled through a pipe when the engine runs in its own process).

The first thing the engine sends is its EngineInfo; after that, events in the order the engine made
them, a StepReport per step among them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.engine import Engine
from pagechat.core.memory import EngineMemory, Readings
from pagechat.core.params import SamplingParams
from pagechat.core.report import BeamResult, SeqRecord, StepReport

# -- commands: app -> engine -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Start a reply to `messages` (chat template applied where the engine runs); one at a time."""

    ticket: int  # the UI's id for the reply, echoed by Started or Refused
    messages: list[dict]
    params: SamplingParams
    prefix: tuple[int, ...] = ()  # the reply's first tokens, given (a branch of an earlier one)
    when_full: str = "drop"  # the context cannot hold it: drop the oldest turns, or refuse
    beside: bool = False  # a branch: run beside the reply's answers in flight, not instead


@dataclass(frozen=True, slots=True)
class UpdateParams:
    """New settings for the reply in flight, from its next token; answered by ParamsApplied."""

    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort the reply in flight, keeping what it generated."""


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort these requests (the samples a user did not keep), keeping what they generated."""

    request_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StartLoad:
    """Start `count` background requests from the built-in prompts, `rate` a second, each of
    at most `max_tokens`; answered by LoadSet."""

    count: int
    rate: float
    max_tokens: int = 64


@dataclass(frozen=True, slots=True)
class StopLoad:
    """Start no more background requests and abort those that run; answered by LoadSet(0)."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Stop stepping after the current step; commands are still applied."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Step again whenever there is work."""


@dataclass(frozen=True, slots=True)
class Advance:
    """Run exactly `steps` engine steps now, paused or not (deterministic tests and screenshots)."""

    steps: int


@dataclass(frozen=True, slots=True)
class SetSpeculation:
    """Switch speculation and set the draft length from the next step; answered by
    SpeculationSet."""

    enabled: bool
    num_draft: int


@dataclass(frozen=True, slots=True)
class Sync:
    """Answered by Synced(n) once every command before it has been applied."""

    n: int


@dataclass(frozen=True, slots=True)
class Close:
    """Abort what runs and end the loop."""


Command = (
    Send
    | UpdateParams
    | Stop
    | Abort
    | StartLoad
    | StopLoad
    | Pause
    | Resume
    | Advance
    | SetSpeculation
    | Sync
    | Close
)

# -- events: engine -> app -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """A reply's request was admitted to the engine's queue."""

    ticket: int | None  # None: a request the engine's loop started itself (background load)
    request_id: int
    prompt_tokens: int
    label: str = "chat"  # what the request is, as the scheduler panel names it
    dropped: int = 0  # the conversation's oldest messages left out so that it fits the context


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request produced its first token; ttft_s is the engine's arrival-to-first-token time."""

    request_id: int
    ttft_s: float


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


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused a command; message is its one-line reason."""

    ticket: int | None
    message: str


@dataclass(frozen=True, slots=True)
class BlocksChanged:
    """The pool changed outside a step (an abort freed blocks): the block map's new snapshot, and
    the scheduler's sequences as they are now."""

    snapshot: BlockSnapshot
    seqs: tuple[SeqRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class ParamsApplied:
    """New sampling settings are in force for the active request from its next token."""

    request_id: int | None
    params: SamplingParams
    at_token: int  # output tokens the request had when the settings changed


@dataclass(frozen=True, slots=True)
class SpeculationSet:
    """Speculation as the engine has it after a SetSpeculation command."""

    enabled: bool
    num_draft: int


@dataclass(frozen=True, slots=True)
class MemoryRead:
    """The engine's process or device memory, read where the engine runs (at start, when it goes
    idle, and every MEMORY_EVERY_S while it works)."""

    readings: Readings


@dataclass(frozen=True, slots=True)
class LoadSet:
    """Background load: how many of its requests are still to start (0: none, or stopped)."""

    left: int


@dataclass(frozen=True, slots=True)
class Synced:
    """Every command up to Sync(n) has been applied (consumed by EngineClient.sync)."""

    n: int


Event = (
    StepReport
    | Started
    | FirstToken
    | Finished
    | Refused
    | ParamsApplied
    | BlocksChanged
    | SpeculationSet
    | MemoryRead
    | LoadSet
)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the app shows of the loaded engine before its first event."""

    model_dir: str
    precision: str
    device: torch.device
    graphs: bool  # decode steps replayed from traced graphs
    threads: int  # torch's CPU threads where the engine runs
    memory: EngineMemory
    blocks: BlockSnapshot  # the pool before any command
    proposer: str | None  # the speculation proposer's name, if one was loaded
    speculate: bool
    num_draft: int

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
        )

    @property
    def model_name(self) -> str:
        return Path(self.model_dir).name
