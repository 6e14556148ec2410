"""Engine: add requests, step the scheduler and model, stream text; the one object the CLI and the app drive."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pagechat.core.blocks import BlockManager
from pagechat.core.config import EngineConfig
from pagechat.core.detok import update_text
from pagechat.core.errors import PagechatError
from pagechat.core.graphs import TRACE_SUPPORTED
from pagechat.core.kv import allocate_pool, copy_blocks, pool_blocks
from pagechat.core.loader import (
    DTYPES,
    ModelSpec,
    WeightReader,
    dtype_name,
    load_tokenizer,
    read_spec,
)
from pagechat.core.model import DecoderModel
from pagechat.core.params import SamplingParams
from pagechat.core.quantization import QuantPlan, resolve_quant
from pagechat.core.report import DraftRecord, StepReport, TokenOutput
from pagechat.core.runner import ModelRunner
from pagechat.core.sampler import Sampler, SampleRow, target_probs
from pagechat.core.scheduler import ScheduledSeq, Scheduler
from pagechat.core.sequence import Sequence, Status
from pagechat.core.spec import DraftModelProposer, NgramProposer, verify


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; asking for cuda without one is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise PagechatError("--device cuda was asked for, but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 natively (AVX512-BF16 / AMX), where bf16 decodes ~2x faster than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """auto -> the checkpoint's dtype on CUDA; bfloat16 on a CPU with native bf16; float32 otherwise."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_quant_mode(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> str | None:
    """--quant, else bf16-wo for a bf16 checkpoint under --dtype auto on a CPU without native bf16: its linear
    weights stay in bf16 as stored (half the bytes float32 streams per token; decode 16.3 -> 28.0 tok/s on the
    135M model here) while prefill, activations and the KV pool stay float32."""
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
    """A checkpoint ready to run: its spec, tokenizer, quantisation mode and decoder on the device."""

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
        spec, resolve_quant_mode(cfg, spec, device), model_dir
    )  # refuses what cannot run
    dtype = resolve_dtype(cfg.dtype, device, spec.torch_dtype)
    tokenizer = load_tokenizer(model_dir)
    max_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    model = DecoderModel(
        spec,
        WeightReader(model_dir),
        dtype,
        max_len,
        load=quant.loader(device),
        head=quant.head(device, dtype),
    )
    return LoadedModel(spec, quant, tokenizer, model.to(device).eval(), dtype, max_len)


