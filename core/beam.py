"""Beam search: a request's running beams are sequences that share KV blocks.

Each step every running beam computes one row of logits; once all rows are in, the group picks the
next beams and the finished hypotheses the way transformers' beam search does (its rules, so that
its `generate(num_beams=B, do_sample=False)` is the oracle): the top max(2, 1 + #eos) * B
continuations by summed log-probability; those that end (an end-of-sequence token, or the length
limit) among the first B become hypotheses scored log-probability / length ** length_penalty;
the best B that do not end run on. The engine turns the picks into sequences: a beam picked once
goes on as itself, one picked again is forked (sharing its blocks), one not picked is freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagechat.core.report import BeamResult
from pagechat.core.sequence import Sequence

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
        self._add_hypotheses(top, ends, parents, tokens, cur_len)
        choices = [BeamChoice(self.running[parents[j]], tokens[j], live[j].item()) for j in order]
        self.scores = live[order]
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
