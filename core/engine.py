"""Engine: a loaded model, its KV pool and scheduler, and step(): schedule, draft, forward,
sample or verify, append, report. Requests are the request layer's (engine.requests)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagechat.core.blockmap import BlockMap
from pagechat.core.blocks import BlockEvent, BlockManager
from pagechat.core.checkpoint import (
    load_checkpoint,
    load_proposer,
    resolve_device,
    resolve_kv_dtype,
)
from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError, one_line
from pagechat.core.grammar import masks_along
from pagechat.core.graphs import TRACE_SUPPORTED
from pagechat.core.kv import allocate_pool, block_bytes, copy_blocks, pool_blocks
from pagechat.core.params import SamplingParams
from pagechat.core.report import (
    BatchItem,
    DraftRecord,
    SeqRecord,
    StepReport,
    SwapRecord,
    TokenOutput,
)
from pagechat.core.requests import Requests
from pagechat.core.runner import ModelRunner
from pagechat.core.sampler import Sampler, SampleRecord, SampleRow, target_probs
from pagechat.core.scheduler import Batch, ScheduledSeq, Scheduler, SwapPlan
from pagechat.core.sequence import Sequence
from pagechat.core.spec import verify
from pagechat.core.swap import HostBlocks, copy_between, host_pool
from pagechat.core.threads import apply_threads


@dataclass(slots=True)
class _StepWork:
    """What one step's phases hand each other: tokens per item, records, and the work counted."""

    outputs: list[TokenOutput]
    emitted: dict[int, list[int]] = field(default_factory=dict)  # id(ScheduledSeq) -> tokens
    samples: list[SampleRecord] = field(default_factory=list)
    drafts: list[DraftRecord] = field(default_factory=list)
    prefill: int = 0
    decode: int = 0
    swaps: list[SwapRecord] = field(default_factory=list)
    ran: tuple[BatchItem, ...] = ()
    grammar_s: float = 0.0  # computing the constrained sequences' masks


def _ran(items: list[ScheduledSeq]) -> tuple[BatchItem, ...]:
    """What the scheduler gave each sequence, recorded before the step appends any token."""
    return tuple(
        BatchItem(
            it.seq.seq_id,
            "decode" if _decoding(it) else "prefill",
            it.start,
            it.count + len(it.draft),
            len(it.seq.token_ids),
            it.lookahead,
        )
        for it in items
    )


def _decoding(it: ScheduledSeq) -> bool:
    """A decode: the chunk is the sequence's one newest sampled token (not a prompt's last)."""
    return len(it.seq.token_ids) - it.start == 1 and it.seq.num_output_tokens > 0


def _row(seq: Sequence, history: list[int], grammar: tuple | None = None) -> SampleRow:
    """The sampler's view of a sequence: its settings, the tokens so far, its random stream, and
    its grammar's mask and place (grammar: those at history; default: the matcher's now)."""
    if grammar is None and seq.grammar is not None:
        grammar = seq.grammar.allowed(), seq.grammar.where()
    allowed, where = grammar or (None, "")
    return SampleRow(
        seq.seq_id, seq.sampling.params, history, seq.sampling.generator, allowed, where
    )


