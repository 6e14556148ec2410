"""Scheduler panel: every sequence the engine holds (what it is, its state, tokens, blocks held and
shared, preemptions) and the batch each recent step ran, from the StepReports' own records."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pagechat.core.report import BatchItem, SeqRecord, StepReport, SwapRecord
from pagechat.tui.widgets.blocks import owner_colour
from pagechat.tui.widgets.panel import Panel, Readout
from rich.text import Text
from textual.app import ComposeResult

ENDED_KEPT = 6  # finished sequences listed after the live ones, newest first
STEPS_KEPT = 8  # recent steps whose batch is listed
LABELS_KEPT = 1024  # request names: those listed, and the newest others (a watched server's many)
STATE_COLOURS = {  # theme variables
    "running": "pc-good",
    "waiting": "pc-muted",
    "preempted": "pc-warn",
    "swapped": "pc-other",
    "finished": "pc-faint",
}


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step as the panel lists it: its number, kind, batch, budget and what it preempted."""

    step: int
    kind: str
    batch: tuple[BatchItem, ...]
    budget: int
    preempted: tuple[int, ...]
    swaps: tuple[SwapRecord, ...]


class SchedulerLog:
    """The scheduler's records as the app keeps them: the newest list of sequences, those that
    ended lately, the last steps' batches, and what each request is (chat reply, load k)."""

    def __init__(self) -> None:
        self.live: tuple[SeqRecord, ...] = ()
        self.ended: deque[SeqRecord] = deque(maxlen=ENDED_KEPT)
        self.steps: deque[StepBatch] = deque(maxlen=STEPS_KEPT)
        self.labels: dict[int, str] = {}  # request id -> what asked for it
        self.preemptions = 0

    def label(self, request_id: int, what: str) -> None:
        """Name a request (its samples and beams are named after it). Past LABELS_KEPT names,
        the oldest of those no longer listed are forgotten."""
        self.labels[request_id] = what
        extra = len(self.labels) - LABELS_KEPT
        if extra > 0:
            listed = {s.request_id for s in (*self.live, *self.ended)}
            for rid in [r for r in self.labels if r not in listed][:extra]:
                del self.labels[rid]

    def apply_seqs(self, seqs: tuple[SeqRecord, ...]) -> None:
        """A new list of sequences, from a step or from a command that changed the pool."""
        self.live = tuple(s for s in seqs if s.state != "finished")
        self.ended.extendleft(s for s in seqs if s.state == "finished")

    def apply(self, r: StepReport) -> None:
        self.apply_seqs(r.seqs)
        self.preemptions += len(r.preempted)
        if r.batch or r.preempted or r.swaps:
            self.steps.appendleft(
                StepBatch(r.step, r.kind, r.batch, r.token_budget, r.preempted, r.swaps)
            )

    def name(self, seq_id: int) -> str:
        """What a sequence is ('load 3 s2'), found among those listed; else 'seq N'."""
        for s in (*self.live, *self.ended):
            if s.seq_id == seq_id:
                return self.what(s)
        return f"seq {seq_id}"

    def what(self, s: SeqRecord) -> str:
        """'chat', 'chat s2' (sample 2), 'load 3 b1' (beam 1): the request's name and the
        sequence's role in it."""
        base = self.labels.get(s.request_id, f"req {s.request_id}")
        if s.role == "request":
            return base
        return f"{base} {s.role[0]}{s.index + 1}"


# seq, what, state, tokens (prompt+output), blocks held, of them shared, preemptions
HEAD = f"{'seq':>3}   {'what':<10} {'state':<9} {'tokens':>7} {'blk':>3} {'shr':>3} {'pre':>3}"


def seq_row(log: SchedulerLog, s: SeqRecord, colours: Mapping[str, str]) -> Text:
    """One sequence: its id and swatch in its block colour, what it is, state and counts."""
    done = s.state == "finished"
    colour = colours[owner_colour(s.seq_id)]
    t = Text().append(f"{s.seq_id:>3} ", "dim" if done else f"bold {colour}")
    t.append("  " if done else "■ ", colour)
    t.append(f"{log.what(s)[:10]:<10} ", "dim" if done else "")
    state = (s.finish_reason or s.state) if done else s.state
    t.append(f"{state:<9.9}", colours[STATE_COLOURS[s.state]])
    tokens = f"{s.prompt_tokens}+{s.output_tokens}"
    t.append(f" {tokens:>7} {s.blocks:>3} {s.shared:>3}", "dim" if done else "")
    return t.append(f" {s.preemptions:>3}", colours["pc-warn"] if s.preemptions else "dim")


