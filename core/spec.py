"""Speculative decoding: proposers draft k tokens per sequence; one target forward verifies them
exactly.

Verification keeps the target's distribution (Leviathan et al. / Chen et al. 2023): accept drafted
token d with probability min(1, p(d) / q(d)); on rejection sample from norm(max(0, p - q)); when
every draft is accepted, take a bonus token from the target's next distribution. Greedy requests
accept while the draft equals the target's argmax. An n-gram draft is deterministic: q is one-hot.
"""

from __future__ import annotations

import torch
from pagechat.core.blocks import BlockManager
from pagechat.core.kv import allocate_pool
from pagechat.core.runner import ModelRunner
from pagechat.core.sampler import SampleRow, draw_from, penalised_logits, target_probs
from pagechat.core.scheduler import ScheduledSeq
from pagechat.core.sequence import Sequence


def verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: list[int],
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Judge draft against target probs p [len(draft) + 1, V]; returns (accepted count, next token).

    q [len(draft), V] is what each draft token was sampled from (None: one-hot, a deterministic
    draft). The next token is the correction at the first rejection, or the bonus token when all
    were accepted.
    """
    for i, d in enumerate(draft):
        if greedy:
            best = int(p[i].argmax())
            if best != d:
                return i, best
            continue
        qd = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * qd < float(p[i, d]):  # u < p/q without dividing; qd > 0 because d was drawn from q
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[i]).clamp_min_(0.0)
        total = float(residual.sum())
        # total is 0 only when p == q, where rejection has probability 0: rounding guard only
        dist = residual / total if total > 0 else p[i]
        return i, int(draw_from(dist.unsqueeze(0), [generator])[0])
    m = len(draft)
    nxt = int(p[m].argmax()) if greedy else int(draw_from(p[m : m + 1], [generator])[0])
    return m, nxt


def ngram_propose(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_n..1) and
    propose
    the up-to-k tokens that followed it."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer:
    """Drafts by looking the sequence's own recent tokens up in its context (no model, q
    one-hot)."""

    name = "ngram"
    max_len = 1 << 62  # no model, no position limit

    def propose(
        self, seqs: list[Sequence], ks: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = [ngram_propose(s.token_ids, k) if k else [] for s, k in zip(seqs, ks)]
        return drafts, [None] * len(seqs)

    def accept(self, seq: Sequence, len_before: int, drafted: int, accepted: int) -> None:
        pass

    def release_missing(self, alive: set[int]) -> None:
        pass


class DraftModelProposer:
    """Drafts with a smaller model of the same vocabulary, over its own paged KV cache."""

    name = "draft"

    def __init__(
        self,
        loaded,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        vocab_size: int,
        graphs: bool,
        max_seqs: int,
    ) -> None:
        self.loaded, self.device, self.vocab_size = loaded, device, vocab_size
        self.max_len = loaded.max_len
        self.pool = allocate_pool(loaded.spec, num_blocks, block_size, loaded.dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache=False)
        self.runner = ModelRunner(loaded.model, self.pool, self.blocks, device, graphs, max_seqs)
        self.runner.warm_up(
            2
        )  # its catch-up steps (2 tokens after a verification) take the causal-mask trace
        self.computed: dict[int, int] = {}  # seq id -> tokens whose K/V the draft cache holds

    def propose(
        self, seqs: list[Sequence], ks: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """k_i draft tokens for each sequence (fewer when its draft cache has no room) and their q
        rows (None when every sequence is greedy)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k and self._reserve(s, k)]
        # greedy verification reads no q: argmax is all it takes
        greedy = all(seqs[i].sampling.params.greedy for i in live)
        # round 0 catches the draft cache up with the sequence (its last token at least); later
        # rounds feed one drafted token each
        items = [self._catch_up(seqs[i]) for i in live]
        while live:
            self._round(items, [(seqs[i], drafts[i], qs[i]) for i in live], greedy)
            live = [i for i in live if len(drafts[i]) < ks[i]]
            items = [
                ScheduledSeq(
                    seqs[i], len(seqs[i].token_ids) + len(drafts[i]) - 1, 0, [drafts[i][-1]]
                )
                for i in live
            ]
        for s, d in zip(seqs, drafts):
            if d:
                self.computed[s.seq_id] = len(s.token_ids) + len(d) - 1
        return drafts, [torch.stack(q) if q else None for q in qs]

    def _catch_up(self, seq: Sequence) -> ScheduledSeq:
        """The draft model's first chunk for seq: every token its cache lacks."""
        done = self.computed[seq.seq_id]
        return ScheduledSeq(seq, done, len(seq.token_ids) - done)

    def _round(
        self,
        items: list[ScheduledSeq],
        live: list[tuple[Sequence, list[int], list[torch.Tensor]]],
        greedy: bool,
    ) -> None:
        """One draft forward: each live (sequence, draft, q rows) gains a drafted token (and its q
        row when sampling)."""
        logits = self._fit(self.runner.run(items, [1] * len(items)))
        rows = [
            SampleRow(s.seq_id, s.sampling.params, s.token_ids + d, s.sampling.generator)
            for s, d, _ in live
        ]
        if greedy:
            picks = penalised_logits(logits, rows).argmax(dim=-1).tolist()
        else:
            q = target_probs(logits, rows)
            picks = self._pick(q, rows)
            for j, (_, _, q_rows) in enumerate(live):
                q_rows.append(q[j])
        for (_, draft, _), pick in zip(live, picks):
            draft.append(pick)

    def accept(self, seq: Sequence, len_before: int, drafted: int, accepted: int) -> None:
        """Roll the draft cache back to the tokens that survived verification."""
        if not drafted or seq.seq_id not in self.computed:
            return
        valid = len_before + min(accepted, drafted - 1)
        self.blocks.rollback(seq.seq_id, self.blocks.length(seq.seq_id) - valid)
        self.computed[seq.seq_id] = valid

    def release_missing(self, alive: set[int]) -> None:
        """Free the draft cache of sequences that finished or were preempted."""
        for seq_id in [i for i in self.computed if i not in alive]:
            self.blocks.free(seq_id)
            del self.computed[seq_id]

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Slots for the sequence's tokens plus k - 1 drafted ones; False (and no draft) when out of
        blocks."""
        if seq.seq_id not in self.computed:
            if not self.blocks.can_allocate(seq.token_ids):
                return False
            self.blocks.allocate(seq.seq_id, seq.token_ids)
            self.computed[seq.seq_id] = 0
        missing = len(seq.token_ids) + k - 1 - self.blocks.length(seq.seq_id)
        if missing > 0:
            if not self.blocks.can_append(seq.seq_id, missing):
                return False
            self.blocks.append(seq.seq_id, missing)  # no forks here, so never a copy-on-write
        return True

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary size (checkpoints often pad the embedding
        differently)."""
        v = logits.shape[1]
        if v > self.vocab_size:
            return logits[:, : self.vocab_size]
        if v < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))
        return logits

    @staticmethod
    def _pick(q: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        greedy = torch.tensor([r.params.greedy for r in rows], device=q.device)
        drawn = draw_from(q, [r.generator for r in rows])
        return torch.where(greedy, q.argmax(dim=-1), drawn).tolist()
