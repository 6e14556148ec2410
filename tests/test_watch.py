"""Watching servers: the engine's records as JSON (core/wire.py) equal the records themselves; a
pagechat server's /pagechat/events stream carries every client's requests, with the block map
watchers rebuild equal to the engine's; the app on RemoteEngine chats through the API and sees
load it sends; a slow watcher is dropped; vLLM's and llama.cpp's recorded answers (tests/fixtures)
become the peer console's figures and panels; `pagechat watch` finds out which server it is."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import cli
from drive import Watcher, free_port, listening
from pagechat.core.engine import Engine
from pagechat.core.events import EngineInfo, Finished, FirstToken, MemoryRead, Started
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport
from pagechat.core.wire import dumps, loads, pack, unpack
from pagechat.server.watch import Watchers
from pagechat.tui.peers import Histogram, Scrape, figures
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from test_server import HELLO, MODEL, serving, tiny_config

FIXTURES = Path(__file__).parent / "fixtures"


# -- the records on the wire ---------------------------------------------------------------------
def test_every_record_survives_json(tiny_llama):
    """Samples, speculation, swaps and a finished beam search: each event read back from its JSON
    equals the event (tuples, nested records, floats and the device included)."""
    engine = Engine(
        tiny_llama, tiny_config(kv_blocks=10, preempt="swap", swap_blocks=64, ngram=True)
    )
    events = [EngineInfo.of(engine)]
    engine.requests.add([5, 6, 7, 8] * 8, SamplingParams(max_tokens=24, n=3, seed=1))
    engine.requests.add([9, 10, 11] * 5, SamplingParams(max_tokens=6, beam_width=2))
    engine.requests.add(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=40))
    while engine.has_unfinished():
        report = engine.step()
        events.append(report)
        for out in report.outputs:
            seq = engine.requests[out.request_id]
            events.append(FirstToken.of(seq) if seq.first_token_time else None)
            if out.finished:
                events.append(Finished.of(seq))
    kinds = {type(e) for e in events if e is not None}
    assert {EngineInfo, StepReport, FirstToken, Finished} <= kinds
    reports = [e for e in events if isinstance(e, StepReport)]
    assert any(r.samples for r in reports) and any(r.swaps for r in reports)
    assert any(e.beams for e in events if isinstance(e, Finished))
    for ev in events:
        if ev is not None:
            assert loads(dumps(ev)) == ev
    # a batch with its snapshot as a delta, through JSON, gives the same snapshot back
    batch, sent = pack(reports[-3:], reports[0].blocks)
    got, snap = unpack(loads(dumps(batch)), reports[0].blocks)
    assert snap == sent == reports[-1].blocks and got[-1] == reports[-1]


def test_a_slow_watcher_is_dropped_and_told(tiny_llama, monkeypatch):
    """A watcher QUEUE_MAX batches behind gets the end mark and leaves the hub; the others and the
    engine go on."""
    monkeypatch.setattr("pagechat.server.watch.QUEUE_MAX", 2)
    engine = Engine(tiny_llama, tiny_config())
    hub = Watchers(EngineInfo.of(engine))

    async def run() -> tuple[list[str], list[str]]:
        hub.start(asyncio.get_running_loop())
        slow, fast = hub.stream(), hub.stream()
        # each starts with the EngineInfo and a memory reading
        got_slow = [await anext(slow), await anext(slow)]
        got_fast = [await anext(fast), await anext(fast)]
        assert hub.watched
        engine.requests.add([1, 2, 3], SamplingParams(max_tokens=6))
        for _ in range(6):
            hub.emit(engine.step())
            hub.flush(idle=True)
            await asyncio.sleep(0)  # the batch reaches the queues
            got_fast.append(await anext(fast))
        got_slow += [text async for text in slow]
        return got_slow, got_fast

    got_slow, got_fast = asyncio.run(run())
    assert len(got_fast) == 8 and len(got_slow) == 4  # hello, memory, two batches, the end
    assert all(t.startswith("data: ") for t in got_fast)
    assert isinstance(loads(got_fast[1][6:])[0][0], MemoryRead)


# -- a pagechat server's events ------------------------------------------------------------------
def test_events_carry_every_clients_requests(tiny_llama):
    """Two clients' requests (one names itself with X-Request-Id) start, decode and finish in the
    stream; the candidates are recorded for a request that asked for no logprobs; once idle, the
    block map the watcher rebuilt from deltas is the engine's own, and nothing is held."""
    with serving(tiny_llama, tiny_config(kv_blocks=48)) as s, Watcher(s.url) as watcher:
        assert watcher.info.memory.num_blocks == 48
        client = s.client()
        chat = client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=6,
            temperature=0,
            extra_headers={"X-Request-Id": "mine-1"},
        )
        assert chat.id == "chatcmpl-mine-1"
        done = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4, n=2, seed=3)
        s.wait_idle()
        end = time.monotonic() + 10
        while sum(isinstance(e, Finished) for e in watcher.events) < 3:
            assert time.monotonic() < end, [type(e).__name__ for e in watcher.events]
            time.sleep(0.05)
        started = [e for e in watcher.events if isinstance(e, Started)]
        assert [(e.label, e.ref) for e in started][0] == ("api chat", "chatcmpl-mine-1")
        assert started[1].label == "api cmpl" and started[1].ref == done.id
        text = "".join(
            o.text_delta
            for e in watcher.events
            if isinstance(e, StepReport)
            for o in e.outputs
            if o.request_id == started[0].request_id
        )
        assert text == chat.choices[0].message.content
        samples = [r for e in watcher.events if isinstance(e, StepReport) for r in e.samples]
        assert samples and all(len(r.candidates) >= 8 for r in samples)
        assert watcher.snapshot == s.engine.block_map.snapshot()
        assert watcher.snapshot.num_used == 0


