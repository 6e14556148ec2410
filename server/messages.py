"""What crosses between the HTTP handlers and the engine's thread: a Submission in, ChoiceDeltas
out. Small frozen records; the engine's own objects never leave its thread."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagechat.core.params import SamplingParams


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One candidate token with its log-probability."""

    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely candidates at its position."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class ChoiceUsage:
    """A finished choice's token counts; a forked sample (n > 1) shares its prompt, so counts none
    of it."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """New output of one choice: text, its tokens' logprobs (when asked), and how it ended."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last delta
    error: str | None = None
    usage: ChoiceUsage | None = None  # on the last delta
    fault: bool = False  # the error is the engine's own (a 500), not the request's (a 400)
    tokens: int = 0  # tokens it carries (their text may be held back: part of a character)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, eq=False)
class Submission:
    """One prompt handed to the engine's thread, with where its deltas go: choices first_index ..
    first_index + n - 1 of the HTTP request, as lists of ChoiceDelta put on `deltas`."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None  # top candidates per token to return; None: no logprobs
    first_index: int
    deltas: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None  # the engine's id, set by the engine's thread
    label: str = "api chat"  # what watchers call it: the API it came through
    ref: str = ""  # its response's id, which watchers match to the client's request
