"""Speculation panel: the engine's DraftRecords — drafted tokens accepted / rejected, the bonus token — and acceptance figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    """One verify step: each drafted token marked, then the target's own token (bonus or correction)."""
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


def summary(records: Sequence, k: int) -> Text:
    """Acceptance rate, mean accepted per step, per-position acceptance, target forwards per output token."""
    steps = [d for d in records if d.drafted]
    drafted = sum(len(d.drafted) for d in steps)
    accepted = sum(d.accepted for d in steps)
    emitted = sum(len(d.emitted) for d in records)
    t = Text()
    t.append("acceptance ", "dim").append(
        f"{100 * accepted / drafted:.0f}%" if drafted else "—", "bold"
    )
    t.append(" · mean accepted ", "dim").append(
        f"{accepted / len(steps):.2f}" if steps else "—", "bold"
    )
    t.append("\nforwards/token ", "dim").append(
        f"{len(records) / emitted:.2f}" if emitted else "—", "bold"
    )
    t.append(f" ({len(records)} fwd, {emitted} tok)" if emitted else "", "dim")
    t.append("\nper position", "dim")
    for pos in range(k):
        tried = [d for d in steps if len(d.drafted) > pos]
        rate = sum(1 for d in tried if d.accepted > pos) / len(tried) if tried else None
        t.append(f" {pos + 1}:", "dim").append(
            "—" if rate is None else f"{100 * rate:.0f}%", "bold"
        )
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

    def show(self, on: bool, why: str, records: Sequence, k: int) -> None:
        """State line, figures over `records` (the engine's DraftRecords, newest last) and the recent steps."""
        colours = self.app.theme_variables
        state = Text().append(
            "on" if on else "off", f"bold {colours['pc-good' if on else 'pc-warn']}"
        )
        self.set_text("#spec-state", state.append(f"  {why}", "dim"))
        self.set_text("#spec-summary", summary(records, k))
        lines = Text().append("recent steps  ", "dim").append_text(legend(colours))
        rows = max(1, self.content_size.height - 7)
        recent = list(records)[-rows:]
        for d in recent:
            lines.append("\n").append_text(step_line(d, colours))
        if not recent:
            lines.append("\n  (none yet)", "dim")
        self.set_text("#spec-steps", lines)