class Engine:
    """Paged-KV inference engine over one local checkpoint."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = cfg = (config or EngineConfig()).validate()
        self.model_dir = Path(model_dir)
        self.device = resolve_device(cfg.device)
        target = load_checkpoint(self.model_dir, cfg, self.device)
        self.spec = spec = target.spec
        self.quant, self.tokenizer, self.model = target.quant, target.tokenizer, target.model
        self.dtype, self.max_model_len = target.dtype, target.max_len
        num_blocks = pool_blocks(spec, cfg, self.dtype, self.device, self.max_model_len)
        self.pool = allocate_pool(spec, num_blocks, cfg.block_size, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, enable_prefix_cache=cfg.prefix_cache)
        self.scheduler = Scheduler(self.blocks, cfg.max_batch_tokens, cfg.max_seqs)
        self.runner = ModelRunner(
            self.model, self.pool, self.blocks, self.device, self._graphs(self.quant)
        )
        self.sampler = Sampler(lambda i: self.tokenizer.decode([i]))
        eos = set(spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.attention_backend = "torch-sdpa"
        self.proposer = self._proposer(cfg, num_blocks)
        self.speculate, self.num_draft = self.proposer is not None, cfg.num_draft
        if self.proposer is not None:
            self.runner.warm_up(
                2
            )  # verification steps take the causal-mask trace: made now, not in the first reply
        self._q: dict[
            int, torch.Tensor | None
        ] = {}  # draft distributions between _draft and _verify
        self.requests: dict[int, Sequence] = {}
        self._next_id = 0
        self._steps = 0

    def _proposer(self, cfg: EngineConfig, num_blocks: int):
        """The speculative proposer the config asks for, or None."""
        if cfg.ngram:
            return NgramProposer()
        if not cfg.draft:
            return None
        # --quant names the target's mode; a draft is quantised only if its own checkpoint is. It runs at the
        # target's dtype, never as an automatic bf16-wo: a draft is small, so overhead-bound, and bf16-wo's casts
        # made the demo draft's speculation slower (1.07-1.19x -> 0.90-0.98x of plain decode)
        draft = load_checkpoint(
            Path(cfg.draft), replace(cfg, quant=None, dtype=dtype_name(self.dtype)), self.device
        )
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
        """Whether a model's small steps run as traced graphs: unless --eager, on a Python torch.jit supports,
        for layers a trace records faithfully."""
        return self.config.graphs and TRACE_SUPPORTED and quant.traceable

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a plain prompt, or of one user turn wrapped in the model's chat template."""
        if not chat:
            return self.tokenizer(prompt).input_ids
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a whole conversation through the chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PagechatError(
                f"the tokenizer in {self.model_dir} has no chat template; run without --chat"
            )
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (text or token ids); returns its request id. The next step() may admit it."""
        params = (params or SamplingParams()).validate()
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
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
                f"token id {bad[0]} is outside the model's vocabulary (0..{self.spec.vocab_size - 1})"
            )
        seq_id = self._new_id()
        seq = Sequence(
            seq_id, ids, len(ids), params, time.perf_counter(), self._generator(params.seed)
        )
        self.requests[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _generator(self, seed: int | None) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed if seed is not None else random.randrange(2**63))
        return g

    def update_params(self, request_id: int, params: SamplingParams) -> None:
        """Change a request's sampling settings; they apply from its next sampled token."""
        seq = self._request(request_id)
        params.validate()
        if params.seed != seq.params.seed:
            seq.generator = self._generator(params.seed)
        seq.params = params

    def abort(self, request_id: int) -> None:
        """Stop a request now, keeping what it generated; its blocks are freed."""
        seq = self._request(request_id)
        if not seq.finished:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.finish_time = "abort", time.perf_counter()

    def _request(self, request_id: int) -> Sequence:
        if request_id not in self.requests:
            raise PagechatError(f"no request with id {request_id}")
        return self.requests[request_id]

    @property
    def precision(self) -> str:
        """The activation dtype, and the weights' quantisation mode if any: 'float32', 'float32 · bf16-wo'."""
        dtype = dtype_name(self.dtype)
        return f"{dtype} · {self.quant.mode}" if self.quant.mode else dtype

    @property
    def graphs(self) -> bool:
        """True when decode steps run as traced graphs (core/graphs.py), False when every op runs from Python."""
        return self.runner.graphs is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Schedule, run one forward pass over the flat batch, sample (or verify drafts), and report."""
        t0 = time.perf_counter()
        self._steps += 1
        k = self.num_draft if self.proposer is not None and self.speculate else 0
        batch = self.scheduler.schedule(lookahead=k)
        copy_blocks(self.pool, batch.copies)
        outputs = [self._output(seq, []) for seq in batch.failed]
        samples, drafts = [], []
        prefill = decode = 0
        if batch.items:
            spec = [it for it in batch.items if it.lookahead]
            if spec:
                self._draft(spec)
            sizes = [1 + len(it.draft) if it.samples else 0 for it in batch.items]
            logits = self.runner.run(batch.items, sizes).split(sizes)
            plain = [
                (it, lg) for it, lg in zip(batch.items, logits) if it.samples and not it.lookahead
            ]
            forks = [
                (ScheduledSeq(kid, it.start, it.count), lg)
                for it, lg in plain
                for kid in self._fork(it)
            ]
            plain += forks
            rows = [
                SampleRow(it.seq.seq_id, it.seq.params, it.seq.token_ids, it.seq.generator)
                for it, _ in plain
            ]
            tokens, samples = self.sampler.sample(
                torch.cat([lg for _, lg in plain]) if plain else logits[0][:0], rows
            )
            emitted = {id(it): [t] for (it, _), t in zip(plain, tokens)}
            for it, lg in zip(batch.items, logits):
                if it.lookahead:
                    record, recs = self._verify(it, lg)
                    drafts.append(record)
                    samples += recs
                    emitted[id(it)] = list(record.emitted)
            for it in batch.items + [it for it, _ in forks]:
                seq, new = it.seq, emitted.get(id(it), [])
                is_decode = len(seq.token_ids) - it.start == 1 and seq.num_output_tokens > 0
                decode += len(new) if is_decode else 0
                prefill += (
                    0 if is_decode or seq.parent is not None and not seq.output_ids else it.count
                )
                seq.target_forwards += 1
                seq.num_computed += it.count + max(len(new) - 1, 0) * bool(it.draft)
                if it.lookahead:  # give back the slots of rejected (or never drafted) tokens
                    self.blocks.rollback(
                        seq.seq_id, self.blocks.length(seq.seq_id) - seq.num_computed
                    )
                self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed)
                for token in new:
                    outputs.append(self._append_token(seq, token))
                    if seq.finished:
                        break
        if self.proposer is not None:
            self.proposer.release_missing({s.seq_id for s in self.scheduler.running})
        kind = (
            "idle"
            if not batch.items
            else "prefill"
            if not decode
            else "decode"
            if not prefill
            else "mixed"
        )
        return StepReport(
            step=self._steps,
            kind=kind,
            num_seqs=len(batch.items),
            prefill_tokens=prefill,
            decode_tokens=decode,
            prefix_hit_tokens=batch.prefix_hit_tokens,
            elapsed_s=time.perf_counter() - t0,
            outputs=tuple(outputs),
            samples=tuple(samples),
            blocks=self.blocks.snapshot(),
            preempted=tuple(s.seq_id for s in batch.preempted),
            attention_backend=self.attention_backend,
            drafts=tuple(drafts),
            cow_copies=len(batch.copies),
        )

    def _fork(self, it: ScheduledSeq) -> list[Sequence]:
        """At the end of a prompt with n > 1, fork n - 1 samples that share its blocks (copy-on-write)."""
        parent = it.seq
        if (
            parent.params.n == 1
            or parent.children
            or parent.parent is not None
            or parent.output_ids
        ):
            return []
        kids = []
        for j in range(1, parent.params.n):
            seed = None if parent.params.seed is None else parent.params.seed + j
            kid = Sequence(
                self._new_id(),
                list(parent.token_ids),
                parent.num_prompt_tokens,
                parent.params,
                parent.arrival,
                self._generator(seed),
                status=Status.RUNNING,
                num_computed=it.start,
                parent=parent.seq_id,
            )
            self.blocks.fork(parent.seq_id, kid.seq_id)
            self.scheduler.running.append(kid)
            self.requests[kid.seq_id] = kid
            parent.children.append(kid.seq_id)
            kids.append(kid)
        return kids

    def _draft(self, items: list[ScheduledSeq]) -> None:
        """Ask the proposer for drafts, at most as many as each item's reserved slots and limits allow."""
        limit = min(self.max_model_len, self.proposer.max_len)
        ks = [
            min(
                it.lookahead,
                limit - len(it.seq.token_ids),
                it.seq.params.max_tokens - it.seq.num_output_tokens - 1,
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
        """How many of tokens the sequence can take: up to its first end-of-sequence token unless ignore_eos."""
        if seq.params.ignore_eos:
            return len(tokens)
        return next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))

    def _verify(self, it: ScheduledSeq, logits: torch.Tensor) -> tuple[DraftRecord, list]:
        """Rejection-sample it.draft against the target logits [len(draft) + 1, V]."""
        seq, draft = it.seq, it.draft
        rows = [
            SampleRow(seq.seq_id, seq.params, seq.token_ids + draft[:i], seq.generator)
            for i in range(len(draft) + 1)
        ]
        p = target_probs(logits, rows)
        accepted, nxt = verify(
            p, self._q.pop(seq.seq_id, None), draft, seq.params.greedy, seq.generator
        )
        emitted = draft[:accepted] + [nxt]
        emitted = emitted[
            : self._through_eos(seq, emitted)
        ]  # no bonus after an accepted end of sequence
        self.proposer.accept(seq, len(seq.token_ids), len(draft), accepted)
        seq.num_drafted += len(draft)
        seq.num_accepted += accepted
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
        p = seq.params
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
        """The new text of seq since the last output; while running, hold back what may start a stop string."""
        end = len(seq.text)
        if not seq.finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1
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
        """Run prompts as one continuous batch to completion; returns their sequences in order (with n > 1,
        each prompt's samples one after another)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            report = self.step()
            if on_report is not None:
                on_report(report)
        return [self.requests[j] for i in ids for j in (i, *self.requests[i].children)]
