"""ChatSession: one conversation as the app holds it, built from the engine's events alone."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pagechat.core.blockmap import BlockSnapshot
from pagechat.core.events import BlocksChanged, EngineInfo, Finished, FirstToken, Started
from pagechat.core.params import SamplingParams
from pagechat.core.report import DraftRecord, SpecTotals, StepReport
from pagechat.core.sampler import SampleRecord
from pagechat.tui.history import (
    ChatRecord,
    ChatStore,
    model_fingerprint,
    params_from_dict,
    params_to_dict,
    rescue_chat,
    write_atomic,
)
from pagechat.tui.protocol import Event, Refused, SpeculationSet

STEP_HISTORY = 512  # steps kept for the latency sparkline
ROOFLINE_STEPS = 64  # the latest steps the Timing panel's bandwidth and FLOP/s are over
EXPORT_KEY = "Ctrl+O"  # the app's key for writing the chat to a path the user types


def engine_facts(info: EngineInfo, draft: str | None = None) -> dict:
    """What the loaded engine is, as each reply records it: model path and content hash,
    precision, quantisation, device and the speculation proposer (with its draft model)."""
    dtype, _, quant = info.precision.partition(" · ")
    facts = {
        "model": info.model_dir,
        "model_hash": model_fingerprint(info.model_dir),
        "precision": dtype,
        "quant": quant or None,
        "device": str(info.device),
        "proposer": info.proposer,
    }
    if info.proposer:
        facts["speculation"] = {"enabled": info.speculate, "num_draft": info.num_draft}
    if draft:
        facts |= {"draft": draft, "draft_hash": model_fingerprint(draft)}
    return facts


@dataclass(frozen=True, slots=True)
class SaveNote:
    """What the app tells the user when autosave starts failing or works again."""

    text: str
    severity: str  # information | error


@dataclass(slots=True)
class ReplyToken:
    """One sampled token of a reply and the sampler's record of it."""

    token_id: int
    text: str
    record: SampleRecord | None


@dataclass(slots=True)
class TurnTiming:
    """One reply's timing, summed from the engine's StepReports and request timestamps."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # steps that computed prompt tokens (prefill and mixed)
    decode_tokens: int = 0
    decode_s: float = 0.0  # pure decode steps
    output_tokens: int = 0
    total_s: float | None = None  # arrival to finish, when finished

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def wall_decode_tok_s(self) -> float:
        """Tokens after the first over the wall time after the first (all between steps too)."""
        if (
            self.total_s is None
            or self.ttft_s is None
            or self.output_tokens < 2
            or self.total_s <= self.ttft_s
        ):
            return 0.0
        return (self.output_tokens - 1) / (self.total_s - self.ttft_s)

    def as_dict(self) -> dict:
        """Figures saved with the message."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": r(None if self.ttft_s is None else 1000 * self.ttft_s),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tok_s": r(self.prefill_tok_s),
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": r(self.decode_tok_s),
            "ms_per_token": r(self.ms_per_token),
            "wall_decode_tok_s": r(self.wall_decode_tok_s),
            "output_tokens": self.output_tokens,
            "total_ms": r(None if self.total_s is None else 1000 * self.total_s),
        }

    @classmethod
    def from_dict(cls, d: dict) -> TurnTiming:
        """Rebuild the saved figures of a resumed message (rates become step times)."""
        t = cls(
            prompt_tokens=d.get("prompt_tokens", 0),
            cached_tokens=d.get("cached_tokens", 0),
            prefill_tokens=d.get("prefill_tokens", 0),
            decode_tokens=d.get("decode_tokens", 0),
            output_tokens=d.get("output_tokens", 0),
        )
        if d.get("ttft_ms") is not None:
            t.ttft_s = d["ttft_ms"] / 1000
        if d.get("total_ms") is not None:
            t.total_s = d["total_ms"] / 1000
        if d.get("prefill_tok_s"):
            t.prefill_s = t.prefill_tokens / d["prefill_tok_s"]
        if d.get("decode_tok_s"):
            t.decode_s = t.decode_tokens / d["decode_tok_s"]
        return t


