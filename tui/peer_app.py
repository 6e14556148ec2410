"""The console on a server read as a peer (vLLM, llama.cpp, SGLang, Ollama, or pagechat with
--kv-events): what its metrics (llama.cpp's slots, Ollama's loaded models) expose, as live gauges
and sparklines over the last polls, and for what they do not expose, why. Given the server's KV
events, a block map of its prefix cache heads the panels: each cached prefix a row of blocks, the
blocks it shares with others marked, and the text its own blocks hold (the server's /detokenize)."""

from __future__ import annotations

from collections import deque

from pagechat.core.errors import one_line
from pagechat.tools.http_client import client, server_url
from pagechat.tools.kv_events import CacheView, EventFeed, Hash
from pagechat.tui.app import PALETTE, THEME
from pagechat.tui.peers import (
    ANSWER_ERRORS,
    KINDS,
    NOT_EXPOSED,
    VLLM_LIKE,
    Figures,
    Scrape,
    figures,
    scrape,
)
from pagechat.tui.widgets.timing import sparkline
from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.widgets import Footer, Static

POLL_S = 1.0
HISTORY = 120  # polls the sparklines span
WIDTH = 40  # cells of a bar or a sparkline
CHAINS = 12  # cached prefixes the block map draws (the newest)
CHAIN_CELLS = 48  # blocks drawn of one prefix; longer ones say how many more


