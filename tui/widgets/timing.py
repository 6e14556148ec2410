"""Timing panel: per-turn TTFT / prefill / decode figures, a per-step latency sparkline, the
wall-time split, and what bounds the latest steps (core/roofline.py: decode's read speed against
the memory's, prefill's FLOP/s against the matmul peak)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagechat.core.events import EngineInfo
from pagechat.core.roofline import step_rates
from pagechat.tui.session import ChatSession, TurnTiming
from pagechat.tui.widgets.panel import Panel, Readout
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult

KIND_COLOURS = {"prefill": "pc-warn", "decode": "pc-accent", "mixed": "pc-other"}  # theme variables
BARS = " ▁▂▃▄▅▆▇█"


def scale_top(values: Sequence[float]) -> float:
    """The bars' full scale: the max, unless a few outliers (a long prefill) would flatten the
    rest."""
    if not values:
        return 1.0
    ordered = sorted(values)
    typical = ordered[int(0.9 * (len(ordered) - 1))]
    return min(ordered[-1], 2 * typical) or ordered[-1] or 1.0


def sparkline(
    steps: Sequence[tuple[str, float]], width: int, colours: Mapping[str, str], height: int = 2
) -> Text:
    """The last `width` steps as bars `height` rows tall, coloured by step kind; outliers are
    clipped."""
    steps = list(steps)[-width:]
    top = scale_top([s for _, s in steps])
    rows, colour = [], {kind: colours[v] for kind, v in KIND_COLOURS.items()}
    for r in range(height - 1, -1, -1):  # top row first
        line = Text()
        for kind, s in steps:
            level = round(min(s, top) / top * 8 * height)  # eighths of a row, over all rows
            part = min(8, max(0, level - 8 * r))
            clipped = s > top and r == height - 1
            line.append("▲" if clipped else BARS[part] if part else " ", colour.get(kind, "white"))
        rows.append(line)
    return Text("\n").join(rows)


def split_bar(wall: dict[str, float], width: int, colours: Mapping[str, str]) -> Text:
    """Wall time by step kind as one bar plus percentages."""
    total = sum(wall.values())
    t = Text().append("wall time by step kind\n", "dim")
    if not total:
        return t.append("no steps yet", "dim")
    used = 0
    for kind, s in wall.items():
        n = round(width * s / total) if kind != "mixed" else width - used
        used += n
        t.append("█" * n, colours[KIND_COLOURS[kind]])
    t.append("\n")
    for kind, s in wall.items():
        t.append("■", colours[KIND_COLOURS[kind]]).append(
            f"{kind} {100 * s / total:.0f}% {s:.2f}s ", "dim"
        )
    return t


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None or value == 0 else format(value, fmt)


COLUMNS = (
    ("#", 2),
    ("TTFTms", 6),
    ("prefill", 7),
    ("tok/s", 6),
    ("decode", 6),
    ("ms/tok", 6),
    ("tok/s", 6),
)


def turn_row(i: int, t: TurnTiming, live: str | None) -> Text:
    """One turn's figures; live: the row's style while its reply streams."""
    cells = [
        ("▶" if live else "") + str(i),
        _num(None if t.ttft_s is None else 1000 * t.ttft_s, ".0f"),
        str(t.prefill_tokens),
        _num(t.prefill_tok_s, ".0f"),
        str(t.decode_tokens),
        _num(t.ms_per_token, ".1f"),
        _num(t.decode_tok_s, ".1f"),
    ]
    return Text(
        " ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS)),
        style=live or "",
    )


def roofline_use(session: ChatSession, info: EngineInfo) -> Text:
    """What bounds the latest steps: decode's bytes a second against the memory's measured read
    speed (MBU), prefill's FLOP/s against the measured matmul peak."""
    read, computed = step_rates(session.work, info.memory)
    roof = info.roofline
    t = Text("decode reads ", "dim")
    if read is None:
        t.append("—", "dim")
    else:
        t.append(f"{read / 1e9:.1f} GB/s", "bold").append(f" of {roof.bandwidth / 1e9:.1f}", "dim")
        t.append(f" ({100 * read / roof.bandwidth:.0f}% MBU)", "bold")
    t.append(" · prefill ", "dim")
    if computed is None:
        t.append("—", "dim")
    else:
        t.append(f"{computed / 1e9:.0f} GFLOP/s", "bold")
        t.append(f" of {roof.peak_flops / 1e9:.0f} peak", "dim")
        t.append(f" ({100 * computed / roof.peak_flops:.0f}%)", "bold")
    return t


class TimingPanel(Panel):
    """Current and past turns from the engine's StepReports and request timestamps."""

    TITLE = "Timing"

    def compose(self) -> ComposeResult:
        yield Readout(id="timing-table")
        yield Readout(id="timing-spark-title")
        yield Readout(id="timing-spark")
        yield Readout(id="timing-split")
        yield Readout(id="timing-roof")

    def show(self, session: ChatSession, info: EngineInfo) -> None:
        """Render the session's turns and step log."""
        width = max(10, self.content_size.width)
        colours = self.app.theme_variables
        live = f"bold {colours['pc-good']}"
        turns = session.turns()
        table = Text().append(
            " ".join(h.rjust(w) for h, w in COLUMNS), f"bold {colours['pc-muted']}"
        )
        rows = max(1, self.content_size.height - 9)
        for i, m in list(enumerate(turns, 1))[-rows:]:
            table.append("\n").append_text(turn_row(i, m.timing, live if m.streaming else None))
        if not turns:
            table.append("\n  no replies yet", "dim")
        self.set_text("#timing-table", table)
        steps = session.steps
        top = scale_top([s for _, s in list(steps)[-width:]])
        title = Text().append("step time", "dim")
        if steps:
            title.append(f" full bar {1000 * top:.0f} ms", "dim")
        for kind, colour in KIND_COLOURS.items():
            title.append(" ■", Style(color=colours[colour])).append(kind, "dim")
        self.set_text("#timing-spark-title", title)
        self.set_text("#timing-spark", sparkline(steps, width, colours))
        split = split_bar(session.wall, width, colours)
        seconds, steps = session.grammar
        if steps:  # constrained replies: what their masks cost
            share = 100 * seconds / (sum(session.wall.values()) or 1)
            split.append(f"\ngrammar masks {1000 * seconds / steps:.2f} ms a step", "dim")
            split.append(f" over {steps} steps ({share:.1f}% of step time)", "dim")
        self.set_text("#timing-split", split)
        self.set_text("#timing-roof", roofline_use(session, info))