@dataclass(slots=True, eq=False)
class Message:
    """A chat message; an assistant message also carries its tokens, records and timing."""

    role: str
    content: str
    tokens: list[ReplyToken] = field(default_factory=list)
    timing: TurnTiming | None = None
    finish_reason: str | None = None
    error: str | None = None
    ticket: int | None = None
    request_id: int | None = None
    streaming: bool = False
    # model, precision, quantisation, speculation and sampling settings this reply was made with
    produced_by: dict | None = None
    saved: dict | None = None  # a resumed message as its file had it: written back as it was
    # n > 1 samples or a beam search: one message per answer; this one takes the kept one's text
    samples: list[Message] = field(default_factory=list)
    picked: int | None = None  # the answer kept (the conversation goes on from it)
    shown: int = 0  # the answer on screen
    beams: bool = False  # the answers are a beam search's hypotheses (known when it ends)

    def by_seq(self) -> dict[int, Message]:
        """This reply's answers by sequence id (the reply itself when it has one answer)."""
        if not self.samples:
            return {} if self.request_id is None else {self.request_id: self}
        return {m.request_id: m for m in self.samples if m.request_id is not None}

    def pick(self, k: int) -> list[int]:
        """Keep answer k: its text becomes this reply's; returns the sequences of the others
        still running (the caller aborts them)."""
        kept = self.samples[k]
        self.picked = self.shown = k
        self.content, self.tokens, self.error = kept.content, kept.tokens, kept.error
        self.finish_reason = kept.finish_reason
        if self.timing is not None and kept.timing is not None:
            self.timing.output_tokens = kept.timing.output_tokens
        others = [m for m in self.samples if m is not kept and m.streaming]
        return [m.request_id for m in others if m.request_id is not None]

    def as_dict(self) -> dict:
        if self.saved is not None and self.saved.get("content") == self.content:
            return dict(self.saved)  # its figures and records stay as first saved, unrounded again
        d = {"role": self.role, "content": self.content}
        if self.role == "assistant":
            d["finish_reason"] = self.finish_reason
            if self.timing is not None:
                d["stats"] = self.timing.as_dict()
            if self.error:
                d["error"] = self.error
            if self.produced_by is not None:
                d["produced_by"] = self.produced_by
            if self.samples:  # the content is the kept answer's; each answer is kept too
                kept = self.shown if self.picked is None else self.picked
                d["content"] = self.samples[kept].content
                each = [a.as_dict() for a in self.samples]
                d["answers"] = {"of": len(self.samples), "kept": self.picked, "each": each}
        return d

    @classmethod
    def from_dict(cls, m: dict) -> Message:
        """A saved message (checked by history.check_message), its answers too."""
        msg = cls(
            m["role"],
            m["content"],
            finish_reason=m.get("finish_reason"),
            error=m.get("error"),
            produced_by=m.get("produced_by"),
            saved=m,
        )
        if m.get("stats"):
            msg.timing = TurnTiming.from_dict(m["stats"])
        answers = m.get("answers") or {}
        msg.samples = [cls.from_dict(a) for a in answers.get("each", ())]
        if msg.samples:
            msg.picked = answers.get("kept")
            msg.shown = msg.picked or 0
        return msg


def _end(m: Message, ev: Finished) -> None:
    """A message's answer ended, with the engine's reason and timestamps."""
    m.streaming = False
    m.finish_reason, m.error = ev.reason, ev.error
    t = m.timing = m.timing or TurnTiming()
    t.ttft_s, t.total_s = t.ttft_s or ev.ttft_s, ev.total_s
    t.output_tokens, t.cached_tokens = ev.output_tokens, ev.cached_tokens