def call_unless_closed(app: App, call, *args) -> None:
    """From a poll's worker thread: `call` on the UI's, unless the app closed meanwhile (its
    panels gone, a poll in flight finds nothing to draw on)."""
    try:
        app.call_from_thread(call, *args)
    except NoMatches:
        pass


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
    #events { column-span: 2; text-wrap: nowrap; text-overflow: ellipsis; }
    """
    BINDINGS = [("ctrl+q", "quit", "quit")]

    def __init__(
        self,
        url: str,
        kind: str,
        model: str,
        api_key: str | None = None,
        events: EventFeed | None = None,
    ) -> None:
        super().__init__()
        self.register_theme(THEME)
        self.theme = THEME.name
        self.url, self.kind, self.model = server_url(url), kind, model
        self.http = client(self.url, api_key, timeout=5.0)
        self.last: Scrape | None = None
        self.history: deque[Figures] = deque(maxlen=HISTORY)
        self.error: str | None = None  # why the last poll failed
        self.events = events
        self.texts: dict[Hash, str | None] = {}  # a prefix's own blocks as text, by its last block
        self.cache_view: CacheView | None = None

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return PALETTE

    def compose(self) -> ComposeResult:
        yield Static(id="about")
        with Grid(id="panels"):
            if self.events is not None:
                panel = Static(id="events", classes="peer")
                panel.border_title = f"Prefix cache · KV events from {self.events.endpoint}"
                yield panel
            for key, title in PANELS:
                panel = Static(id=key, classes="peer")
                panel.border_title = title
                yield panel
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#about", Static).update(f"watching {KINDS[self.kind]} at {self.url}")
        if self.events is not None:
            self.query_one("#panels").styles.grid_rows = "2fr 1fr 1fr 1fr"
            self.events.start()
        self.poll()
        self.set_interval(POLL_S, self.poll)

    def on_unmount(self) -> None:
        self.http.close()
        if self.events is not None:
            self.events.stop()

    def about(self) -> Text:
        """Which server, its version and what it holds, from the endpoints that say so."""
        t = Text(f"watching {KINDS[self.kind]} at {self.url} · {self.model}", "bold")
        try:
            if self.kind == "vllm":
                version = self.http.get("/version").json().get("version", "?")
                t.append(f" · vLLM {version}")
            elif self.kind == "ollama":
                t.append(f" · Ollama {self.http.get('/api/version').json().get('version', '?')}")
            elif self.kind == "llamacpp":
                props = self.http.get("/props").json()
                t.append(
                    f" · {props.get('total_slots', '?')} slots · {props.get('model_ftype', '?')}"
                    f" · build {props.get('build_info', '?')}"
                )
        except ANSWER_ERRORS as e:
            t.append(f" · ({one_line(e)})", "dim")
        return t.append("\nCtrl+Q quits", "dim")

    def _show_about(self, text: Text) -> None:
        self.query_one("#about", Static).update(text)

    def poll(self) -> None:
        """Scrape on a worker thread (the server may be slow), then show it on the UI's."""
        self.run_worker(self._scrape, thread=True, group="poll", exclusive=True)

    def _scrape(self) -> None:
        if self.last is None and not self.history:  # the first poll says which server it is
            call_unless_closed(self, self._show_about, self.about())
        if self.events is not None:
            view = self.events.view()
            self._name_prefixes(view)
            call_unless_closed(self, self._show_cache, view)
        try:
            new = scrape(self.http, self.kind)
            read = figures(self.kind, new, self.last)  # an odd answer fails here, not on the UI
        except ANSWER_ERRORS as e:
            why = f"{self.url}/{'api/ps' if self.kind == 'ollama' else 'metrics'}: {one_line(e)}"
            if self.kind == "llamacpp":
                why += " (llama-server serves /metrics only when started with --metrics)"
            call_unless_closed(self, self.show, None, None, why)
            return
        call_unless_closed(self, self.show, new, read)

    def _name_prefixes(self, view: CacheView) -> None:
        """The text of each drawn prefix's own blocks (after those it shares), asked of the
        server once a prefix (vLLM's and pagechat's /detokenize)."""
        shown = view.chains[:CHAINS]
        self.texts = {c.leaf: self.texts[c.leaf] for c in shown if c.leaf in self.texts}
        for chain in shown:
            if chain.leaf in self.texts:
                continue
            own = list(chain.token_ids[chain.shared * (view.block_size or 0) :])
            try:
                r = self.http.post("/detokenize", json={"model": self.model, "tokens": own})
                text = r.raise_for_status().json().get("prompt")
                self.texts[chain.leaf] = text if isinstance(text, str) else None
            except ANSWER_ERRORS:
                self.texts[chain.leaf] = None  # the map says how many tokens instead

    def _show_cache(self, view: CacheView) -> None:
        self.cache_view = view
        self.query_one("#events", Static).update(self.prefix_map(view))

    def show(self, new: Scrape | None, read: Figures | None, error: str | None = None) -> None:
        """A poll's result (or why it failed) into the history and the panels."""
        self.error = error
        if new is not None and read is not None:
            self.history.append(read)
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

    def prefix_map(self, view: CacheView) -> Text:
        """Each cached prefix, newest first: a cell a block (those it shares with other prefixes
        in the cached colour), then the text of its own blocks."""
        colours = self.theme_variables
        size = view.block_size or 0
        held = self.last.info.get("num_gpu_blocks") if self.last else None
        t = Text(f"{view.blocks} blocks", "bold")
        t.append(f" of {held}" if held else "").append(f" of {size} tokens · " if size else " · ")
        t.append(f"{len(view.chains)} prefixes · batch {_num(view.last_seq)} · ")
        t.append(f"{view.stored} stored, {view.removed} removed since watching")
        if view.cleared:
            t.append(f", cleared {view.cleared}x")
        if view.elsewhere:
            t.append(f" · {view.elsewhere} events of offloaded copies not drawn", "dim")
        shown = view.chains[:CHAINS]
        width = max((min(len(c.keys), CHAIN_CELLS) for c in shown), default=0)
        for chain in shown:
            t.append("\n")
            t.append("┄" if not chain.rooted else " ", colours["pc-warn"])
            cells = min(len(chain.keys), CHAIN_CELLS)
            shared = min(chain.shared, cells)
            t.append("▓" * shared, colours["pc-cached"]).append("█" * (cells - shared), "bold")
            more = len(chain.keys) - cells
            t.append(f"+{more}" if more else " " * (width - cells))
            t.append(f" {len(chain.keys):>3} blocks ", "dim")
            own = self.texts.get(chain.leaf)
            if own is None:
                t.append(f"{len(chain.token_ids) - chain.shared * size} tokens of its own", "dim")
            else:
                t.append(("…" if chain.shared else "") + own.replace("\n", "⏎"))
        if len(view.chains) > CHAINS:
            t.append(f"\n… {len(view.chains) - CHAINS} older prefixes", "dim")
        t.append("\n▓ shared with another prefix  █ its own  ┄ its start is not held", "dim")
        for line in view.notices[-3:]:
            t.append(f"\n{line}", colours["pc-warn"])
        return t  # a row a prefix, however long its text (#events does not wrap)

    def kv(self, f: Figures) -> Text:
        if self.kind == "ollama":
            return self.resident(f)
        t = self.spark(lambda x: x.kv_usage, "KV cache in use", _pct)
        for s in f.slots:
            used = round(WIDTH * s.tokens / s.n_ctx) if s.n_ctx else 0
            t.append(f"\nslot {s.id} ", "bold").append("█" * used + "░" * (WIDTH - used))
            t.append(f" {s.tokens}/{s.n_ctx}" + (f" ({s.cached} cached)" if s.cached else ""))
        return t.append(f"\n{NOT_EXPOSED[self.kind]['blocks']}", "dim")

    def resident(self, f: Figures) -> Text:
        """Ollama's loaded models: what each takes, in VRAM too, and when Ollama unloads it."""
        t = Text()
        gib = 1024**3
        for m in f.resident:
            t.append(m.name, "bold").append(f" {m.size / gib:.2f} GiB")
            t.append(f", {m.size_vram / gib:.2f} in VRAM")
            t.append(f", context {m.context}" if m.context else "")
            t.append(f", until {m.expires_at[:19].replace('T', ' ')}\n" if m.expires_at else "\n")
        return t.append(NOT_EXPOSED["ollama"]["blocks"] if f.resident else "no model loaded", "dim")

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
            if self.kind == "llamacpp":
                t.append(f"per {name}", "bold").append(f" {_ms(p50)} (mean)\n")
            else:
                t.append(f"{name:<6}", "bold").append(f" p50 {_ms(p50):>10}  p90 {_ms(p90):>10}\n")
        return t.append(NOT_EXPOSED[self.kind].get("latency", ""), "dim")

    def cache(self, f: Figures) -> Text:
        t = Text("prefix-cache hit rate ", "bold").append(_pct(f.prefix_hit)).append("\n")
        t.append("speculation: accepted ", "bold").append(_pct(f.spec_rate))
        for i, rate in enumerate(f.spec_positions):
            n = round(WIDTH * rate)
            t.append(f"\n  position {i} ").append("█" * n + "░" * (WIDTH - n))
            t.append(f" {_pct(rate)}")
        if "spec_positions" in NOT_EXPOSED[self.kind]:
            t.append(f"\n{NOT_EXPOSED[self.kind]['spec_positions']}", "dim")
        elif f.spec_rate is None:
            t.append("\nno speculative decoding on this server", "dim")
        return t.append(f"\n{NOT_EXPOSED[self.kind]['sampling']}", "dim")

    def server(self, f: Figures) -> Text:
        """How the server keeps its KV cache, and how its requests ended."""
        s, t = self.last, Text()
        if s is None:
            return t
        if self.kind == "ollama":
            return t.append("Ollama has no metrics: its loaded models are under KV cache", "dim")
        if self.kind == "sglang":
            v = s.values
            t.append("token pool ", "bold").append(f"{_num(v.get('max_total_num_tokens'))} tokens")
            t.append(" · in use ", "bold").append(f"{_num(v.get('num_used_tokens'))}")
            return t
        if self.kind in VLLM_LIKE:
            i = s.info
            if i:  # vLLM's cache_config_info
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