@pytest.fixture
def keyed(tiny_llama):
    with serving(tiny_llama, tiny_config(), api_key="sesame") as s:
        yield s


def test_a_watcher_joining_later_starts_from_the_engines_block_map(tiny_llama):
    """A client leaves mid-stream while nobody watches (its blocks are freed between steps), then
    a watcher joins the idle server: its first block map is the engine's, not the one before."""
    with serving(tiny_llama, tiny_config(kv_blocks=48)) as s:
        body = {"prompt": "a b c d e", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            next(line for line in r.iter_lines() if '"text"' in line)  # decoding: it holds blocks
        s.wait_idle()
        assert s.engine.block_map.snapshot().num_used == 0
        with Watcher(s.url) as watcher:
            assert watcher.snapshot == s.engine.block_map.snapshot()


def test_an_engine_that_fails_ends_its_watchers_streams(tiny_llama):
    """When the engine's thread dies, the watchers' streams end (their console says the server
    stopped) instead of beating on as if the server were idle."""
    with serving(tiny_llama, tiny_config()) as s, Watcher(s.url) as watcher:

        def broken():
            raise RuntimeError("boom")

        s.engine.step = broken  # a bug outside any request: the loop itself ends
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 500
        watcher.join(5)
        assert watcher.ended and not s.state.watchers.watched


def test_events_refuse_a_missing_key(keyed):
    r = httpx.get(keyed.url + "/pagechat/events", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "no_key"
    with httpx.stream(
        "GET",
        keyed.url + "/pagechat/events",
        headers={"authorization": "Bearer sesame"},
        timeout=10,
    ) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert isinstance(loads(first[6:]), EngineInfo)


def test_a_bad_request_id_is_a_400(tiny_llama):
    with serving(tiny_llama, tiny_config()) as s:
        r = httpx.post(
            s.url + "/v1/completions",
            json={"prompt": "a", "max_tokens": 1},
            headers={"X-Request-Id": "no spaces allowed"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "x-request-id"


# -- the app on a pagechat server ----------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.anyio
async def test_the_app_on_a_server_chats_through_its_api(model_dir, tmp_path):
    """The reply the app shows is the server's greedy answer to the same messages; another
    client's request and the app's own load (sent through the API) show in the scheduler under
    their names; a branch is refused in one line."""
    from drive import type_prompt, wait_reply_done, wait_until
    from pagechat.tui.app import PagechatApp
    from pagechat.tui.history import ChatStore
    from pagechat.tui.remote import RemoteEngine
    from pagechat.tui.widgets.sampling import SamplingPanel
    from textual.widgets import Static

    with serving(model_dir, tiny_config()) as s:
        want = (
            s.client()
            .chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                temperature=0,
                max_tokens=8,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
        )
        client = RemoteEngine(s.url)
        app = PagechatApp(client, params=GREEDY, store=ChatStore(tmp_path / "c"), layout="tabs")
        async with app.run_test(size=(120, 36)) as pilot:
            await type_prompt(pilot, "hello")
            await wait_reply_done(pilot)
            reply = app.session.messages[-1]
            assert reply.error is None and reply.content == want
            assert len(reply.tokens) == 8 and reply.timing.ttft_s is not None

            def names() -> set[str]:
                return set(app.sched.labels.values())

            threading.Thread(
                target=lambda: s.client().completions.create(
                    model=MODEL, prompt="x y", max_tokens=3
                ),
                daemon=True,
            ).start()
            app.load.set(True, 3, 50.0)
            await wait_until(pilot, lambda: {"api cmpl", "load 1", "load 3"} <= names(), 20)
            await wait_until(pilot, lambda: app.load.left == 0 and not app.load.running(), 30)
            # between replies the sampling panel shows whatever the server samples
            app.main.show_panel("sampling")
            s.client().completions.create(model=MODEL, prompt="p q", max_tokens=2)

            def sampling() -> str:
                panel = app.query_one(SamplingPanel)
                return " ".join(str(w.content) for w in panel.query(Static))

            await wait_until(pilot, lambda: "newest token of api cmpl" in sampling(), 10)
    assert client.failure() is None  # closed by the app: not a failure


def test_what_a_watcher_cannot_do_is_refused(tiny_llama):
    """A branch, beam search and engine commands are refused in one line each; the client stays
    connected."""
    from pagechat.tui.protocol import Refused
    from pagechat.tui.remote import RemoteEngine

    with serving(tiny_llama, tiny_config()) as s:
        client = RemoteEngine(s.url).start()
        try:
            client.send(1, HELLO, GREEDY, prefix=(5,))
            client.send(2, HELLO, SamplingParams(beam_width=2))
            client.pause()
            refused = [e for e in client.events if isinstance(e, Refused)]
            assert [e.ticket for e in refused] == [1, 2, None]
            assert "branch" in refused[0].message and "beam" in refused[1].message
            assert refused[2].message.startswith("pause: ")
            assert client.failure() is None
        finally:
            client.close()


def test_a_silent_or_gone_server_is_a_failure(tiny_llama):
    """An event stream that goes silent past SILENT_S, then ends, is said to have stopped, in
    those words; a URL with no pagechat server behind it is one line."""
    from pagechat.core.errors import PagechatError
    from pagechat.core.wire import SILENT_S
    from pagechat.tui.remote import RemoteEngine

    hello = dumps(EngineInfo.of(Engine(tiny_llama, tiny_config())))

    async def events(request):
        async def body():
            yield f"data: {hello}\n\n"
            await asyncio.sleep(SILENT_S + 1.0)

        return StreamingResponse(body(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"data": [{"id": "tiny", "owned_by": "pagechat"}]})

    app = Starlette(routes=[Route("/pagechat/events", events), Route("/v1/models", models)])
    with listening(app) as url:
        client = RemoteEngine(url).start()
        time.sleep(SILENT_S + 0.3)
        assert client.failure().startswith(f"the server at {url} stopped answering (")
        client._reader.join(5)
        assert client.failure() == (
            f"the server at {url} stopped sending: the server ended the event stream"
        )
        client.abandon()
    with pytest.raises(PagechatError, match=r"^cannot watch http://127\.0\.0\.1:9: ConnectError"):
        RemoteEngine("http://127.0.0.1:9")


# -- vLLM and llama.cpp, from their recorded answers -----------------------------------------------
def replay(folder: str, metrics: list[str], slots: list[str] = (), metrics_status: int = 200):
    """A server answering as the recorded one did: /metrics (and /slots) go through the given
    recordings one a poll, then stay at the last."""
    base = FIXTURES / folder
    calls = {"metrics": 0, "slots": 0}

    def nth(key: str, names: list[str]) -> str:
        name = names[min(calls[key], len(names) - 1)]
        calls[key] += 1
        return (base / name).read_text()

    def file(name: str, kind: str = "application/json"):
        return lambda request: Response((base / name).read_text(), media_type=kind)

    routes = [Route("/v1/models", file("models.json"))]
    routes.append(
        Route(
            "/metrics",
            lambda request: Response(nth("metrics", metrics), status_code=metrics_status),
        )
    )
    if (base / "version.json").exists():
        routes.append(Route("/version", file("version.json")))
    if (base / "props.json").exists():
        routes.append(Route("/props", file("props.json")))
    if slots:
        routes.append(
            Route("/slots", lambda r: Response(nth("slots", slots), media_type="application/json"))
        )
    return Starlette(routes=routes)


def test_a_histograms_quantile_is_prometheus():
    """Linear inside the bucket the rank falls in, as histogram_quantile: 10 observations up to
    0.5 s and 10 more up to 1 s put the median at 0.5 and the 75th percentile at 0.75."""
    h = Histogram(((0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0)))
    assert h.quantile(0.5) == pytest.approx(0.5) and h.quantile(0.75) == pytest.approx(0.75)
    old = Histogram(((0.1, 0.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)))
    assert h.since(old).count == 10 and h.since(old).quantile(0.5) == pytest.approx(0.75)
    assert Histogram(()).quantile(0.5) is None


def test_vllm_figures_from_its_recorded_metrics():
    """Hand-read from the recordings: 89 generated and 177 prompt tokens between the idle and the
    loaded scrape (2 s apart here); 14 first tokens, 6 within 0.5 s, 7 within 0.75 s, 10 within
    1 s and 14 within 2.5 s, so the median is 0.75 s and p90 1 + 1.5 * 2.6 / 4 = 1.975 s; with
    speculation 27 drafts whose positions 0, 1, 2 were accepted 27, 22 and 22 times, 71 of 71
    drafted tokens accepted."""
    base = FIXTURES / "vllm"
    idle = Scrape.parse("vllm", (base / "metrics_idle.txt").read_text(), 0.0)
    load = Scrape.parse("vllm", (base / "metrics_load.txt").read_text(), 2.0)
    f = figures("vllm", load, idle)
    assert (f.running, f.waiting, f.preemptions) == (4.0, 0.0, 0.0)
    assert f.kv_usage == pytest.approx(0.011019283746556474)
    assert (f.gen_tok_s, f.prompt_tok_s) == (44.5, 88.5)
    assert f.latency["TTFT"] == pytest.approx((0.75, 1.975))
    assert set(f.latency) == {"TTFT", "ITL", "E2E", "queue"}
    assert f.spec_rate is None and f.spec_positions == ()
    spec = FIXTURES / "vllm" / "spec"
    f = figures("vllm", Scrape.parse("vllm", (spec / "metrics_load.txt").read_text(), 1.0), None)
    assert f.spec_positions == pytest.approx((1.0, 22 / 27, 22 / 27)) and f.spec_rate == 1.0
    assert f.gen_tok_s is None  # a rate needs two scrapes


def test_llamacpp_figures_from_its_recorded_metrics_and_slots():
    base = FIXTURES / "llamacpp"
    slots = tuple(json.loads((base / "slots_load.json").read_text()))
    s = Scrape.parse("llamacpp", (base / "metrics_load.txt").read_text(), 1.0, slots)
    f = figures("llamacpp", s, None)
    assert (f.running, f.waiting, f.preemptions) == (2.0, 1.0, None)
    assert [(u.id, u.busy, u.n_ctx) for u in f.slots] == [(0, True, 512), (1, True, 512)]
    first = slots[0]
    assert f.slots[0].tokens == first["n_prompt_tokens"] + first["next_token"][0]["n_decoded"]
    assert f.slots[0].cached == first["n_prompt_tokens_cache"]
    assert f.kv_usage == pytest.approx((20 + 22) / 1024)  # 18 + 2 and 19 + 3 tokens of 512 each
    assert f.prefix_hit == pytest.approx(81 / (81 + 29))  # cached over cached + computed prompt
    idle = tuple(json.loads((base / "slots_idle.json").read_text()))
    assert all(
        not u.busy and u.tokens == 0
        for u in figures(
            "llamacpp",
            Scrape.parse("llamacpp", (base / "metrics_idle.txt").read_text(), 0.0, idle),
            None,
        ).slots
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("folder", "kind", "metrics", "slots", "expect"),
    [
        (
            "vllm",
            "vllm",
            ["metrics_idle.txt", "metrics_load.txt"],
            [],
            [
                "vLLM 0.32.0",
                "running 4",
                "preemptions 0",
                "TTFT",
                "KV cache in use 1.1%",
                "vLLM exposes the KV cache as one usage fraction",
                "364 blocks of 128 tokens (46592 tokens), prefix caching on",
                "requests ended length 10",
            ],
        ),
        (
            "vllm/spec",
            "vllm",
            ["metrics_idle.txt", "metrics_load.txt"],
            [],
            ["position 0", "position 2", "81.5%"],
        ),
        (
            "llamacpp",
            "llamacpp",
            ["metrics_idle.txt", "metrics_load.txt"],
            ["slots_idle.json", "slots_load.json"],
            [
                "2 slots",
                "slot 0",
                "20/512 (15 cached)",
                "running 2",
                "waiting 1",
                "llama.cpp does not preempt",
                "per decode token",
                "slots 2 of 512 tokens each",
                "longest sequence 27",
            ],
        ),
    ],
)
async def test_the_peer_console_on_recorded_servers(
    folder, kind, metrics, slots, expect, monkeypatch
):
    """`pagechat watch` on a server that answers as vLLM or llama-server did: it is detected, and
    after two polls its panels show the recorded figures and say what the server cannot show."""
    from pagechat.cli.watch import detect
    from pagechat.tui import peer_app

    monkeypatch.setattr(peer_app, "POLL_S", 0.2)
    with listening(replay(folder, metrics, slots)) as url:
        assert detect(url) == (kind, "small-llama")
        app = peer_app.PeerApp(url, kind, "small-llama")
        async with app.run_test(size=(160, 40)) as pilot:
            from drive import wait_until

            def text() -> str:
                return "\n".join(str(w.content) for w in app.query("Static"))

            await wait_until(pilot, lambda: len(app.history) >= 2, 10, "two polls")
            await pilot.pause(0.1)
            shown = text()
            for part in expect:
                assert part in shown, part


@pytest.mark.anyio
async def test_a_llamacpp_server_without_metrics_says_how_to_get_them():
    from drive import wait_until
    from pagechat.tui.peer_app import PeerApp

    with listening(replay("llamacpp", ["metrics_idle.txt"], metrics_status=501)) as url:
        app = PeerApp(url, "llamacpp", "small-llama")
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_until(pilot, lambda: app.error is not None, 10, "a failed poll")
            await pilot.pause(0.1)
            assert "started with --metrics" in str(app.query_one("#kv").content)


def test_watch_says_what_is_wrong_in_one_line(capsys):
    code, _, err = cli(["watch", "http://127.0.0.1:9/v1/"], capsys)  # as a client's base_url
    assert code == 2 and err.startswith("error: cannot reach http://127.0.0.1:9: ")
    assert len(err.strip().splitlines()) == 1

    async def models(request):
        return JSONResponse({"data": [{"id": "m", "owned_by": "somebody"}]})

    with listening(Starlette(routes=[Route("/v1/models", models)])) as url:
        code, _, err = cli(["watch", url], capsys)
        assert code == 2 and "owned by 'somebody'" in err
        code, _, err = cli(["bench-serve", url, "--watched", "--requests", "1"], capsys)
    assert code == 2 and err == (
        f"error: --watched needs a pagechat server: {url}/pagechat/events answered HTTP 404\n"
    )
    code, _, err = cli(["serve", "--watch", "--port", "0"], capsys)
    assert code == 2 and err == "error: --watch needs a --port to reach the server on (not 0)\n"


def test_serve_watch_says_why_its_server_did_not_start(tmp_path, capsys):
    """The server runs in a child process; when it exits before it answers /health, its own last
    line is the error, and its log is kept."""
    port = free_port()
    missing = tmp_path / "no-model"
    code, _, err = cli(["serve", str(missing), "--watch", "--port", str(port)], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: the server did not start: ") and str(missing) in lines[-1]
    logs = [line for line in lines if line.startswith("the server's log: ")]
    assert len(logs) == 1 and Path(logs[0].split(": ", 1)[1]).name.startswith(
        f"pagechat-serve-{port}-"
    )


def test_a_watched_servers_request_names_do_not_pile_up():
    """The scheduler keeps the names of the sequences it lists and the newest others, at most
    LABELS_KEPT, however many requests a watched server runs."""
    from pagechat.core.report import SeqRecord
    from pagechat.tui.widgets.scheduler import LABELS_KEPT, SchedulerLog

    log = SchedulerLog()
    log.apply_seqs((SeqRecord(3, 3, "request", 0, "running", 4, 1, 5, 1, 0, 0),))
    for rid in range(3, 3 + 5 * LABELS_KEPT):
        log.label(rid, f"api chat {rid}")
    assert len(log.labels) == LABELS_KEPT
    assert log.what(log.live[0]) == "api chat 3"  # listed: kept though it is the oldest
    assert log.labels[2 + 5 * LABELS_KEPT] == f"api chat {2 + 5 * LABELS_KEPT}"
