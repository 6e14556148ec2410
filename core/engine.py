"""Engine: add requests, step the scheduler and model, stream text; the one object the CLI and the
app drive."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from pagechat.core.beam import BeamChoice, BeamGroup
from pagechat.core.blockmap import BlockMap
from pagechat.core.blocks import BlockEvent, BlockManager
from pagechat.core.config import EngineConfig
from pagechat.core.detok import update_text
from pagechat.core.errors import PagechatError, check_text, one_line
from pagechat.core.gguf_model import FLOATS
from pagechat.core.graphs import TRACE_SUPPORTED
from pagechat.core.kv import allocate_pool, block_bytes, copy_blocks, pool_blocks
from pagechat.core.loader import load_tokenizer, open_weights, read_spec
from pagechat.core.model import DecoderModel
from pagechat.core.modelspec import DTYPES, ModelSpec, dtype_name
from pagechat.core.native import cpu_has_native_bf16
from pagechat.core.params import SamplingParams
from pagechat.core.quantization import QuantPlan, resolve_quant
from pagechat.core.report import (
    BatchItem,
    DraftRecord,
    SeqRecord,
    StepReport,
    SwapRecord,
    TokenOutput,
)
from pagechat.core.runner import ModelRunner
from pagechat.core.sampler import Sampler, SampleRecord, SampleRow, make_generator, target_probs
from pagechat.core.scheduler import Batch, ScheduledSeq, Scheduler, SwapPlan
from pagechat.core.sequence import SamplingState, Sequence, Status
from pagechat.core.spec import DraftModelProposer, NgramProposer, verify
from pagechat.core.swap import HostBlocks, copy_between, host_pool
from pagechat.core.threads import apply_threads
from pagechat.core.timelimit import within

TEMPLATE_LIMIT_S = 5.0  # a chat template renders in milliseconds; one that runs longer is stuck


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; asking for cuda without one is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise PagechatError("--device cuda was asked for, but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """auto -> the checkpoint's dtype on CUDA; bfloat16 on a CPU with native bf16; float32
    otherwise."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_kv_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """auto -> float16 where the model computes in float32 on a CPU (half the KV memory, and half
    the bytes attention reads a step, as llama.cpp keeps its cache), else the compute dtype."""
    if name != "auto":
        return DTYPES[name]
    return torch.float16 if device.type == "cpu" and compute == torch.float32 else compute


def resolve_quant_mode(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> str | None:
    """--quant, else bf16-wo for a bf16 checkpoint under --dtype auto on a CPU without native bf16:
    its linear weights stay in bf16 as stored, so decode streams half the bytes float32 would,
    while prefill, activations and the KV pool stay float32."""
    if (
        cfg.quant is None
        and cfg.dtype == "auto"
        and device.type == "cpu"
        and spec.quantization is None
        and spec.torch_dtype == "bfloat16"
        and not cpu_has_native_bf16()
    ):
        return "bf16-wo"
    return cfg.quant


@dataclass(slots=True)
class LoadedModel:
    """A checkpoint ready to run: its spec, tokenizer, quantisation mode and decoder on the
    device."""

    spec: ModelSpec
    quant: QuantPlan
    tokenizer: object
    model: DecoderModel
    dtype: torch.dtype
    max_len: int


def load_checkpoint(model_dir: Path, cfg: EngineConfig, device: torch.device) -> LoadedModel:
    """Read, check and load one checkpoint directory (the target model, or a speculative draft)."""
    spec = read_spec(model_dir)
    quant = resolve_quant(
        spec, resolve_quant_mode(cfg, spec, device), model_dir, cfg.lm_head
    )  # refuses what cannot run
    dtype = resolve_dtype(cfg.dtype, device, spec.torch_dtype)
    tokenizer = load_tokenizer(model_dir)
    max_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    weights = open_weights(model_dir, spec)
    weights.check_layers(spec.num_layers)
    try:
        model = DecoderModel(
            spec,
            weights,
            dtype,
            max_len,
            load=quant.loader(device),
            head=quant.head(device, dtype),
            embed=quant.embedding(device, dtype),
        )
    finally:
        weights.close()  # the model holds its own tensors: the file's pages are let go
    return LoadedModel(spec, quant, tokenizer, model.to(device).eval(), dtype, max_len)


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


def _state(seq: Sequence) -> str:
    """The scheduler's state of a sequence; a waiting one that was preempted says so."""
    if seq.status is Status.WAITING and seq.num_preemptions:
        return "preempted"
    return seq.status.value


