"""Sequence: one request's tokens, progress through the KV pool, and its output text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from pagechat.core.grammar import Matcher
from pagechat.core.params import SamplingParams
from pagechat.core.report import BeamResult, SpecTotals


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks copied to the host pool
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingState:
    """How a sequence picks its tokens: its settings (replaced whole by update_params) and its
    random stream (a new one when the seed changes)."""

    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the scheduler sees it: prompt + generated ids and how many have KV in the
    pool."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingState
    arrival: float
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # tokens served from the prefix cache (over all admissions)
    num_preemptions: int = 0
    target_forwards: int = 0  # target model passes this sequence took part in
    beams: tuple[BeamResult, ...] = ()  # a finished beam search's hypotheses, best first
    spec: SpecTotals = SpecTotals()  # speculation so far, summed where drafts are verified
    parent: int | None = None  # the sequence this sample was forked from
    sample_index: int = 0  # k of its request's n samples (0: the request's own sequence)
    children: list[int] = field(
        default_factory=list
    )  # ids of the samples forked from this one (n > 1)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    fault: bool = False  # the error is the engine's own (a step failed), not the request's
    priority: int = 0  # lower is admitted first and preempted last (the app's chat 0, load 1)
    grouped: bool = False  # a beam: its group picks its next token (never drafted for, or swapped)
    grammar: Matcher | None = None  # a constrained sequence's place in its constraint
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # detokenised output so far (stop strings already cut)
    emitted: int = 0  # chars of text handed out as stream deltas
    detok: list[int] = field(
        default_factory=lambda: [0, 0]
    )  # prefix / read offsets of incremental decode

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
