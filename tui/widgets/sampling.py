"""Sampling panel: the sampler's recorded candidates for the newest or a selected token, and
the params in force."""

from __future__ import annotations

from collections.abc import Mapping

from pagechat.core.params import SamplingParams
from pagechat.core.sampler import Candidate, SampleRecord
from pagechat.tui.widgets.panel import Panel, Readout
from rich.text import Text
from textual.app import ComposeResult


def token_label(text: str, width: int = 12) -> str:
    """A token's text made visible: escapes for whitespace and control characters, cut to width."""
    shown = repr(text)[1:-1].replace(" ", "␣") if text else "∅"
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def params_line(p: SamplingParams) -> Text:
    """Compact settings: T, top-p, top-k, min-p, repetition penalty (when on), seed, max tokens."""
    t = Text()
    items = [
        ("T", f"{p.temperature:g}" + (" greedy" if p.greedy else "")),
        ("top-p", f"{p.top_p:g}"),
        ("top-k", str(p.top_k or "off")),
        ("min-p", f"{p.min_p:g}"),
    ]
    if p.repetition_penalty != 1:
        items.append(("rep", f"{p.repetition_penalty:g}"))
    items += [("seed", "rand" if p.seed is None else str(p.seed)), ("max", str(p.max_tokens))]
    if p.constraint is not None:
        items.append(("grammar", p.constraint.label))
    for i, (name, value) in enumerate(items):
        t.append(("" if not i else " ") + f"{name}=", "dim").append(value, "bold")
    return t


def candidate_row(c: Candidate, bar_width: int, colours: Mapping[str, str]) -> Text:
    """One candidate: mark, text, logit, prob, cumulative prob, bar, kept or cut-by."""
    mark = "▶" if c.chosen else " "
    status = "kept" if c.kept else f"cut {c.cut_by}" if c.cut_by else "cut"
    style = f"bold {colours['pc-good']}" if c.chosen else "" if c.kept else colours["pc-muted"]
    line = Text(
        f"{mark} {token_label(c.text):<12} {c.logit:>6.2f} {c.prob:>6.3f} {c.cum_prob:>6.3f} ",
        style=style,
    )
    if bar_width > 0:
        n = round(bar_width * c.prob)
        bar = colours["pc-accent" if c.kept else "pc-faint"]
        line.append("█" * n + "·" * (bar_width - n), bar).append(" ")
    line.append(status, colours["pc-good" if c.kept else "pc-bad"])
    return line


HEADER = f"  {'token':<12} {'logit':>6} {'prob':>6} {'cum':>6} "


class SamplingPanel(Panel):
    """Shows one SampleRecord exactly as the sampler recorded it."""

    TITLE = "Sampling"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record: SampleRecord | None = None
        self.where = ""

    def compose(self) -> ComposeResult:
        yield Readout(id="sampling-title")
        yield Readout(id="sampling-params")
        yield Readout(id="sampling-table")
        yield Readout(id="sampling-current")

    def show(self, record: SampleRecord | None, where: str, current: SamplingParams) -> None:
        """Render `record` (the token `where` describes) beside the current params."""
        self.record, self.where = record, where
        colours = self.app.theme_variables
        width = self.content_size.width or 60
        bar = max(0, min(10, width - len(HEADER) - 12))
        title = Text().append(where or "no token sampled yet", "bold")
        if record is not None:
            title.append(f" · id {record.token_id}", "dim")
        self.set_text("#sampling-title", title)
        if record is None:
            self.set_text(
                "#sampling-params",
                Text().append("send a prompt: each sampled token's candidates appear here", "dim"),
            )
            self.set_text("#sampling-table", "")
        else:
            line = Text().append("in force ", "dim") + params_line(record.params)
            if record.allowed is not None:  # a constrained token: what its grammar let through
                line.append("\ngrammar ", "dim").append(f"allowed {record.allowed} tokens", "bold")
                line.append(f" · {record.where}" if record.where else "", "dim")
            self.set_text("#sampling-params", line)
            table = Text().append(
                HEADER + ("bar".ljust(bar) + " " if bar else "") + "filter",
                f"bold {colours['pc-muted']}",
            )
            for c in record.candidates:
                table.append("\n").append_text(candidate_row(c, bar, colours))
            if not record.candidates:
                table.append("\n  no candidates recorded (num_candidates = 0)", "dim")
            self.set_text("#sampling-table", table)
        self.set_text("#sampling-current", Text().append("current  ", "dim") + params_line(current))
