"""A fleet of servers as one table (`pagechat watch URL URL ...`): each member polled as the peer
console polls one (peers.py), its latency over the last WINDOW_S; the fleet's own percentiles from
the members' histogram buckets pooled (never averaged percentiles); and the member that is out of
line named: gone, failing requests, or loaded far beyond the others.

A member that stops answering stays in the table as gone and is asked again every poll; when it
answers again, which server it is is found out afresh (another may have taken its port).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from pagechat.core.errors import PagechatError, one_line
from pagechat.tools.http_client import client, server_url
from pagechat.tui.peers import (
    ANSWER_ERRORS,
    FAILED,
    LATENCIES,
    Figures,
    Histogram,
    Scrape,
    detect,
    figures,
    scrape,
)

WINDOW_S = 60.0  # the latency and failures a row shows: over this much of the latest polls
TIMEOUT_S = 3.0  # a member slower than this to answer a poll is counted as not answering
LATENCY = ("TTFT", "ITL")  # the fleet's latencies (peers.LATENCIES names their histograms)
BUSY_FACTOR, BUSY_MIN = 2.0, 4.0  # out of line: this many times the others' mean load, and more
FULL_KV, CALM_KV = 0.9, 0.5  # out of line: KV this full where the others average below CALM_KV


@dataclass(frozen=True, slots=True)
class Row:
    """One member as the table shows it after a poll."""

    url: str
    kind: str | None  # None until it has answered once
    model: str
    up: bool
    figures: Figures | None
    latency: dict[str, Histogram]  # TTFT and ITL observations in the window
    total: dict[str, Histogram]  # and since the member started
    failed: float  # requests that ended in error or abort within the window
    why: str | None = None  # why it is not up
    since: float | None = None  # time.time() it went down, or came back


class Member:
    """One server of the fleet; poll() is called from one thread at a time."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url, self.api_key = server_url(url), api_key
        self.http = client(self.url, api_key, timeout=TIMEOUT_S)
        self.kind: str | None = None
        self.model = ""
        self.scrapes: deque[Scrape] = deque()  # the window's polls, oldest first
        self.up: bool | None = None
        self.since: float | None = None

    def close(self) -> None:
        self.http.close()

    def poll(self) -> Row:
        last = self.scrapes[-1] if self.scrapes else None
        try:
            if self.kind is None:
                self.kind, self.model = detect(self.url, self.api_key)
            new = scrape(self.http, self.kind)
            read = figures(self.kind, new, last)  # an odd answer fails here too
        except (*ANSWER_ERRORS, PagechatError) as e:
            self._went(False)
            self.kind = None  # when it answers again, find out what it is
            self.scrapes.clear()
            why = one_line(e)
            return Row(self.url, None, self.model, False, None, {}, {}, 0.0, why, self.since)
        self._went(True)
        self.scrapes.append(new)
        while new.at - self.scrapes[0].at > WINDOW_S:
            self.scrapes.popleft()
        first = self.scrapes[0]
        total = {k: h for k, h in ((k, _latency(new, k)) for k in LATENCY) if h is not None}
        window = {k: h.since(_latency(first, k)) for k, h in total.items()}
        failed = _failed(new) - _failed(first)
        return Row(
            self.url, self.kind, self.model, True, read, window, total, failed, None, self.since
        )

    def _went(self, up: bool) -> None:
        if self.up is not None and up != self.up:
            self.since = time.time()
        self.up = up


def _latency(s: Scrape, label: str) -> Histogram | None:
    """The scrape's histogram of a latency, by the first of its names the server has."""
    names = (n for n, of in LATENCIES.items() if of == label and n in s.histograms)
    return next((s.histograms[n] for n in names), None)


def _failed(s: Scrape) -> float:
    per = s.per_label.get("request_success_total", {})
    return sum(n for why, n in per.items() if why in FAILED)


@dataclass(frozen=True, slots=True)
class FleetView:
    rows: tuple[Row, ...]
    windowed: bool  # latencies over the last WINDOW_S; False: since each member started
    latency: dict[str, Histogram]  # each one pooled over the members
    out_of_line: dict[str, str]  # url -> why

    def latency_of(self, row: Row) -> dict[str, Histogram]:
        return row.latency if self.windowed else row.total


def pooled(rows: tuple[Row, ...]) -> tuple[bool, dict[str, Histogram]]:
    """The fleet's TTFT and ITL, the members' buckets added (at the bounds all of them have):
    over the window where anything was observed in it, else over each member's whole run."""
    windowed = any(h.count for r in rows for h in r.latency.values())
    pick = (lambda r: r.latency) if windowed else (lambda r: r.total)
    return windowed, {
        label: Histogram.pooled([pick(r)[label] for r in rows if label in pick(r)])
        for label in LATENCY
    }


def _load(f: Figures) -> float | None:
    if f.running is None and f.waiting is None:
        return None
    return (f.running or 0.0) + (f.waiting or 0.0)


def out_of_line(rows: tuple[Row, ...]) -> dict[str, str]:
    """Which members stand out, and why: gone, failing, or loaded far beyond the others."""
    out: dict[str, str] = {}
    up = [r for r in rows if r.up and r.figures is not None]
    for r in rows:
        if not r.up:
            out[r.url] = f"gone: {r.why}"
        elif r.failed > 0:
            out[r.url] = f"{r.failed:.0f} requests failed in the last {WINDOW_S:.0f} s"
    for r in up:
        if r.url in out:
            continue
        others = [o for o in up if o is not r]
        loads = [x for x in (_load(o.figures) for o in others) if x is not None]
        mine = _load(r.figures)
        if loads and mine is not None:
            mean = sum(loads) / len(loads)
            if mine >= BUSY_FACTOR * mean + BUSY_MIN:
                out[r.url] = f"{mine:.0f} running or waiting where the others average {mean:.1f}"
                continue
        kvs = [o.figures.kv_usage for o in others if o.figures.kv_usage is not None]
        kv = r.figures.kv_usage
        if kvs and kv is not None and kv >= FULL_KV and sum(kvs) / len(kvs) < CALM_KV:
            out[r.url] = (
                f"KV cache {100 * kv:.0f}% full where the others average "
                f"{100 * sum(kvs) / len(kvs):.0f}%"
            )
    return out


class Fleet:
    """The members, polled at once: each poll waits TIMEOUT_S at most, a member still answering
    then keeps the row its last poll gave (its next poll starts once that one ends), so one slow
    or gone member holds no other up."""

    def __init__(self, urls: list[str], api_key: str | None = None) -> None:
        self.members = [Member(u, api_key) for u in urls]
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.members)))
        self._running: dict[int, Future] = {}  # member index -> its poll under way
        self._rows = [
            Row(m.url, None, "", False, None, {}, {}, 0.0, "not answered yet") for m in self.members
        ]

    def poll(self) -> FleetView:
        for i, member in enumerate(self.members):
            if i not in self._running:
                self._running[i] = self._pool.submit(member.poll)
        wait(self._running.values(), timeout=TIMEOUT_S)
        for i, future in list(self._running.items()):
            if future.done():
                self._rows[i] = future.result()
                del self._running[i]
        rows = tuple(self._rows)
        return FleetView(rows, *pooled(rows), out_of_line(rows))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for m in self.members:
            m.close()