def _row(seq: Sequence, history: list[int]) -> SampleRow:
    """The sampler's view of a sequence: its settings, the tokens so far and its random stream."""
    return SampleRow(seq.seq_id, seq.sampling.params, history, seq.sampling.generator)


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
        self.dtype, self.max_model_len = target.dtype, target.max_len
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
            self.model, self.pool, self.blocks, self.device, self._graphs(self.quant)
        )
        self.sampler = Sampler(lambda i: self.tokenizer.decode([i]))
        eos = set(spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.proposer = self._proposer(cfg, num_blocks)
        self.speculate, self.num_draft = self.proposer is not None, cfg.num_draft
        if self.proposer is not None:  # verification steps take the causal-mask trace: made now
            self.runner.warm_up(2)
        self._q: dict[int, torch.Tensor | None] = {}  # draft distributions, _draft to _verify
        self.requests: dict[int, Sequence] = {}
        self._beams: dict[int, BeamGroup] = {}  # request id -> its beam search
        self._beam_of: dict[int, BeamGroup] = {}  # running beam's seq id -> its beam search
        self._next_id = 0
        self._steps = 0

    def _host_pool(self, cfg: EngineConfig, num_blocks: int) -> HostBlocks | None:
        """With --preempt swap, the host pool preempted sequences' KV waits in."""
        if cfg.preempt != "swap":
            return None
        host = HostBlocks(cfg.swap_blocks or num_blocks)
        self.host_pool = host_pool(self.pool, host.num_blocks)
        return host

    def _proposer(self, cfg: EngineConfig, num_blocks: int):
        """The speculative proposer the config asks for, or None."""
        if cfg.ngram:
            return NgramProposer()
        if not cfg.draft:
            return None
        # --quant and --lm-head name the target's; a draft is quantised only if its own checkpoint
        # is, and its head follows (auto). It runs at the target's dtype, never as an automatic
        # bf16-wo: a draft is small, so bound by per-op overhead, which bf16-wo's casts add to
        # (docs/benchmarks.md).
        draft_cfg = replace(cfg, quant=None, lm_head="auto", dtype=dtype_name(self.dtype))
        draft = load_checkpoint(Path(cfg.draft), draft_cfg, self.device)
        if draft.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise PagechatError(
                f"the draft model's tokenizer ({cfg.draft}) differs from the target's "
                f"({self.model_dir}); a draft must share the target's vocabulary"
            )
        return DraftModelProposer(
            draft,
            num_blocks,
            cfg.block_size,
            self.device,
            self.spec.vocab_size,
            self._graphs(draft.quant),
        )

    def _graphs(self, quant) -> bool:
        """Whether a model's small steps run as traced graphs: unless --eager, on a Python torch.jit
        supports,
        for layers a trace records faithfully."""
        return self.config.graphs and TRACE_SUPPORTED and quant.traceable

    # -- requests -------------------------------------------------------------------------------
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
                f"the tokenizer in {self.model_dir} has no chat template; run without --chat"
            )
        for i, m in enumerate(messages, 1):
            check_text(m["content"], f"message {i} ({m['role']})")
        try:
            text = within(
                TEMPLATE_LIMIT_S,
                f"the chat template of {self.model_dir}",
                lambda: self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                ),
            )
        except PagechatError:
            raise
        except Exception as e:  # jinja raises its own types; raise_exception() in a template too
            raise PagechatError(f"the chat template failed: {str(e).splitlines()[0]}") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0
    ) -> int:
        """Queue a prompt (text or token ids); returns its request id. The next step() may admit
        it. A lower priority is admitted before and preempted after a higher one."""
        params = (params or SamplingParams()).validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise PagechatError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PagechatError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(shorten the prompt)"
            )
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise PagechatError(
                f"token id {bad[0]} is outside the model's vocabulary "
                f"(0..{self.spec.vocab_size - 1})"
            )
        seq_id = self._new_id()
        sampling = SamplingState(params, self._generator(params.seed))
        seq = Sequence(seq_id, ids, len(ids), sampling, time.perf_counter(), priority=priority)
        if params.beam_width > 1:
            self._beams[seq_id] = self._beam_of[seq_id] = BeamGroup(
                seq, self.eos_ids, self.max_model_len
            )
        self.requests[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _generator(self, seed: int | None) -> torch.Generator:
        """A request's own random stream: seeded as asked, else at random (so that samples forked
        from it, seeded seed + j, and a later change of settings keep their own streams)."""
        return make_generator(seed if seed is not None else random.randrange(2**63), self.device)

    def update_params(self, request_id: int, params: SamplingParams) -> None:
        """Change a request's sampling settings; they apply from its next sampled token."""
        seq = self._request(request_id)
        params.validate()
        if params.seed != seq.sampling.params.seed:
            seq.sampling.generator = self._generator(params.seed)
        seq.sampling.params = params

    def abort(self, request_id: int) -> None:
        """Stop a request now, keeping what it generated; its blocks are freed."""
        seq = self._request(request_id)
        if request_id in self._beams:
            self._drop_beams(self._beams.pop(request_id))
        if not seq.finished:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.finish_time = "abort", time.perf_counter()

    def release(self, request_id: int) -> Sequence:
        """Forget a finished request and its samples, so a long-running caller (the server, the
        app) keeps no per-request state in the engine; returns the request's sequence."""
        seq = self._request(request_id)
        if not seq.finished or any(not self.requests[c].finished for c in seq.children):
            raise PagechatError(f"request {request_id} has not finished; abort it first")
        for child in seq.children:
            del self.requests[child]
        return self.requests.pop(request_id)

    def _request(self, request_id: int) -> Sequence:
        if request_id not in self.requests:
            raise PagechatError(f"no request with id {request_id}")
        return self.requests[request_id]

    @property
    def precision(self) -> str:
        """The activation dtype, and the weights' quantisation mode if any: 'float32', 'float32 ·
        bf16-wo'; a GGUF's its most common quantised type: 'bfloat16 · Q4_K'."""
        dtype = dtype_name(self.dtype)
        mode = self.quant.mode
        if mode == "gguf":
            floats = {t.name for t in FLOATS}
            mode = next((t for t in self.spec.quantization["types"] if t not in floats), mode)
        return f"{dtype} · {mode}" if mode else dtype

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
        work = _StepWork([self._failed(seq) for seq in batch.failed], swaps=swaps)
        if batch.items:
            try:
                self._run(batch.items, work)
            except Exception as e:  # noqa: BLE001 - the requests it ran fail; the engine goes on
                self._fail(batch.items, work, e)
        if self.proposer is not None:
            self.proposer.release_missing({s.seq_id for s in self.scheduler.running})
        return self._report(batch, work, time.perf_counter() - t0)

    def _run(self, items: list[ScheduledSeq], work: _StepWork) -> None:
        """The step's work on its batch: draft, forward, sample or verify, append, pick beams."""
        self._draft([it for it in items if it.lookahead])
        work.ran = _ran(items)
        logits = self._forward(items)
        plain = self._sample(items, logits, work)
        self._verify_drafts(items, logits, work)
        self._append(items + plain, work)
        self._advance_beams(work)

    def _fail(self, items: list[ScheduledSeq], work: _StepWork, error: Exception) -> None:
        """End every request the batch ran with the step's error, their blocks freed: the prefix
        cache keeps only KV the sequences counted as computed, so nothing half-written is hit."""
        why = one_line(error)
        if not isinstance(error, PagechatError):
            why = f"engine step failed: {why}"
        roots = {id(r): r for r in map(self._root, (it.seq for it in items))}
        for root in roots.values():
            if root.seq_id in self._beams:
                self._drop_beams(self._beams.pop(root.seq_id))
            for seq in (root, *(self.requests[c] for c in root.children)):
                if not seq.finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason, seq.error, seq.fault = "error", why, True
                    work.outputs.append(self._output(seq, []))

    def _root(self, seq: Sequence) -> Sequence:
        """The request a sequence belongs to: itself, its sample's parent or its beam's search."""
        group = self._beam_of.get(seq.seq_id)
        if group is not None:
            return group.root
        return seq if seq.parent is None else self.requests[seq.parent]

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

    def _forward(self, items: list[ScheduledSeq]) -> list[torch.Tensor]:
        """One forward pass over the flat batch; per item the logits of its sampled positions."""
        sizes = [1 + len(it.draft) if it.samples else 0 for it in items]
        return list(self.runner.run(items, sizes).split(sizes))

    def _sample(
        self, items: list[ScheduledSeq], logits: list[torch.Tensor], work: _StepWork
    ) -> list[ScheduledSeq]:
        """Sample one token for every item that ends its sequence without a draft, and for the
        samples forked from a finished prompt (n > 1); returns those forks' items."""
        plain = [(it, lg) for it, lg in zip(items, logits) if it.samples and not it.lookahead]
        for it, lg in plain:
            if it.seq.seq_id in self._beam_of:
                self._beam_of[it.seq.seq_id].pending[it.seq.seq_id] = lg[-1]
        plain = [(it, lg) for it, lg in plain if it.seq.seq_id not in self._beam_of]
        forks = [
            (ScheduledSeq(kid, it.start, it.count), lg)
            for it, lg in plain
            for kid in self._fork(it)
        ]
        rows = [_row(it.seq, it.seq.token_ids) for it, _ in plain + forks]
        stacked = torch.cat([lg for _, lg in plain + forks]) if rows else logits[0][:0]
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
                record, samples = self._verify(it, lg)
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
                work.outputs.append(self._append_token(seq, token))
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
        )

    def sequences(self) -> tuple[SeqRecord, ...]:
        """Every sequence the scheduler holds (running, swapped, waiting), then those that ended
        since the last call (a beam dropped by its search ends with no reason and is left out)."""
        s = self.scheduler
        ended, s.ended = s.ended, []
        live = [*s.running, *s.swapped, *s.waiting]
        ended = [q for q in ended if q.finish_reason is not None and q not in live]
        return tuple(self._record(seq) for seq in live + ended)

    def _record(self, seq: Sequence) -> SeqRecord:
        blocks, shared = self.block_map.held(seq.seq_id)
        request, role, index = self._role(seq)
        return SeqRecord(
            seq.seq_id,
            request,
            role,
            index,
            _state(seq),
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_computed,
            blocks,
            shared,
            seq.num_preemptions,
            seq.finish_reason,
        )

    def _role(self, seq: Sequence) -> tuple[int, str, int]:
        """(the request it answers, what it is, its place): sample k of n, or a beam's rank."""
        group = self._beam_of.get(seq.seq_id)
        if group is not None and seq in group.running:
            return group.root.seq_id, "beam", group.running.index(seq)
        if seq.parent is not None:
            return seq.parent, "sample", seq.sample_index
        return seq.seq_id, "sample" if seq.sampling.params.n > 1 else "request", 0

    def _fork(self, it: ScheduledSeq) -> list[Sequence]:
        """At the end of a prompt with n > 1, fork n - 1 samples that share its blocks
        (copy-on-write)."""
        parent, params = it.seq, it.seq.sampling.params
        if params.n == 1 or parent.children or parent.parent is not None or parent.output_ids:
            return []
        kids = []
        for j in range(1, params.n):
            seed = None if params.seed is None else params.seed + j
            kid = Sequence(
                self._new_id(),
                list(parent.token_ids),
                parent.num_prompt_tokens,
                SamplingState(params, self._generator(seed)),
                parent.arrival,
                status=Status.RUNNING,
                num_computed=it.start,
                parent=parent.seq_id,
                sample_index=j,
                priority=parent.priority,
            )
            self.blocks.fork(parent.seq_id, kid.seq_id)
            self.scheduler.running.append(kid)
            self.requests[kid.seq_id] = kid
            parent.children.append(kid.seq_id)
            kids.append(kid)
        return kids

    # -- beam search -----------------------------------------------------------------------------
    def _advance_beams(self, work: _StepWork) -> None:
        """Let every beam search whose beams all have this step's logits pick its next beams."""
        for group in list(self._beams.values()):
            if group.ready():
                self._apply_choices(group, group.select())
                if group.done:
                    work.outputs.append(self._finish_beams(group))

    def _apply_choices(self, group: BeamGroup, choices: list[BeamChoice]) -> None:
        """Make the picked beams: the first pick of a beam goes on as itself, a second one is forked
        from it (sharing its blocks), a beam not picked is freed."""
        reused: set[int] = set()
        plan = []
        for c in choices:
            reuse = c.parent.seq_id not in reused and c.parent is not group.root
            reused.add(c.parent.seq_id)
            plan.append((c, reuse))
        beams = [c.parent if reuse else self._fork_beam(c) for c, reuse in plan]
        for c, reuse in plan:  # after the forks, which copy the parent's tokens as they were
            if reuse:
                c.parent.token_ids.append(c.token)
                self.scheduler.unpark(c.parent)
        kept = {b.seq_id for b in beams}
        for old in group.running:
            if old is group.root:
                self.scheduler.detach(old)
            elif old.seq_id not in kept:
                self.scheduler.finish(old)
            if old.seq_id not in kept:
                del self._beam_of[old.seq_id]
        group.running = beams
        self._beam_of.update((b.seq_id, group) for b in beams)

    def _fork_beam(self, choice: BeamChoice) -> Sequence:
        """A new beam: its parent's tokens plus the picked one, sharing the parent's blocks; a
        parent preempted meanwhile has none, so the beam waits to be computed afresh."""
        parent = choice.parent
        beam = Sequence(
            self._new_id(),
            [*parent.token_ids, choice.token],
            parent.num_prompt_tokens,
            SamplingState(parent.sampling.params),
            parent.arrival,
            status=parent.status,
            num_computed=parent.num_computed,
            priority=parent.priority,
        )
        if parent.status is Status.RUNNING:
            self.blocks.fork(parent.seq_id, beam.seq_id)
            self.scheduler.running.append(beam)
        else:
            beam.num_computed = 0
            self.scheduler.add(beam, front=True)
        return beam

    def _drop_beams(self, group: BeamGroup) -> None:
        """Free every running beam of a search (the request itself is finished by the caller)."""
        for beam in group.running:
            self._beam_of.pop(beam.seq_id, None)
            if beam is not group.root:
                self.scheduler.finish(beam)
        group.running = []

    def _finish_beams(self, group: BeamGroup) -> TokenOutput:
        """End a search: the request's tokens and text become the best hypothesis'."""
        self._drop_beams(group)
        root = self._beams.pop(group.root.seq_id).root
        root.beams = group.results(self._decode)
        best = root.beams[0]
        root.token_ids[root.num_prompt_tokens :] = best.token_ids
        root.text = best.text
        ended = bool(best.token_ids) and best.token_ids[-1] in group.eos_ids
        now = time.perf_counter()
        self.scheduler.finish(root)
        root.finish_reason, root.finish_time = "stop" if ended else "length", now
        root.first_token_time = root.first_token_time or now
        return self._output(root, list(best.token_ids))

    def _failed(self, seq: Sequence) -> TokenOutput:
        """The output of a sequence the pool cannot hold; a failed beam fails its whole search."""
        group = self._beam_of.get(seq.seq_id)
        if group is None:
            return self._output(seq, [])
        self._drop_beams(self._beams.pop(group.root.seq_id))
        root = group.root
        self.scheduler.finish(root)
        root.finish_reason, root.error = "error", seq.error
        return self._output(root, [])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
            end = self._through_eos(
                it.seq, d
            )  # nothing after a drafted end of sequence could be kept
            it.draft, self._q[it.seq.seq_id] = d[:end], None if q is None else q[:end]

    def _through_eos(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of tokens the sequence can take: up to its first end-of-sequence token unless
        ignore_eos."""
        if seq.sampling.params.ignore_eos:
            return len(tokens)
        return next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))

    def _verify(self, it: ScheduledSeq, logits: torch.Tensor) -> tuple[DraftRecord, list]:
        """Rejection-sample it.draft against the target logits [len(draft) + 1, V]."""
        seq, draft, sampling = it.seq, it.draft, it.seq.sampling
        rows = [_row(seq, seq.token_ids + draft[:i]) for i in range(len(draft) + 1)]
        p = target_probs(logits, rows)
        accepted, nxt = verify(
            p, self._q.pop(seq.seq_id, None), draft, sampling.params.greedy, sampling.generator
        )
        emitted = draft[:accepted] + [nxt]
        emitted = emitted[
            : self._through_eos(seq, emitted)
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

    def _append_token(self, seq: Sequence, token: int) -> TokenOutput:
        """Add a sampled token to seq, update its text, and finish it if a stop condition holds."""
        now = time.perf_counter()
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        update_text(self.tokenizer, seq)
        p = seq.sampling.params
        reason = None
        if token in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and any(s in seq.text for s in p.stop):
            seq.text = seq.text[: min(seq.text.find(s) for s in p.stop if s in seq.text)]
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.finish_time = reason, now
        return self._output(seq, [token])

    def _output(self, seq: Sequence, tokens: list[int]) -> TokenOutput:
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

    def stream(self, request_id: int) -> Iterator[str]:
        """Step the engine until the request finishes, yielding its text deltas as they come."""
        seq = self._request(request_id)
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
        """Run prompts as one continuous batch to completion; returns their sequences in order (with
        n > 1,
        each prompt's samples one after another)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            report = self.step()
            if on_report is not None:
                on_report(report)
        return [self.requests[j] for i in ids for j in (i, *self.requests[i].children)]
