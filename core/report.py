"""What one engine step tells the outside world: StepReport and the per-request TokenOutput inside it."""

from __future__ import annotations

from dataclasses import dataclass

from pagechat.core.blocks import BlockSnapshot
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

    @property
    def bonus(self) -> bool:
        """True when every drafted token was accepted and the target added one more."""
        return bool(self.drafted) and len(self.emitted) > self.accepted == len(self.drafted)


@dataclass(frozen=True, slots=True)
class StepReport:
    """Immutable record of one engine step: work done, time taken, outputs, and the engine's own state."""

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
    attention_backend: str
    drafts: tuple[DraftRecord, ...] = ()
    cow_copies: int = 0  # blocks copied because a shared partial block was written (forked samples)
