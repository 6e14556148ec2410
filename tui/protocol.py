"""What crosses between the app and the engine's loop: commands down, events up, all small frozen
dataclasses (they are pickled through a pipe when the engine runs in its own process).

The first thing the engine sends is its EngineInfo; after that, events in the order the engine made
them, a StepReport per step among them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagechat.core.events import (
    BlocksChanged,
    Finished,
    FirstToken,
    MemoryRead,
    Started,
)
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport

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
class Refused:
    """The engine refused a command; message is its one-line reason."""

    ticket: int | None
    message: str


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
