"""What one engine step tells the outside world: StepReport and the per-request TokenOutput inside
it."""

from __future__ import annotations

from dataclasses import dataclass

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.blocks import BlockEvent
from pagechat.core.sampler import SampleRecord


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """New output of one request in a step: the token ids added and the text they completed."""

    request_id: int
    token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    error: str | None = None


def _add_by_position(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Two per-position counts summed, the shorter one padded with zeros."""
    width = max(len(a), len(b))
    return tuple(x + y for x, y in zip(a + (0,) * (width - len(a)), b + (0,) * (width - len(b))))


@dataclass(frozen=True, slots=True)
class SpecTotals:
    """One sequence's speculation so far: summed once, as each draft is verified."""

    steps: int = 0  # verify steps: target forwards that checked a draft (or found none to check)
    drafting_steps: int = 0  # those with at least one drafted token
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the verify steps added: accepted ones plus a correction or bonus
    tried: tuple[int, ...] = ()  # per draft position: steps that drafted a token there
    hits: tuple[int, ...] = ()  # per draft position: steps whose token there was accepted

    def add(self, drafted: int, accepted: int, emitted: int) -> SpecTotals:
        """These totals after one more verify step."""
        tried = (1,) * drafted
        hits = (1,) * accepted + (0,) * (drafted - accepted)
        return self + SpecTotals(1, int(drafted > 0), drafted, accepted, emitted, tried, hits)

    def __add__(self, other: SpecTotals) -> SpecTotals:
        """The totals of both (two steps, or two sequences of a run)."""
        return SpecTotals(
            self.steps + other.steps,
            self.drafting_steps + other.drafting_steps,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.emitted + other.emitted,
            _add_by_position(self.tried, other.tried),
            _add_by_position(self.hits, other.hits),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any draft)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        """Accepted tokens per step that drafted any."""
        return self.accepted / self.drafting_steps if self.drafting_steps else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a drafting verify step yields: its accepted drafts plus the target's own token."""
        mean = self.mean_accepted
        return None if mean is None else mean + 1

    @property
    def forwards_per_token(self) -> float | None:
        """Target forwards per token the verify steps emitted (1.0 without speculation)."""
        return self.steps / self.emitted if self.emitted else None

    def position_rate(self, pos: int) -> float | None:
        """Acceptance at draft position pos (0-based) among steps that drafted that far."""
        return (
            self.hits[pos] / self.tried[pos] if pos < len(self.tried) and self.tried[pos] else None
        )


@dataclass(frozen=True, slots=True)
class SwapRecord:
    """One sequence's KV copied out to the host pool (preempted) or back in (resumed)."""

    seq_id: int
    direction: str  # "out" | "in"
    blocks: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class SeqRecord:
    """One sequence as the scheduler holds it after a step, or as it ended since the last one."""

    seq_id: int
    request_id: int  # the request it answers: itself, or the one it was forked from
    role: str  # "request" | "sample" | "beam"
    index: int  # sample k (0: the request's own), or the beam's rank (0: the best running one)
    state: str  # "waiting" | "running" | "preempted" | "swapped" | "finished"
    prompt_tokens: int
    output_tokens: int
    computed: int  # tokens whose KV is in the pool
    blocks: int  # KV blocks it holds (none while waiting or swapped out)
    shared: int  # of those, blocks another sequence holds too
    preemptions: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One sequence's share of a step, as the scheduler gave it."""

    seq_id: int
    kind: str  # "prefill" (a prompt chunk, or tokens recomputed after preemption) | "decode"
    start: int  # the chunk is tokens [start, start + tokens) of the sequence's `total`
    tokens: int
    total: int
    reserved: int = 0  # extra slots for speculative draft tokens


@dataclass(frozen=True, slots=True)
class BeamResult:
    """One finished hypothesis of a beam search: its generated tokens, text and score."""

    token_ids: tuple[int, ...]
    text: str
    score: float  # summed log-probability / generated length ** length_penalty


@dataclass(frozen=True, slots=True)
class DraftRecord:
    """One sequence's speculation in one step: what was drafted, how much the target accepted."""

    seq_id: int
    proposer: str  # "draft" | "ngram"
    drafted: tuple[int, ...]
    accepted: int  # leading drafted tokens the target accepted
    emitted: tuple[
        int, ...
    ]  # tokens added to the sequence: the accepted ones, then a correction or bonus
    drafted_text: tuple[str, ...]  # each drafted token's text as decoded alone (as Candidate.text)
    emitted_text: tuple[str, ...]
    totals: SpecTotals  # the sequence's speculation after this step

    @property
    def bonus(self) -> bool:
        """True when every drafted token was accepted and the target added one more."""
        return bool(self.drafted) and len(self.emitted) > self.accepted == len(self.drafted)


@dataclass(frozen=True, slots=True)
class StepReport:
    """Immutable record of one engine step: work done, time taken, outputs, and the engine's own
    state."""

    step: int
    kind: str  # "prefill" | "decode" | "mixed" | "idle"
    num_seqs: int
    prefill_tokens: int  # tokens computed from prompts (or recomputed after preemption)
    decode_tokens: int  # single-token decodes
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache by admissions in this step
    elapsed_s: float
    outputs: tuple[TokenOutput, ...]
    samples: tuple[SampleRecord, ...]
    blocks: BlockSnapshot
    preempted: tuple[int, ...]
    block_events: tuple[BlockEvent, ...] = ()  # the allocator's changes since the last report
    drafts: tuple[DraftRecord, ...] = ()
    cow_copies: int = 0  # blocks copied because a shared partial block was written (forked samples)
    swaps: tuple[SwapRecord, ...] = ()  # KV copied to or from the host pool in this step
    seqs: tuple[SeqRecord, ...] = ()  # every sequence after the step, and those that ended in it
    batch: tuple[BatchItem, ...] = ()  # what the step ran, in the scheduler's order
    token_budget: int = 0  # tokens a step may compute (max_batch_tokens)
    grammar_s: float = 0.0  # of elapsed_s, computing grammar masks (constrained sequences)
