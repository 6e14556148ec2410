"""The request layer: what a request is beyond its sequences' steps. Prompt checks and chat
templates, the request table (a request's own sequence, the samples forked from it, its beam
search), stop conditions and detokenisation, each sequence's role, and release.

The engine's step calls in at three points (a prompt's end forks samples, each sampled token is
appended here, a failed sequence ends its request); everything else is the front-ends' to call.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from pagechat.core.beam import BeamSearches
from pagechat.core.blocks import BlockManager
from pagechat.core.checkpoint import LoadedModel
from pagechat.core.detok import update_text
from pagechat.core.errors import PagechatError, check_text
from pagechat.core.grammar import Grammars
from pagechat.core.params import SamplingParams
from pagechat.core.report import SeqRecord, TokenOutput
from pagechat.core.sampler import make_generator
from pagechat.core.scheduler import Scheduler
from pagechat.core.sequence import SamplingState, Sequence, Status
from pagechat.core.timelimit import within

TEMPLATE_LIMIT_S = 5.0  # a chat template renders in milliseconds; one that runs longer is stuck


class Requests(Mapping[int, Sequence]):
    """The engine's requests and their forks by sequence id, from add() until release()."""

    def __init__(
        self,
        model: LoadedModel,
        source: Path,
        device: torch.device,
        scheduler: Scheduler,
        blocks: BlockManager,
    ) -> None:
        """model: the loaded checkpoint whose tokenizer, vocabulary and context it serves."""
        tokenizer, spec = model.tokenizer, model.spec
        self.tokenizer, self.source, self.vocab_size = tokenizer, source, spec.vocab_size
        self.max_model_len, self.device = model.max_len, device
        eos = {*spec.eos_token_ids, tokenizer.eos_token_id} - {None}
        self.eos_ids = frozenset(eos)  # the config's and the tokenizer's
        self.scheduler, self.blocks = scheduler, blocks
        self.grammars = Grammars(tokenizer, spec.vocab_size, self.eos_ids)
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self.beams = BeamSearches(scheduler, blocks, self.new_id, self.decode)

    def __getitem__(self, seq_id: int) -> Sequence:
        return self._seqs[seq_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a plain prompt, or of one user turn wrapped in the model's chat template."""
        if not chat:
            return self.tokenizer(check_text(prompt, "the prompt")).input_ids
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a whole conversation through the chat template, ready for the assistant's
        turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PagechatError(
                f"the tokenizer in {self.source} has no chat template; run without --chat"
            )
        for i, m in enumerate(messages, 1):
            check_text(m["content"], f"message {i} ({m['role']})")
        try:
            text = within(
                TEMPLATE_LIMIT_S,
                f"the chat template of {self.source}",
                lambda: self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                ),
            )
        except PagechatError:
            raise
        except Exception as e:  # jinja raises its own types; raise_exception() in a template too
            raise PagechatError(f"the chat template failed: {str(e).splitlines()[0]}") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the front-ends' calls -------------------------------------------------------------------
    def add(
        self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> int:
        """Queue a prompt (text or token ids); returns its request id. The next step may admit it.
        A lower priority is admitted before and preempted after a higher one."""
        params = (params or SamplingParams()).validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise PagechatError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PagechatError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(shorten the prompt)"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PagechatError(
                f"token id {bad[0]} is outside the model's vocabulary (0..{self.vocab_size - 1})"
            )
        # compiled before anything is queued: a bad constraint costs no step
        grammar = params.constraint and self.grammars.matcher(params.constraint)
        sampling = SamplingState(params, self._generator(params.seed))
        now = time.perf_counter()
        seq = Sequence(self.new_id(), ids, len(ids), sampling, now, priority=priority)
        seq.grammar = grammar
        if params.beam_width > 1:
            self.beams.start(seq, self.eos_ids, self.max_model_len)
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def update_params(self, request_id: int, params: SamplingParams) -> tuple[SamplingParams, int]:
        """Change a request's sampling settings from its next sampled token, for every sample of
        it (each on its own seed: seed + k), keeping what it was started as (its answers, its
        limits), which no later setting can change; the settings applied and the output token
        they apply from."""
        root = self._request(request_id)
        own = root.sampling.params
        params = replace(
            params.validate(),
            stop=own.stop,
            ignore_eos=own.ignore_eos,
            n=own.n,
            beam_width=own.beam_width,
            length_penalty=own.length_penalty,
            early_stopping=own.early_stopping,
            constraint=own.constraint,
        )
        for j, seq in enumerate([root, *map(self._seqs.get, root.children)]):
            if not seq.finished:
                seed = None if params.seed is None else params.seed + j
                if seed != seq.sampling.params.seed:
                    seq.sampling.generator = self._generator(seed)
                seq.sampling.params = replace(params, seed=seed)
        return params, root.num_output_tokens

    def abort(self, request_id: int) -> None:
        """Stop a request now, keeping what it generated; its blocks are freed."""
        seq = self._request(request_id)
        self.beams.drop(request_id)
        if not seq.finished:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.finish_time = "abort", time.perf_counter()

    def done(self, request_id: int) -> bool:
        """The request and every sample forked from it have finished."""
        seq = self._request(request_id)
        return seq.finished and all(self._seqs[c].finished for c in seq.children)

    def release(self, request_id: int) -> Sequence:
        """Forget a finished request and its samples, so a long-running caller keeps no
        per-request state in the engine; returns the request's sequence."""
        if not self.done(request_id):
            raise PagechatError(f"request {request_id} has not finished; abort it first")
        seq = self._seqs.pop(request_id)
        for child in seq.children:
            del self._seqs[child]
        return seq

    def _request(self, request_id: int) -> Sequence:
        if request_id not in self._seqs:
            raise PagechatError(f"no request with id {request_id}")
        return self._seqs[request_id]

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _generator(self, seed: int | None) -> torch.Generator:
        """A request's own random stream: seeded as asked, else at random (so that samples forked
        from it, seeded seed + j, and a later change of settings keep their own streams)."""
        return make_generator(seed if seed is not None else random.randrange(2**63), self.device)

    # -- what a sequence is ----------------------------------------------------------------------
    def root(self, seq: Sequence) -> Sequence:
        """The request a sequence belongs to: itself, its sample's parent or its beam's search."""
        searched = self.beams.root(seq)
        if searched is not None:
            return searched
        return seq if seq.parent is None else self._seqs[seq.parent]

    def role(self, seq: Sequence) -> tuple[int, str, int]:
        """(the request it answers, what it is, its place): sample k of n, or a beam's rank."""
        rank = self.beams.rank(seq)
        if rank is not None:
            return rank[0], "beam", rank[1]
        if seq.parent is not None:
            return seq.parent, "sample", seq.sample_index
        return seq.seq_id, "sample" if seq.sampling.params.n > 1 else "request", 0

    def record(self, seq: Sequence, blocks: int, shared: int) -> SeqRecord:
        """What the scheduler panel shows of a sequence (blocks: those it holds, shared of them)."""
        request, role, index = self.role(seq)
        state = seq.status.value
        if seq.status is Status.WAITING and seq.num_preemptions:
            state = "preempted"
        return SeqRecord(
            seq.seq_id,
            request,
            role,
            index,
            state,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_computed,
            blocks,
            shared,
            seq.num_preemptions,
            seq.finish_reason,
        )

    # -- the step's calls ------------------------------------------------------------------------
    def fork(self, parent: Sequence, start: int) -> list[Sequence]:
        """At the end of a prompt with n > 1, fork n - 1 samples that share its blocks
        (copy-on-write); start: where the prompt's last chunk began."""
        params = parent.sampling.params
        if params.n == 1 or parent.children or parent.parent is not None or parent.output_ids:
            return []
        kids = []
        for j in range(1, params.n):
            seed = None if params.seed is None else params.seed + j
            kid = Sequence(
                self.new_id(),
                list(parent.token_ids),
                parent.num_prompt_tokens,
                SamplingState(params, self._generator(seed)),
                parent.arrival,
                status=Status.RUNNING,
                num_computed=start,
                parent=parent.seq_id,
                sample_index=j,
                priority=parent.priority,
                grammar=parent.grammar and parent.grammar.fork(),
            )
            self.blocks.fork(parent.seq_id, kid.seq_id)
            self.scheduler.run(kid)
            self._seqs[kid.seq_id] = kid
            parent.children.append(kid.seq_id)
            kids.append(kid)
        return kids

    def advance_beams(self) -> list[TokenOutput]:
        """Every beam search picks its next beams where it can; the outputs of those that ended:
        the best hypothesis' tokens and text."""
        return [self.output(r, list(r.beams[0].token_ids)) for r in self.beams.advance()]

    def through_eos(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of tokens the sequence can take: up to its first end-of-sequence token unless
        ignore_eos."""
        if seq.sampling.params.ignore_eos:
            return len(tokens)
        return next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))

    def append(self, seq: Sequence, token: int) -> TokenOutput:
        """Add a sampled token to seq, update its text, and finish it if a stop condition holds."""
        now = time.perf_counter()
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        update_text(self.tokenizer, seq)
        p = seq.sampling.params
        reason = None
        if seq.grammar is not None and token not in self.eos_ids:
            seq.grammar.consume(token)  # the mask allowed it
        if token in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and any(s in seq.text for s in p.stop):
            seq.text = seq.text[: min(seq.text.find(s) for s in p.stop if s in seq.text)]
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.done:  # complete: only an end may follow
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.finish_time = reason, now
        return self.output(seq, [token])

    def output(self, seq: Sequence, tokens: list[int]) -> TokenOutput:
        """The new text of seq since the last output; while running, hold back what may start a stop
        string."""
        end = len(seq.text)
        stop = seq.sampling.params.stop
        if not seq.finished and stop:
            end -= max(len(s) for s in stop) - 1
        delta = seq.text[seq.emitted : max(end, seq.emitted)]
        seq.emitted += len(delta)
        if seq.finished and seq.finish_time is None:
            seq.finish_time = time.perf_counter()
        return TokenOutput(
            seq.seq_id, tuple(tokens), delta, seq.finished, seq.finish_reason, seq.error
        )

    def failed(self, seq: Sequence) -> TokenOutput:
        """The output of a sequence the pool cannot hold; a failed beam fails its whole search."""
        root = self.beams.root(seq)
        if root is None:
            return self.output(seq, [])
        self.beams.drop(root.seq_id)
        self.scheduler.finish(root)
        root.finish_reason, root.error = "error", seq.error
        return self.output(root, [])

    def fail(self, seqs: list[Sequence], why: str) -> list[TokenOutput]:
        """End the requests of these sequences with the engine's own error (a step failed); the
        outputs of every sequence it ended."""
        roots = {id(r): r for r in map(self.root, seqs)}
        outputs = []
        for root in roots.values():
            self.beams.drop(root.seq_id)
            for seq in (root, *(self._seqs[c] for c in root.children)):
                if not seq.finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason, seq.error, seq.fault = "error", why, True
                    outputs.append(self.output(seq, []))
        return outputs