def seq_table(log: SchedulerLog, colours: Mapping[str, str], limit: int) -> Text:
    """A row per live sequence (the chat's first), then the ones that ended lately (dimmed),
    `limit` rows at most."""
    t = Text(HEAD, f"bold {colours['pc-muted']}")
    chat = [s for s in log.live if log.what(s).startswith("chat")]  # the user's own first
    rows = [*chat, *(s for s in log.live if s not in chat), *log.ended]
    if not rows:
        return t.append("\n  no sequences yet", "dim")
    shown = rows if len(rows) <= limit else rows[: limit - 1]
    for s in shown:
        t.append("\n").append_text(seq_row(log, s, colours))
    if len(shown) < len(rows):
        t.append(f"\n  … {len(rows) - len(shown)} more", "dim")
    return t


def counts(log: SchedulerLog, colours: Mapping[str, str]) -> Text:
    """How many sequences are in each live state."""
    t = Text()
    names = {"running": "run", "waiting": "wait", "preempted": "preempted", "swapped": "swapped"}
    for i, (state, name) in enumerate(names.items()):
        n = sum(s.state == state for s in log.live)
        t.append(f"{' · ' if i else ''}{name} ", "dim")
        t.append(str(n), f"bold {colours[STATE_COLOURS[state]]}")
    return t


def batch_line(b: StepBatch, colours: Mapping[str, str], width: int) -> Text:
    """One step: its kind, the budget it used, then each sequence's share (P a prompt chunk, D a
    decode, +k draft slots), then what it preempted or swapped; cut to `width`."""
    used = sum(i.tokens + i.reserved for i in b.batch)
    t = Text().append(f"{b.step:>5} ", "dim").append(f"{b.kind[:3]} ", "bold")
    t.append(f"{used:>3}/{b.budget:<4}", "dim")
    for i in b.batch:
        t.append(f" {i.seq_id}", colours[owner_colour(i.seq_id)])
        if i.kind == "prefill":
            end = i.start + i.tokens
            chunk = "" if i.start == 0 and end == i.total else f"[{i.start}:{end}]"
            t.append(f":P{i.tokens}{chunk}", colours["pc-warn"])
        else:
            t.append(f":D{i.tokens}", colours["pc-accent"])
        if i.reserved:
            t.append(f"+{i.reserved}", "dim")
    for seq in b.preempted:
        t.append(f" ⇣{seq}", f"bold {colours['pc-bad']}")
    for s in b.swaps:
        t.append(f" {'⇡' if s.direction == 'in' else '⇣'}{s.seq_id}swap", colours["pc-other"])
    t.truncate(width, overflow="ellipsis")
    return t


def steps_text(log: SchedulerLog, colours: Mapping[str, str], limit: int, width: int) -> Text:
    t = Text("\n step     tok/budget  seq:P prompt / D decode", "dim")
    if log.preemptions:
        t.append(f" ({log.preemptions})", colours["pc-warn"])
    if not log.steps:
        return t.append("\n  no steps yet", "dim")
    for b in list(log.steps)[:limit]:
        t.append("\n").append_text(batch_line(b, colours, width))
    return t


class SchedulerPanel(Panel):
    """Counts by state, a row per sequence, and the recent steps' batches."""

    TITLE = "Scheduler"

    def compose(self) -> ComposeResult:
        yield Readout(id="sched-counts")
        yield Readout(id="sched-seqs")
        yield Readout(id="sched-steps")

    def show(self, log: SchedulerLog) -> None:
        colours = self.app.theme_variables
        rows = max(6, self.content_size.height - 4)  # counts, two headers and a gap
        steps = min(STEPS_KEPT, max(2, rows // 3))
        width = max(20, self.content_size.width)
        self.set_text("#sched-counts", counts(log, colours))
        self.set_text("#sched-seqs", seq_table(log, colours, rows - steps))
        self.set_text("#sched-steps", steps_text(log, colours, steps, width))