class Engine:
    """Paged-KV inference engine over one local checkpoint."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = cfg = (config or EngineConfig()).validate()
        self.model_dir = Path(model_dir)
        self.threads = apply_threads(cfg.threads)  # before loading: tracing runs torch ops
        self.device = resolve_device(cfg.device)
        target = load_checkpoint(self.model_dir, cfg, self.device)
        self.spec = spec = target.spec
        self.quant, self.tokenizer, self.model = target.quant, target.tokenizer, target.model
        self.dtype, self.max_model_len, self.precision = (
            target.dtype,
            target.max_len,
            target.precision,
        )
        self.kv_dtype = resolve_kv_dtype(cfg.kv_dtype, self.dtype, self.device)
        num_blocks = pool_blocks(spec, cfg, self.kv_dtype, self.device, self.max_model_len)
        self.pool = allocate_pool(spec, num_blocks, cfg.block_size, self.kv_dtype, self.device)
        self._block_events: list[BlockEvent] = []  # since the last report
        self.blocks = BlockManager(
            num_blocks, cfg.block_size, cfg.prefix_cache, (self._block_events.append,)
        )
        self.block_map = BlockMap.watching(self.blocks)
        host = self._host_pool(cfg, num_blocks)
        self.scheduler = Scheduler(self.blocks, cfg.max_batch_tokens, cfg.max_seqs, host)
        self.runner = ModelRunner(
            self.model, self.pool, self.blocks, self.device, self._graphs(self.quant), cfg.max_seqs
        )
        self.sampler = Sampler(lambda i: self.tokenizer.decode([i]))
        self.proposer = load_proposer(
            target, self.model_dir, cfg, self.device, num_blocks, self._graphs
        )
        self.speculate, self.num_draft = self.proposer is not None, cfg.num_draft
        if self.proposer is not None:  # verification steps take the causal-mask trace: made now
            self.runner.warm_up(2)
        self._q: dict[int, torch.Tensor | None] = {}  # draft distributions, _draft to _verify
        self.requests = Requests(target, self.model_dir, self.device, self.scheduler, self.blocks)
        self._steps = 0

    def _host_pool(self, cfg: EngineConfig, num_blocks: int) -> HostBlocks | None:
        """With --preempt swap, the host pool preempted sequences' KV waits in."""
        if cfg.preempt != "swap":
            return None
        host = HostBlocks(cfg.swap_blocks or num_blocks)
        self.host_pool = host_pool(self.pool, host.num_blocks)
        return host

    def _graphs(self, quant) -> bool:
        """Whether a model's small steps run as traced graphs: unless --eager, on a Python
        torch.jit supports, for layers a trace records faithfully."""
        return self.config.graphs and TRACE_SUPPORTED and quant.traceable

    @property
    def graphs(self) -> bool:
        """True when decode steps run as traced graphs (core/graphs.py), False when every op runs
        from Python."""
        return self.runner.graphs is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One step in named phases: schedule, draft, forward, sample or verify, append, report."""
        t0 = time.perf_counter()
        self._steps += 1
        batch, swaps = self._schedule()
        work = _StepWork([self.requests.failed(seq) for seq in batch.failed], swaps=swaps)
        if batch.items:
            try:
                self._run(batch.items, work)
            except Exception as e:  # noqa: BLE001 - the requests it ran fail; the engine goes on
                why = one_line(e)
                why = why if isinstance(e, PagechatError) else f"engine step failed: {why}"
                # their blocks are freed: the prefix cache keeps only KV the sequences counted as
                # computed, so nothing half-written is hit
                work.outputs += self.requests.fail([it.seq for it in batch.items], why)
        if self.proposer is not None:
            self.proposer.release_missing({s.seq_id for s in self.scheduler.running})
        return self._report(batch, work, time.perf_counter() - t0)

    def _run(self, items: list[ScheduledSeq], work: _StepWork) -> None:
        """The step's work on its batch: draft, forward, sample or verify, append, pick beams."""
        self._draft([it for it in items if it.lookahead])
        work.ran = _ran(items)
        full, logits = self._forward(items)
        plain = self._sample(items, full, logits, work)
        self._verify_drafts(items, logits, work)
        self._append(items + plain, work)
        work.outputs += self.requests.advance_beams()

    def _schedule(self) -> tuple[Batch, list[SwapRecord]]:
        """The scheduler's batch, with its block copies done: swaps out (before anything writes
        the blocks they free), copy-on-write, swaps in."""
        k = self.num_draft if self.proposer is not None and self.speculate else 0
        batch = self.scheduler.schedule(lookahead=k)
        swaps = [self._swap(p) for p in batch.swaps if p.direction == "out"]
        copy_blocks(self.pool, batch.copies)
        swaps += [self._swap(p) for p in batch.swaps if p.direction == "in"]
        return batch, swaps

    def _swap(self, plan: SwapPlan) -> SwapRecord:
        """Copy one sequence's blocks between the KV pool and the host pool, timed."""
        t0 = time.perf_counter()
        src, dst = (
            (self.pool, self.host_pool) if plan.direction == "out" else (self.host_pool, self.pool)
        )
        copy_between(src, dst, plan.pairs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        size = len(plan.pairs) * block_bytes(self.spec, self.blocks.block_size, self.kv_dtype)
        seconds = time.perf_counter() - t0
        return SwapRecord(plan.seq.seq_id, plan.direction, len(plan.pairs), size, seconds)

    def _forward(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward pass over the flat batch: the logits of every sampled position, and per
        item its own rows of them."""
        sizes = [1 + len(it.draft) if it.samples else 0 for it in items]
        full = self.runner.run(items, sizes)
        return full, list(full.split(sizes))

    def _sample(
        self,
        items: list[ScheduledSeq],
        full: torch.Tensor,
        logits: list[torch.Tensor],
        work: _StepWork,
    ) -> list[ScheduledSeq]:
        """Sample one token for every item that ends its sequence without a draft, and for the
        samples forked from a finished prompt (n > 1); returns those forks' items."""
        plain = [(it, lg) for it, lg in zip(items, logits) if it.samples and not it.lookahead]
        plain = [(it, lg) for it, lg in plain if not self.requests.beams.take(it.seq, lg[-1])]
        forks = [
            (ScheduledSeq(kid, it.start, it.count), lg)
            for it, lg in plain
            for kid in self.requests.fork(it.seq, it.start)
        ]
        t0 = time.perf_counter()
        rows = [_row(it.seq, it.seq.token_ids) for it, _ in plain + forks]
        if any(r.allowed is not None for r in rows):  # the masks' share: the rest is microseconds
            work.grammar_s += time.perf_counter() - t0
        picked = [lg for _, lg in plain + forks]
        # every item one row, in order (a decode step): the forward's own logits, not a copy (16
        # rows of 49,152: 0.23 ms)
        one_each = not forks and len(picked) == len(items) == full.shape[0]
        stacked = full if one_each else torch.cat(picked) if picked else full[:0]
        tokens, work.samples = self.sampler.sample(stacked, rows)
        for (it, _), token in zip(plain + forks, tokens):
            work.emitted[id(it)] = [token]
        return [it for it, _ in forks]

    def _verify_drafts(
        self, items: list[ScheduledSeq], logits: list[torch.Tensor], work: _StepWork
    ) -> None:
        """Rejection-sample every drafted item against its target logits."""
        for it, lg in zip(items, logits):
            if it.lookahead:
                record, samples = self._verify(it, lg, work)
                work.drafts.append(record)
                work.samples += samples
                work.emitted[id(it)] = list(record.emitted)

    def _append(self, items: list[ScheduledSeq], work: _StepWork) -> None:
        """Count the step's work, commit computed KV to the prefix cache, append emitted tokens."""
        for it in items:
            seq, new = it.seq, work.emitted.get(id(it), [])
            is_decode = _decoding(it)
            work.decode += (len(new) or it.count) if is_decode else 0
            forked_prompt = seq.parent is not None and not seq.output_ids
            work.prefill += 0 if is_decode or forked_prompt else it.count
            seq.target_forwards += 1
            seq.num_computed += it.count + max(len(new) - 1, 0) * bool(it.draft)
            if it.lookahead:  # give back the slots of rejected (or never drafted) tokens
                self.blocks.rollback(seq.seq_id, self.blocks.length(seq.seq_id) - seq.num_computed)
            self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            for token in new:
                work.outputs.append(self.requests.append(seq, token))
                if seq.finished:
                    break

    def _report(self, batch: Batch, work: _StepWork, elapsed: float) -> StepReport:
        """The step's immutable record, with the block events it caused and the map they built."""
        kind = (
            "idle"
            if not batch.items
            else "prefill"
            if not work.decode
            else "decode"
            if not work.prefill
            else "mixed"
        )
        events = tuple(self._block_events)
        self._block_events.clear()  # in place: the allocator holds this list's append
        return StepReport(
            step=self._steps,
            kind=kind,
            num_seqs=len(batch.items),
            prefill_tokens=work.prefill,
            decode_tokens=work.decode,
            prefix_hit_tokens=batch.prefix_hit_tokens,
            elapsed_s=elapsed,
            outputs=tuple(work.outputs),
            samples=tuple(work.samples),
            blocks=self.block_map.snapshot(),
            block_events=events,
            preempted=tuple(s.seq_id for s in batch.preempted),
            drafts=tuple(work.drafts),
            cow_copies=len(batch.copies),
            swaps=tuple(work.swaps),
            seqs=self.sequences(),
            batch=work.ran,
            token_budget=self.scheduler.max_batch_tokens,
            grammar_s=work.grammar_s,
        )

    def sequences(self) -> tuple[SeqRecord, ...]:
        """Every sequence the scheduler holds (running, swapped, waiting), then those that ended
        since the last call (a beam dropped by its search ends with no reason and is left out)."""
        s = self.scheduler
        ended = s.take_ended()
        live = [*s.running, *s.swapped, *s.waiting]
        ended = [q for q in ended if q.finish_reason is not None and q not in live]
        return tuple(
            self.requests.record(seq, *self.block_map.held(seq.seq_id)) for seq in live + ended
        )

    def _draft(self, items: list[ScheduledSeq]) -> None:
        """Ask the proposer for drafts, at most as many as each item's reserved slots and limits
        allow."""
        if not items:
            return
        limit = min(self.max_model_len, self.proposer.max_len)
        ks = [
            min(
                it.lookahead,
                limit - len(it.seq.token_ids),
                it.seq.sampling.params.max_tokens - it.seq.num_output_tokens - 1,
            )
            for it in items
        ]
        drafts, qs = self.proposer.propose([it.seq for it in items], [max(k, 0) for k in ks])
        for it, d, q in zip(items, drafts, qs):
            end = self.requests.through_eos(it.seq, d)  # nothing after a drafted end is kept
            it.draft, self._q[it.seq.seq_id] = d[:end], None if q is None else q[:end]

    def _verify(
        self, it: ScheduledSeq, logits: torch.Tensor, work: _StepWork
    ) -> tuple[DraftRecord, list]:
        """Rejection-sample it.draft against the target logits [len(draft) + 1, V]."""
        seq, draft, sampling = it.seq, it.draft, it.seq.sampling
        t0 = time.perf_counter()
        masks = masks_along(seq.grammar, draft) if seq.grammar else [None] * (len(draft) + 1)
        work.grammar_s += time.perf_counter() - t0 if seq.grammar else 0.0
        rows = [_row(seq, seq.token_ids + draft[:i], m) for i, m in enumerate(masks)]
        p = target_probs(logits, rows)
        accepted, nxt = verify(
            p, self._q.pop(seq.seq_id, None), draft, sampling.params.greedy, sampling.generator
        )
        emitted = draft[:accepted] + [nxt]
        emitted = emitted[
            : self.requests.through_eos(seq, emitted)
        ]  # no bonus after an accepted end of sequence
        self.proposer.accept(seq, len(seq.token_ids), len(draft), accepted)
        seq.spec = seq.spec.add(len(draft), accepted, len(emitted))
        records = self.sampler.record(logits[: len(emitted)], rows[: len(emitted)], emitted)
        text = self.sampler.text
        return DraftRecord(
            seq.seq_id,
            self.proposer.name,
            tuple(draft),
            accepted,
            tuple(emitted),
            tuple(map(text, draft)),
            tuple(map(text, emitted)),
            seq.spec,
        ), records

    def set_speculation(self, enabled: bool, num_draft: int | None = None) -> None:
        """Turn speculation on or off and change the draft length; applies from the next step."""
        if enabled and self.proposer is None:
            raise PagechatError("speculation needs a proposer: start with --draft DIR or --ngram")
        if num_draft is not None and num_draft < 1:
            raise PagechatError(f"draft length must be >= 1, got {num_draft}")
        self.speculate = enabled
        self.num_draft = num_draft or self.num_draft

    def stream(self, request_id: int) -> Iterator[str]:
        """Step the engine until the request finishes, yielding its text deltas as they come."""
        seq = self.requests[request_id]
        while not seq.finished:
            for out in self.step().outputs:
                if out.request_id == request_id and out.text_delta:
                    yield out.text_delta
        if seq.error:
            raise PagechatError(seq.error)

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_report=None,
    ) -> list[Sequence]:
        """Run prompts as one continuous batch to completion (the offline API); returns their
        sequences in order, with n > 1 each prompt's samples one after another."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.requests.add(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            report = self.step()
            if on_report is not None:
                on_report(report)
        return [self.requests[j] for i in ids for j in (i, *self.requests[i].children)]
