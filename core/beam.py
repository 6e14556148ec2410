"""Beam search: a request's running beams are sequences that share KV blocks.

Each step every running beam computes one row of logits; once all rows are in, the group picks the
next beams and the finished hypotheses the way transformers' beam search does (its rules, so that
its `generate(num_beams=B, do_sample=False)` is the oracle): the top max(2, 1 + #eos) * B
continuations by summed log-probability; those that end (an end-of-sequence token, or the length
limit) among the first B become hypotheses scored log-probability / length ** length_penalty;
the best B that do not end run on. BeamSearches turns the picks into sequences: a beam picked once
goes on as itself, one picked again is forked (sharing its blocks), one not picked is freed. The
scheduler knows nothing of beams: it sees grouped sequences, whose next token is not its to sample.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pagechat.core.blocks import BlockManager
from pagechat.core.report import BeamResult
from pagechat.core.scheduler import Scheduler
from pagechat.core.sequence import SamplingState, Sequence, Status

NEG = -1.0e9  # transformers' score for "cannot be chosen"


@dataclass(frozen=True, slots=True)
class BeamChoice:
    """One beam of the next step: a running beam extended by one token, with its summed score."""

    parent: Sequence
    token: int
    score: float


class BeamGroup:
    """The beam search of one request: its running beams, their scores, the finished hypotheses."""

    def __init__(self, root: Sequence, eos_ids: frozenset[int], max_model_len: int) -> None:
        p = root.sampling.params
        self.width, self.length_penalty, self.early_stopping = (
            p.beam_width,
            p.length_penalty,
            p.early_stopping,
        )
        self.root = root  # the request: it holds the results once the search is done
        self.eos_ids = frozenset() if p.ignore_eos else eos_ids
        self.prompt_len = root.num_prompt_tokens
        self.max_length = min(self.prompt_len + p.max_tokens, max_model_len)
        self.running: list[Sequence] = [root]
        self.scores = torch.zeros(1)
        self.pending: dict[int, torch.Tensor] = {}  # beam seq id -> its logits row of this step
        self.hyps: list[tuple[int, ...]] = [()] * self.width  # generated tokens of each hypothesis
        self.hyp_scores = torch.full((self.width,), NEG)
        self.hyp_done = torch.zeros(self.width, dtype=torch.bool)
        self.improvable = True
        self.done = False

    def ready(self) -> bool:
        """Whether every running beam has its logits of this step."""
        return all(s.seq_id in self.pending for s in self.running)

    def select(self) -> list[BeamChoice]:
        """Pick the next running beams from this step's logits; update the hypotheses and `done`."""
        logits = torch.stack([self.pending.pop(s.seq_id) for s in self.running]).float()
        vocab = logits.shape[-1]
        summed = (torch.log_softmax(logits, dim=-1) + self.scores[:, None]).reshape(-1)
        keep = min(max(2, 1 + len(self.eos_ids)) * self.width, summed.numel())
        top, index = torch.topk(summed, keep)
        parents, tokens = (index // vocab).tolist(), (index % vocab).tolist()
        cur_len = len(self.running[0].token_ids)
        ends = torch.tensor([t in self.eos_ids or cur_len + 1 >= self.max_length for t in tokens])
        live = top + ends.float() * NEG
        order = torch.topk(live, self.width).indices.tolist()
        order = [j for j in order if live[j] > -math.inf]  # a grammar may allow fewer
        self._add_hypotheses(top, ends, parents, tokens, cur_len)
        choices = [BeamChoice(self.running[parents[j]], tokens[j], live[j].item()) for j in order]
        self.scores = live[order]
        if not choices:  # no continuation its grammar allows: the hypotheses are all there is
            self.done = True
            return choices
        self._check_done(cur_len + 1, bool(ends.all()))
        return choices

    def _add_hypotheses(
        self, top: torch.Tensor, ends: torch.Tensor, parents: list, tokens: list, cur_len: int
    ) -> None:
        """Merge the continuations that end among the first `width` into the best `width` hyps."""
        scores = top / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        if self.early_stopping is True and bool(self.hyp_done.all()):
            scores = scores + NEG  # full, and told to stop at the first `width` hypotheses
        if not self.improvable:
            scores = scores + NEG
        just_ended = ends & (torch.arange(len(tokens)) < self.width)
        scores = scores + (~just_ended).float() * NEG
        merged = torch.cat((self.hyp_scores, scores))
        best = torch.topk(merged, self.width).indices.tolist()
        prompt = self.prompt_len
        candidates = [(*self.running[p].token_ids[prompt:], t) for p, t in zip(parents, tokens)]
        pool = self.hyps + candidates
        self.hyps = [pool[i] for i in best]
        self.hyp_scores = merged[best]
        self.hyp_done = torch.cat((self.hyp_done, just_ended))[best]

    def _check_done(self, cur_len: int, all_end: bool) -> None:
        """Whether a running beam can still beat the worst hypothesis (transformers' heuristic)."""
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_length - self.prompt_len
        else:
            length = cur_len - self.prompt_len
        best_running = self.scores[0] / (length**self.length_penalty)
        worst = self.hyp_scores.min()
        if not bool(self.hyp_done.all()):
            worst = torch.clamp(worst, max=NEG)
        self.improvable = self.improvable and bool(best_running > worst)
        full = bool(self.hyp_done.all()) and self.early_stopping is True
        self.done = not self.improvable or full or all_end

    def results(self, decode) -> tuple[BeamResult, ...]:
        """The hypotheses, best first, with their text (decode: token ids -> str)."""
        return tuple(
            BeamResult(tokens, decode(list(tokens)), score)
            for tokens, score in zip(self.hyps, self.hyp_scores.tolist())
        )


class BeamSearches:
    """Every running beam search of the engine: which sequence is whose beam, their logits as each
    step computes them, and the sequences the picks make and free."""

    def __init__(
        self,
        scheduler: Scheduler,
        blocks: BlockManager,
        new_id: Callable[[], int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.scheduler, self.blocks = scheduler, blocks
        self.new_id, self.decode = new_id, decode  # the request layer's ids and detokeniser
        self._groups: dict[int, BeamGroup] = {}  # request id -> its beam search
        self._of: dict[int, BeamGroup] = {}  # running beam's seq id -> its beam search

    def start(self, root: Sequence, eos_ids: frozenset[int], max_model_len: int) -> None:
        """Make a new request a beam search: its prompt is the first beam."""
        root.grouped = True
        group = BeamGroup(root, eos_ids, max_model_len)
        self._groups[root.seq_id] = self._of[root.seq_id] = group

    def take(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Keep a beam's logits row of this step for its search's pick; False for no beam."""
        group = self._of.get(seq.seq_id)
        if group is not None:
            if seq.grammar is not None:  # a constrained search ranks only what its grammar allows
                logits = logits.masked_fill(~seq.grammar.allowed(), float("-inf"))
            group.pending[seq.seq_id] = logits
        return group is not None

    def advance(self) -> list[Sequence]:
        """Let every search whose beams all have this step's logits pick its next beams; the
        requests of those that finished."""
        finished = []
        for group in list(self._groups.values()):
            if group.ready():
                self._apply(group, group.select())
                if group.done:
                    finished.append(self._finish(group))
        return finished

    def root(self, seq: Sequence) -> Sequence | None:
        """The request a running beam searches for; None for a sequence that is no beam."""
        group = self._of.get(seq.seq_id)
        return None if group is None else group.root

    def rank(self, seq: Sequence) -> tuple[int, int] | None:
        """(its request, its rank among the running beams), or None for no running beam."""
        group = self._of.get(seq.seq_id)
        if group is not None and seq in group.running:
            return group.root.seq_id, group.running.index(seq)
        return None

    def drop(self, request_id: int) -> None:
        """End a request's search, if it is one: every running beam but the request's own is freed
        (the request itself is finished by the caller)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for beam in group.running:
            self._of.pop(beam.seq_id, None)
            if beam is not group.root:
                self.scheduler.finish(beam)
        group.running = []

    def _apply(self, group: BeamGroup, choices: list[BeamChoice]) -> None:
        """Make the picked beams: the first pick of a beam goes on as itself, a second one is forked
        from it (sharing its blocks), a beam not picked is freed."""
        reused: set[int] = set()
        plan = []
        for c in choices:
            reuse = c.parent.seq_id not in reused and c.parent is not group.root
            reused.add(c.parent.seq_id)
            plan.append((c, reuse))
        beams = [c.parent if reuse else self._fork(c) for c, reuse in plan]
        for c, reuse in plan:  # after the forks, which copy the parent's tokens as they were
            if reuse:
                c.parent.token_ids.append(c.token)
                if c.parent.grammar is not None:
                    c.parent.grammar.consume(c.token)
                self.scheduler.resume(c.parent)
        kept = {b.seq_id for b in beams}
        for old in group.running:
            if old is group.root:
                self.scheduler.detach(old)
            elif old.seq_id not in kept:
                self.scheduler.finish(old)
            if old.seq_id not in kept:
                del self._of[old.seq_id]
        group.running = beams
        self._of.update((b.seq_id, group) for b in beams)

    def _fork(self, choice: BeamChoice) -> Sequence:
        """A new beam: its parent's tokens plus the picked one, sharing the parent's blocks; a
        parent preempted meanwhile has none, so the beam waits to be computed afresh."""
        parent = choice.parent
        beam = Sequence(
            self.new_id(),
            [*parent.token_ids, choice.token],
            parent.num_prompt_tokens,
            SamplingState(parent.sampling.params),
            parent.arrival,
            status=parent.status,
            num_computed=parent.num_computed,
            priority=parent.priority,
            grouped=True,
            grammar=parent.grammar and parent.grammar.fork(),
        )
        if beam.grammar is not None:
            beam.grammar.consume(choice.token)
        if parent.status is Status.RUNNING:
            self.blocks.fork(parent.seq_id, beam.seq_id)
            self.scheduler.run(beam)
        else:
            beam.num_computed = 0
            self.scheduler.add(beam, front=True)
        return beam

    def _finish(self, group: BeamGroup) -> Sequence:
        """End a search: the request's tokens and text become the best hypothesis'."""
        root = group.root
        self.drop(root.seq_id)
        root.beams = group.results(self.decode)
        best = root.beams[0]
        root.token_ids[root.num_prompt_tokens :] = best.token_ids
        root.text = best.text
        ended = bool(best.token_ids) and best.token_ids[-1] in group.eos_ids
        now = time.perf_counter()
        self.scheduler.finish(root)
        root.finish_reason, root.finish_time = "stop" if ended else "length", now
        root.first_token_time = root.first_token_time or now
        return root
