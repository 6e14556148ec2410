"""The fleet console: one row per server (fleet.py polls them), the fleet's own row below them,
the member out of line named above; Enter opens a row in the single-server console."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime

from pagechat.tui.app import PALETTE, THEME
from pagechat.tui.fleet import WINDOW_S, Fleet, FleetView, Row
from pagechat.tui.peer_app import call_unless_closed
from pagechat.tui.peers import KINDS, Histogram
from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Footer, Static

POLL_S = 1.0
COLUMNS = (
    "server",
    "kind",
    "model",
    "KV",
    "running",
    "waiting",
    "gen tok/s",
    "TTFT p50 / p90",
    "ITL p50 / p90",
    "prefix hit",
    "state",
)
# what `pagechat watch URL` runs, in this terminal while the fleet waits
WATCH = "from pagechat.cli.main import main; main()"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "—" if x is None else format(x, fmt)


def _pair(h: Histogram | None) -> str:
    if h is None or not h.count:
        return "—"
    return f"{_ms(h.quantile(0.5))} / {_ms(h.quantile(0.9))}"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.0f} ms" if x >= 0.1 else f"{1000 * x:.1f} ms"


def _clock(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else ""


class FleetApp(App):
    """Polls every member each POLL_S on a worker thread, then redraws the table."""

    TITLE = "pagechat watch (fleet)"
    CSS = """
    #about { height: auto; background: $panel; padding: 0 1; }
    DataTable { height: 1fr; }
    """
    BINDINGS = [("ctrl+q", "quit", "quit")]

    def __init__(self, urls: list[str], api_key: str | None = None) -> None:
        super().__init__()
        self.register_theme(THEME)
        self.theme = THEME.name
        self.api_key = api_key
        self.fleet = Fleet(urls, api_key)
        self.view: FleetView | None = None
        self.polling = False

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return PALETTE

    def compose(self) -> ComposeResult:
        yield Static(id="about")
        yield DataTable(cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.query_one("#about", Static).update(f"watching {len(self.fleet.members)} servers")
        self.poll()
        self.set_interval(POLL_S, self.poll)

    def on_unmount(self) -> None:
        self.fleet.close()

    def poll(self) -> None:
        if not self.polling:  # a poll may take TIMEOUT_S: the next starts after it
            self.polling = True
            self.run_worker(self._poll, thread=True, group="poll")

    def _poll(self) -> None:
        try:
            view = self.fleet.poll()
        finally:
            self.polling = False
        call_unless_closed(self, self.show, view)

    def show(self, view: FleetView) -> None:
        self.view = view
        table = self.query_one(DataTable)
        cursor = table.cursor_row
        table.clear()
        for row in view.rows:
            table.add_row(*self.cells(view, row), key=row.url)
        table.add_row(*self.fleet_cells(view), key="fleet")
        table.move_cursor(row=min(cursor, len(view.rows) - 1))
        self.query_one("#about", Static).update(self.about(view))

    def about(self, view: FleetView) -> Text:
        up = sum(r.up for r in view.rows)
        t = Text(f"{len(view.rows)} servers, {up} up", "bold")
        span = f"the last {WINDOW_S:.0f} s" if view.windowed else "each server's whole run"
        t.append(f" · latency over {span}; the fleet's from the servers' histogram buckets pooled")
        bad = self.theme_variables["pc-bad"]
        for url, why in view.out_of_line.items():
            t.append("\nout of line: ", bad).append(url, "bold").append(f" ({why})")
        if not view.out_of_line:
            t.append("\nnone out of line", "dim")
        return t.append("\nEnter opens a server in its own console; Ctrl+Q quits", "dim")

    def cells(self, view: FleetView, row: Row) -> tuple:
        colours = self.theme_variables
        if not row.up:
            gone = f"gone since {_clock(row.since)}" if row.since else "not answering"
            state = Text(gone, colours["pc-bad"])
            return (row.url, "—", row.model or "—", *("",) * 7, state)
        f = row.figures
        latency = view.latency_of(row)
        state = Text("up", colours["pc-good"])
        if row.url in view.out_of_line:
            state = Text("out of line", colours["pc-warn"])
        elif row.since is not None:
            state = Text(f"back since {_clock(row.since)}", colours["pc-good"])
        kv = _pct(f.kv_usage)
        if row.kind == "ollama" and f.resident:
            kv = f"{sum(m.size_vram for m in f.resident) / 1024**3:.1f} GiB VRAM"
        return (
            row.url,
            KINDS[row.kind],
            row.model,
            kv,
            _num(f.running),
            _num(f.waiting),
            _num(f.gen_tok_s, ".1f"),
            _pair(latency.get("TTFT")),
            _pair(latency.get("ITL")),
            _pct(f.prefix_hit),
            state,
        )

    def fleet_cells(self, view: FleetView) -> tuple:
        figs = [r.figures for r in view.rows if r.up and r.figures is not None]

        def total(pick, fmt=".0f") -> str:
            values = [v for v in map(pick, figs) if v is not None]
            return _num(sum(values), fmt) if values else "—"

        return (
            Text("fleet", "bold"),
            "",
            "",
            "",
            total(lambda f: f.running),
            total(lambda f: f.waiting),
            total(lambda f: f.gen_tok_s, ".1f"),
            _pair(view.latency.get("TTFT")),
            _pair(view.latency.get("ITL")),
            "",
            Text(f"{len(figs)} of {len(view.rows)} up"),
        )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a server's row: it in the single-server console, in this terminal; the
        fleet comes back when that quits."""
        if event.row_key.value != "fleet":
            self.open_console(event.row_key.value)

    def open_console(self, url: str) -> None:
        env = dict(os.environ)
        if self.api_key:
            env["PAGECHAT_API_KEY"] = self.api_key
        with self.suspend():
            done = subprocess.run([sys.executable, "-c", WATCH, "watch", url], env=env)
        if done.returncode:
            self.notify(f"pagechat watch {url} ended with exit code {done.returncode}")
