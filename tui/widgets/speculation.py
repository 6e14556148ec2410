"""Speculation panel: the engine's DraftRecords — drafted tokens accepted / rejected, the bonus
token — and acceptance figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagechat.core.report import SpecTotals
from pagechat.tui.widgets.panel import Panel, Readout
from pagechat.tui.widgets.sampling import token_label
from rich.text import Text
from textual.app import ComposeResult

MARKS = {  # (mark, theme variable of its colour)
    "accepted": ("✓", "pc-good"),
    "rejected": ("✗", "pc-bad"),
    "bonus": ("+", "pc-note"),
    "correction": ("→", "pc-accent"),
}


def step_line(d, colours: Mapping[str, str]) -> Text:
    """One verify step: each drafted token marked, then the target's own (bonus or correction)."""
    t = Text()
    if not d.drafted:
        t.append("(no draft) ", "dim")
    for i, text in enumerate(d.drafted_text):
        mark, colour = MARKS["accepted" if i < d.accepted else "rejected"]
        t.append(f"{mark}{token_label(text, 8)} ", colours[colour])
    if len(d.emitted) > d.accepted:
        mark, colour = MARKS["bonus" if d.bonus else "correction"]
        t.append(f"{mark}{token_label(d.emitted_text[-1], 8)}", colours[colour])
    return t


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{100 * rate:.0f}%"


def summary(totals: SpecTotals, k: int) -> Text:
    """Acceptance rate, mean accepted per step, per-position acceptance and target forwards per
    output token, as the engine summed them (SpecTotals)."""
    mean, per_token = totals.mean_accepted, totals.forwards_per_token
    t = Text()
    t.append("acceptance ", "dim").append(percent(totals.acceptance_rate), "bold")
    t.append(" · mean accepted ", "dim").append("—" if mean is None else f"{mean:.2f}", "bold")
    t.append("\nforwards/token ", "dim")
    t.append("—" if per_token is None else f"{per_token:.2f}", "bold")
    if totals.emitted:
        t.append(f" ({totals.steps} fwd, {totals.emitted} tok)", "dim")
    t.append("\nper position", "dim")
    for pos in range(k):
        t.append(f" {pos + 1}:", "dim").append(percent(totals.position_rate(pos)), "bold")
    return t


def legend(colours: Mapping[str, str]) -> Text:
    t = Text()
    for name, (mark, colour) in MARKS.items():
        t.append(f"{mark}", colours[colour]).append(f"{name} ", "dim")
    return t


class SpeculationPanel(Panel):
    """Draft acceptance of recent steps, or "off" and why."""

    TITLE = "Speculation"

    def compose(self) -> ComposeResult:
        yield Readout(id="spec-state")
        yield Readout(id="spec-summary")
        yield Readout(id="spec-steps")

    def show(self, on: bool, why: str, totals: SpecTotals, records: Sequence, k: int) -> None:
        """State line, the chat's totals and the recent steps (`records`: the engine's
        DraftRecords, newest last)."""
        colours = self.app.theme_variables
        state = Text().append(
            "on" if on else "off", f"bold {colours['pc-good' if on else 'pc-warn']}"
        )
        self.set_text("#spec-state", state.append(f"  {why}", "dim"))
        self.set_text("#spec-summary", summary(totals, k))
        lines = Text().append("recent steps  ", "dim").append_text(legend(colours))
        rows = max(1, self.content_size.height - 7)
        recent = list(records)[-rows:]
        for d in recent:
            lines.append("\n").append_text(step_line(d, colours))
        if not recent:
            lines.append("\n  (none yet)", "dim")
        self.set_text("#spec-steps", lines)