class ChatSession:
    """Messages, replies in flight and step timing of one chat; applies engine events in order."""

    def __init__(
        self, record: ChatRecord, params: SamplingParams, engine: dict | None = None
    ) -> None:
        """`engine`: engine_facts() of the engine that will make this chat's replies."""
        self.record = record
        self._params = params_from_dict(record.params, params) if record.params else params
        self.engine = engine or {}
        spec = self.engine.get("speculation")  # as the engine loaded; SpeculationSet changes it
        self.drafting = (spec["enabled"], spec["num_draft"]) if spec else None
        self.save_error: str | None = None  # why the latest autosave failed; None once it works
        self.saved = False  # the chats folder holds the latest autosave
        self.rescued: Path | None = None  # where the chat went when its folder could not take it
        self.messages = [Message.from_dict(m) for m in record.messages]
        self.steps: deque[tuple[str, float]] = deque(maxlen=STEP_HISTORY)  # (kind, elapsed_s)
        # the latest steps' (kind, elapsed_s, batch): what they read and computed (core/roofline)
        self.work: deque[tuple[str, float, tuple]] = deque(maxlen=ROOFLINE_STEPS)
        # the engine's DraftRecords (speculation), newest last
        self.drafts: deque[DraftRecord] = deque(maxlen=STEP_HISTORY)
        # each sequence's speculation totals after its latest verify step, as the engine summed them
        self.spec_totals: dict[int, SpecTotals] = {}
        self.wall = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}  # step time by kind, this chat
        self.grammar = [0.0, 0]  # grammar masks: seconds, and steps that computed any
        self.latest: StepReport | None = None
        self.blocks: BlockSnapshot | None = None  # the newest BlockManager snapshot the engine sent
        self.latest_sample: SampleRecord | None = None  # the newest of the chat's own tokens
        self.latest_any: SampleRecord | None = None  # the newest any request sampled
        self._next_ticket = 0
        self.context_from = 0  # messages before this one are out of the model's context
        self.context_tokens = 0  # the prompt tokens of the latest reply (its context before it)
        self._sent: list[int] = []  # the messages the latest conversation() gave, by index

    # -- what the UI asks --------------------------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        """The settings of the next request (and of the reply in flight from its next token)."""
        return self._params

    @params.setter
    def params(self, p: SamplingParams) -> None:
        if params_to_dict(p) != params_to_dict(self._params):
            self._record_change(params=params_to_dict(p))
        self._params = p

    @property
    def system(self) -> str:
        return self.record.system

    @system.setter
    def system(self, text: str) -> None:
        self.record.system = text

    @property
    def streaming(self) -> Message | None:
        """The assistant message being generated, if any."""
        last = self.messages[-1] if self.messages else None
        return last if last is not None and last.streaming else None

    def conversation(self) -> list[dict]:
        """Role/content messages for the chat template: the system prompt, then each non-empty
        message still in the context."""
        msgs = [{"role": "system", "content": self.system}] if self.system.strip() else []
        self._sent = []
        for i, m in enumerate(self.messages[self.context_from :], self.context_from):
            after = self.messages[i + 1] if i + 1 < len(self.messages) else None
            if after is not None and after.error is not None:
                # the engine refused this turn: leave it out, or every later turn fails the same way
                continue
            if m.content and not m.streaming and m.error is None:
                msgs.append({"role": m.role, "content": m.content})
                self._sent.append(i)
        return msgs

    def context_used(self) -> int:
        """Tokens of the context the chat fills: the latest reply's prompt and its tokens."""
        last = self.messages[-1] if self.messages else None
        made = 0 if last is None or last.role != "assistant" else len(last.tokens)
        return self.context_tokens + made

    def speculation(self) -> SpecTotals:
        """The speculation of every sequence of this chat, added up."""
        return sum(self.spec_totals.values(), SpecTotals())

    def turns(self) -> list[Message]:
        """Assistant messages that have timing, oldest first."""
        return [m for m in self.messages if m.role == "assistant" and m.timing is not None]

    # -- changes from the UI -----------------------------------------------------------------------
    def add_user(self, text: str) -> Message:
        """Append the user's message and an empty reply for the engine; returns the reply."""
        self.messages.append(Message("user", text))
        reply = self._new_reply()
        self.messages.append(reply)
        return reply

    def last_failed(self) -> Message | None:
        """The last message, if it is a reply that failed."""
        last = self.messages[-1] if self.messages else None
        failed = last is not None and last.role == "assistant" and last.error is not None
        return last if failed and not last.streaming else None

    def retry(self) -> tuple[Message, Message]:
        """(a new reply, the failed last one it replaces); the caller checked last_failed()."""
        failed = self.last_failed()
        assert failed is not None
        self.messages[-1] = reply = self._new_reply()
        return reply, failed

    def fail_streaming(self, why: str) -> Message | None:
        """End the reply in flight, and each of its answers still running, as failed."""
        msg = self.streaming
        if msg is not None:
            for m in (msg, *msg.samples):
                if m.streaming:
                    m.streaming, m.finish_reason, m.error = False, "error", why
        return msg

    def _new_reply(self) -> Message:
        """An empty reply to the last user message, with a ticket for the engine."""
        self._next_ticket += 1
        reply = Message(
            "assistant",
            "",
            ticket=self._next_ticket,
            streaming=True,
            timing=TurnTiming(),
            produced_by=self.producer(),
        )
        answers = max(self.params.n, self.params.beam_width)
        if answers > 1:  # the answers stream apart; the reply takes the one the user keeps
            reply.samples = [Message("assistant", "", streaming=True) for _ in range(answers)]
            reply.beams = self.params.beam_width > 1
        return reply

    def producer(self) -> dict:
        """What the next reply is made with: the engine's facts, speculation and sampling."""
        made = dict(self.engine)
        if self.drafting is not None:
            made["speculation"] = {"enabled": self.drafting[0], "num_draft": self.drafting[1]}
        made["params"] = params_to_dict(self.params)
        return made

    def next_chat(self, model: str) -> ChatSession:
        """A new, empty chat on the same engine: same system prompt, settings and speculation; the
        engine's latest records carry over to the panels."""
        new = ChatSession(ChatRecord(model=model, system=self.system), self.params, self.engine)
        new.drafting, new.latest, new.blocks = self.drafting, self.latest, self.blocks
        return new

    def _record_change(self, **change) -> None:
        """Note a setting changed while a reply streams, and from which of its tokens."""
        msg = self.streaming
        if msg is not None and msg.produced_by is not None:
            at = {"at_token": len(msg.tokens)}
            msg.produced_by.setdefault("changes", []).append(at | change)

    def branch(
        self, source: Message, given: list[ReplyToken], at: int | None, params: SamplingParams
    ) -> tuple[Message, list[dict], tuple[int, ...]]:
        """Another answer to the last turn, with the settings now: the `given` tokens (`source`'s
        first tokens, then another candidate in place of its token `at`; none: the turn asked
        again), then what the engine makes after them with `params`. Returns the new answer
        (streaming), the conversation before the turn and the given token ids."""
        reply = self.messages[-1]
        if not reply.samples:  # the reply becomes its first answer
            first = Message("assistant", reply.content, reply.tokens, reply.timing)
            first.finish_reason, first.error = reply.finish_reason, reply.error
            first.request_id, first.produced_by = reply.request_id, reply.produced_by
            reply.samples = [first]
        self._next_ticket += 1
        made = self.producer()
        made["params"] = params_to_dict(params)
        of = reply.samples.index(source) + 1 if source in reply.samples else 1
        made["branch"] = {"again": True} if at is None else {"of": of, "at_token": at}
        text = "".join(t.text for t in given)
        answer = Message("assistant", text, list(given), TurnTiming(), streaming=True)
        answer.ticket, answer.produced_by = self._next_ticket, made
        reply.samples.append(answer)
        reply.shown, reply.picked, reply.streaming = len(reply.samples) - 1, None, True
        return answer, self.conversation(), tuple(t.token_id for t in given)

    def to_record(self) -> ChatRecord:
        """The persisted form: finished messages (a crash loses the reply in flight alone)."""
        self.record.params = params_to_dict(self.params)
        self.record.messages = [m.as_dict() for m in self.messages if not m.streaming]
        return self.record

    def save(self, store: ChatStore, extra: Path | None = None) -> SaveNote | None:
        """Autosave to the store (and `extra`, for --save). When the store cannot take it, a copy
        goes to the current or temporary folder and the chat stays in memory. Returns a note when
        saving starts failing, fails differently, or works again; else None."""
        record = self.to_record()
        before, errors, path = self.save_error, [], store.path(record.id)
        try:
            store.save(record)
            self.saved = True
        except OSError as e:
            self.saved = False
            self.rescued = rescue_chat(record)
            kept = f"; a copy is in {self.rescued}" if self.rescued else ""
            errors.append(f"chat NOT saved to {e.filename}: {e.strerror}{kept}")
        if extra is not None:
            try:
                write_atomic(extra, record.to_json())
            except OSError as e:
                errors.append(f"chat NOT saved to --save {e.filename}: {e.strerror}")
        self.save_error = "; ".join(errors) or None
        if self.save_error == before:
            return None
        if self.save_error is None:
            return SaveNote(f"chat saved again in {path}", "information")
        return SaveNote(
            f"{self.save_error}. It stays in memory: {EXPORT_KEY} writes it to a path you type",
            "error",
        )

    # -- engine events -----------------------------------------------------------------------------
    def _by_ticket(self, ticket: int | None) -> Message | None:
        """The reply (or branch: an answer of a reply) that ticket asked for."""
        for m in reversed(self.messages):
            for answer in (m, *m.samples):
                if answer.ticket == ticket and ticket is not None:
                    return answer
        return None

    def _answer(self, rid: int) -> tuple[Message | None, Message | None]:
        """(the reply, the answer of sequence rid): the reply itself, or one of its samples."""
        for m in reversed(self.messages):
            answer = m.by_seq().get(rid)
            if answer is not None:
                return m, answer
        return None, None

    def apply(self, ev: Event) -> Message | None:
        """Apply one engine event; returns the message it changed, if any."""
        if isinstance(ev, StepReport):
            return self._apply_report(ev)
        if isinstance(ev, Started):
            msg = self._by_ticket(ev.ticket)
            if msg is not None:
                msg.request_id = ev.request_id
                msg.timing.prompt_tokens = self.context_tokens = ev.prompt_tokens
                if ev.dropped:  # the first message kept; the next turns start there too
                    self.context_from = self._sent[ev.dropped]
                if msg.samples:
                    msg.samples[0].request_id = ev.request_id
            return msg
        if isinstance(ev, FirstToken):
            msg, _ = self._answer(ev.request_id)
            if msg is not None and msg.timing.ttft_s is None:
                msg.timing.ttft_s = ev.ttft_s
            return msg
        if isinstance(ev, Finished):
            return self._finished(ev)
        if isinstance(ev, Refused):
            msg = self._by_ticket(ev.ticket)
            if msg is not None:
                msg.streaming, msg.finish_reason, msg.error = False, "error", ev.message
                msg = next((m for m in self.messages if msg in m.samples), msg)  # a branch's reply
                msg.streaming = any(a.streaming for a in msg.samples)
            return msg
        if isinstance(ev, BlocksChanged):
            self.blocks = ev.snapshot
        if isinstance(ev, SpeculationSet):
            if self.drafting != (ev.enabled, ev.num_draft):
                self._record_change(speculation={"enabled": ev.enabled, "num_draft": ev.num_draft})
            self.drafting = (ev.enabled, ev.num_draft)
        return None

    def _finished(self, ev: Finished) -> Message | None:
        """An answer ended; the reply ends with its last answer. A beam search's answers are its
        hypotheses, known only now."""
        msg, answer = self._answer(ev.request_id)
        if msg is None:
            return None
        _end(answer, ev)
        if ev.beams:
            del msg.samples[len(ev.beams) :]
            for m, beam in zip(msg.samples, ev.beams):
                m.content, m.streaming = beam.text, False
                m.finish_reason = f"score {beam.score:.3f}"
                m.timing = TurnTiming(output_tokens=len(beam.token_ids))
        if msg is not answer and not any(a.streaming for a in msg.samples):
            _end(msg, ev)
        if msg.samples and msg.picked is None:
            msg.finish_reason = None  # not ended until an answer is kept
        elif msg.picked is not None and msg.samples[msg.picked] is answer:
            msg.pick(msg.picked)
        return msg

    def _name_answers(self, msg: Message, seqs) -> None:
        """Give each sample (or beam) of the reply its sequence, from the scheduler's records."""
        for rec in seqs:
            if rec.request_id == msg.request_id and rec.role == "sample" and rec.index:
                if rec.index < len(msg.samples) and msg.samples[rec.index].request_id is None:
                    msg.samples[rec.index].request_id = rec.seq_id

    def _apply_report(self, r: StepReport) -> Message | None:
        self.latest, self.blocks = r, r.blocks
        if r.kind == "idle":
            return None
        self.steps.append((r.kind, r.elapsed_s))
        self.work.append((r.kind, r.elapsed_s, r.batch))
        self.wall[r.kind] += r.elapsed_s
        if r.grammar_s:
            self.grammar[0] += r.grammar_s
            self.grammar[1] += 1
        self.drafts.extend(r.drafts)
        for d in r.drafts:
            self.spec_totals[d.seq_id] = d.totals
        if r.samples:
            self.latest_any = r.samples[-1]
        msg = self.streaming
        if msg is None or msg.request_id is None:
            return None
        if msg.samples:
            self._name_answers(msg, r.seqs)
        answers = msg.by_seq()
        mine = {msg.request_id, *answers}  # its requests (a branch too), their samples and beams
        mine |= {s.seq_id for s in r.seqs if s.request_id in mine}
        self._count_work(msg.timing, r, mine)
        for s in r.samples:
            answer = answers.get(s.seq_id)
            if answer is not None:
                chosen = next((c.text for c in s.candidates if c.chosen), "")
                answer.tokens.append(ReplyToken(s.token_id, chosen, s))
                self.latest_sample = s
        for out in r.outputs:
            answer = answers.get(out.request_id)
            if answer is not None:
                answer.content += out.text_delta
        return msg

    @staticmethod
    def _count_work(t: TurnTiming, r: StepReport, seqs: set[int]) -> None:
        """The reply's own tokens of the step (other requests may share it: background load),
        and the step's time as prefill or decode time by what the reply's sequences (its
        samples or beams too) did."""
        mine = [b for b in r.batch if b.seq_id in seqs]
        if r.batch and not mine:
            return
        decode = sum(b.tokens for b in mine if b.kind == "decode") if mine else r.decode_tokens
        prefill = sum(b.tokens for b in mine if b.kind == "prefill") if mine else r.prefill_tokens
        if not prefill:
            t.decode_tokens += decode
            t.decode_s += r.elapsed_s
        else:
            t.prefill_tokens += prefill
            t.prefill_s += r.elapsed_s
