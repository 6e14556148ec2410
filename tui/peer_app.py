"""The console on a vLLM or llama.cpp server: what its metrics (and llama.cpp's slots) expose, as
live gauges and sparklines over the last polls, and for what they do not expose, why."""

from __future__ import annotations

from collections import deque

import httpx
from pagechat.core.errors import one_line
from pagechat.tools.http_client import client, server_url
from pagechat.tui.app import PALETTE, THEME
from pagechat.tui.peers import KINDS, NOT_EXPOSED, Figures, Scrape, figures, scrape
from pagechat.tui.widgets.timing import sparkline
from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Grid
from textual.widgets import Footer, Static

POLL_S = 1.0
HISTORY = 120  # polls the sparklines span
WIDTH = 40  # cells of a bar or a sparkline


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "—" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.1f} ms"


class PeerApp(App):
    """Polls the server every POLL_S and redraws the panels from the last two polls."""

    TITLE = "pagechat watch"
    CSS = """
    #about { height: 2; background: $panel; padding: 0 1; }
    #panels { grid-size: 2; grid-gutter: 0 1; height: 1fr; }
    .peer { border: round $primary 50%; padding: 0 1; height: 100%; }
    """
    BINDINGS = [("ctrl+q", "quit", "quit")]

    def __init__(self, url: str, kind: str, model: str, api_key: str | None = None) -> None:
        super().__init__()
        self.register_theme(THEME)
        self.theme = THEME.name
        self.url, self.kind, self.model = server_url(url), kind, model
        self.http = client(self.url, api_key, timeout=5.0)
        self.last: Scrape | None = None
        self.history: deque[Figures] = deque(maxlen=HISTORY)
        self.error: str | None = None  # why the last poll failed

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return PALETTE

    def compose(self) -> ComposeResult:
        yield Static(id="about")
        with Grid(id="panels"):
            for key, title in PANELS:
                panel = Static(id=key, classes="peer")
                panel.border_title = title
                yield panel
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#about", Static).update(f"watching {KINDS[self.kind]} at {self.url}")
        self.poll()
        self.set_interval(POLL_S, self.poll)

    def on_unmount(self) -> None:
        self.http.close()

    def about(self) -> Text:
        """Which server, its version and what it holds, from the endpoints that say so."""
        t = Text(f"watching {KINDS[self.kind]} at {self.url} · {self.model}", "bold")
        try:
            if self.kind == "vllm":
                version = self.http.get("/version").json().get("version", "?")
                t.append(f" · vLLM {version}")
            else:
                props = self.http.get("/props").json()
                t.append(
                    f" · {props.get('total_slots', '?')} slots · {props.get('model_ftype', '?')}"
                    f" · build {props.get('build_info', '?')}"
                )
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            t.append(f" · ({one_line(e)})", "dim")
        return t.append("\nCtrl+Q quits", "dim")

    def _show_about(self, text: Text) -> None:
        self.query_one("#about", Static).update(text)

    def poll(self) -> None:
        """Scrape on a worker thread (the server may be slow), then show it on the UI's."""
        self.run_worker(self._scrape, thread=True, group="poll", exclusive=True)

    def _scrape(self) -> None:
        if self.last is None and not self.history:  # the first poll says which server it is
            self.call_from_thread(self._show_about, self.about())
        try:
            new = scrape(self.http, self.kind)
        except (httpx.HTTPError, ValueError) as e:
            why = f"{self.url}/metrics: {one_line(e)}"
            if self.kind == "llamacpp":
                why += " (llama-server serves /metrics only when started with --metrics)"
            self.call_from_thread(self.show, None, why)
            return
        self.call_from_thread(self.show, new)

    def show(self, new: Scrape | None, error: str | None = None) -> None:
        """A poll's result (or why it failed) into the history and the panels."""
        self.error = error
        if new is not None:
            self.history.append(figures(self.kind, new, self.last))
            self.last = new
        self.draw()

    def draw(self) -> None:
        f = self.history[-1] if self.history else None
        for key, _ in PANELS:
            text = Text(self.error, "red") if self.error or f is None else DRAW[key](self, f)
            self.query_one(f"#{key}", Static).update(text or "")

    # -- panels ------------------------------------------------------------------------------------
    def spark(self, pick, label: str, fmt) -> Text:
        values = [v for v in (pick(f) for f in self.history) if v is not None]
        t = Text(f"{label} ", "bold").append(fmt(values[-1]) if values else "—").append("\n")
        if values:
            steps = [("decode", v) for v in values]
            t.append_text(sparkline(steps, WIDTH, self.theme_variables, 2))
        return t

    def kv(self, f: Figures) -> Text:
        t = self.spark(lambda x: x.kv_usage, "KV cache in use", _pct)
        for s in f.slots:
            used = round(WIDTH * s.tokens / s.n_ctx) if s.n_ctx else 0
            t.append(f"\nslot {s.id} ", "bold").append("█" * used + "░" * (WIDTH - used))
            t.append(f" {s.tokens}/{s.n_ctx}" + (f" ({s.cached} cached)" if s.cached else ""))
        return t.append(f"\n{NOT_EXPOSED[self.kind]['blocks']}", "dim")

    def requests(self, f: Figures) -> Text:
        t = self.spark(lambda x: x.running, "running", _num).append("\n")
        t.append_text(self.spark(lambda x: x.waiting, "waiting", _num))
        t.append("\npreemptions ", "bold").append(_num(f.preemptions))
        for key in ("preemptions", "requests"):
            if key in NOT_EXPOSED[self.kind]:
                t.append(f"\n{NOT_EXPOSED[self.kind][key]}", "dim")
        return t

    def throughput(self, f: Figures) -> Text:
        t = self.spark(lambda x: x.gen_tok_s, "generated tok/s", lambda v: f"{v:.1f}")
        t.append("\n").append_text(
            self.spark(lambda x: x.prompt_tok_s, "prompt tok/s", lambda v: f"{v:.1f}")
        )
        return t

    def latency(self, f: Figures) -> Text:
        t = Text()
        for name, (p50, p90) in f.latency.items():
            if self.kind == "vllm":
                t.append(f"{name:<6}", "bold").append(f" p50 {_ms(p50):>10}  p90 {_ms(p90):>10}\n")
            else:
                t.append(f"per {name}", "bold").append(f" {_ms(p50)} (mean)\n")
        if self.kind == "llamacpp":
            t.append(NOT_EXPOSED["llamacpp"]["latency"], "dim")
        return t

    def cache(self, f: Figures) -> Text:
        t = Text("prefix-cache hit rate ", "bold").append(_pct(f.prefix_hit)).append("\n")
        t.append("speculation: accepted ", "bold").append(_pct(f.spec_rate))
        for i, rate in enumerate(f.spec_positions):
            n = round(WIDTH * rate)
            t.append(f"\n  position {i} ").append("█" * n + "░" * (WIDTH - n))
            t.append(f" {_pct(rate)}")
        if self.kind == "llamacpp":
            t.append(f"\n{NOT_EXPOSED['llamacpp']['spec_positions']}", "dim")
        elif f.spec_rate is None:
            t.append("\nno speculative decoding on this server", "dim")
        return t.append(f"\n{NOT_EXPOSED[self.kind]['sampling']}", "dim")

    def server(self, f: Figures) -> Text:
        """How the server keeps its KV cache, and how its requests ended."""
        s, t = self.last, Text()
        if s is None:
            return t
        if self.kind == "vllm":
            i = s.info
            t.append("KV cache ", "bold").append(
                f"{i.get('num_gpu_blocks', '?')} blocks of {i.get('block_size', '?')} tokens "
                f"({i.get('kv_cache_size_tokens', '?')} tokens), prefix caching "
                f"{'on' if i.get('enable_prefix_caching') == 'True' else 'off'}\n"
            )
            ended = s.per_label.get("request_success_total", {})
            t.append("requests ended ", "bold")
            counts = [f"{why} {n:.0f}" for why, n in sorted(ended.items()) if n]
            t.append(" · ".join(counts) or "none yet")
            return t
        if f.slots:
            t.append("slots ", "bold").append(f"{len(f.slots)} of {f.slots[0].n_ctx} tokens each\n")
        elif s.slots_why:
            t.append(s.slots_why + "\n", "dim")
        v = s.values
        t.append("decode calls ", "bold").append(_num(v.get("n_decode_total")))
        t.append(" · longest sequence ", "bold").append(_num(v.get("n_tokens_max_total")))
        return t


PANELS = (
    ("kv", "KV cache"),
    ("requests", "Requests"),
    ("throughput", "Throughput"),
    ("latency", "Latency"),
    ("cache", "Prefix cache · speculation"),
    ("server", "Server"),
)
DRAW = {
    "kv": PeerApp.kv,
    "requests": PeerApp.requests,
    "throughput": PeerApp.throughput,
    "latency": PeerApp.latency,
    "cache": PeerApp.cache,
    "server": PeerApp.server,
}
