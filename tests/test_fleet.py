"""`pagechat watch URL URL ...`: a fleet as one table. The fleet's latency percentiles are those of
the members' histogram buckets pooled (hand-computed here, and from two real servers' /metrics);
the member out of line is named; a real `pagechat serve` killed midway shows as gone and, started
again, as back. SGLang and Ollama are read from the answers their own docs publish (no server of
either runs here): tests/fixtures/sglang and tests/fixtures/ollama."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import cli
from drive import free_port, listening, serve_process, wait_until
from pagechat.tui.fleet import Row, out_of_line
from pagechat.tui.peers import Figures, Histogram, Scrape, detect, figures
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from test_watch import replay

FIXTURES = Path(__file__).parent / "fixtures"
INF = float("inf")


def test_pooled_percentiles_are_those_of_the_pooled_buckets():
    """Ten fast answers on one server (within 0.1 s) and ten slow on another (0.5 to 1 s): the
    fleet's median is 0.1 s, where averaging the two medians (0.05 and 0.75) would say 0.4; its
    p90 is 0.5 + 0.5 * 8 / 10. Where the servers' buckets differ, the bounds they share count."""
    fast = Histogram(((0.1, 10.0), (0.5, 10.0), (1.0, 10.0), (INF, 10.0)))
    slow = Histogram(((0.1, 0.0), (0.5, 0.0), (1.0, 10.0), (INF, 10.0)))
    both = Histogram.pooled([fast, slow])
    assert both.buckets == ((0.1, 10.0), (0.5, 10.0), (1.0, 20.0), (INF, 20.0))
    assert both.quantile(0.5) == pytest.approx(0.1) and both.quantile(0.9) == pytest.approx(0.9)
    assert (fast.quantile(0.5) + slow.quantile(0.5)) / 2 == pytest.approx(0.4)
    finer = Histogram(((0.1, 10.0), (0.25, 10.0), (0.5, 10.0), (1.0, 10.0), (INF, 10.0)))
    assert Histogram.pooled([finer, slow]).buckets == both.buckets
    assert Histogram.pooled([Histogram(()), slow]) == slow


def row(url: str, running=0.0, waiting=0.0, kv=0.1, up=True, failed=0.0) -> Row:
    f = Figures(kv, running, waiting, 0.0, None, 1.0, 1.0)
    return Row(url, "vllm", "m", up, f if up else None, {}, {}, failed, None if up else "gone")


def test_the_member_out_of_line_is_named():
    calm = (row("a", 2, 0), row("b", 1, 1), row("c", 1, 0))
    assert out_of_line(calm) == {}
    busy = (*calm, row("d", 8, 4))
    assert out_of_line(busy) == {"d": "12 running or waiting where the others average 1.7"}
    full = (*calm, row("d", 1, 0, kv=0.95))
    assert out_of_line(full) == {"d": "KV cache 95% full where the others average 10%"}
    gone_and_failing = (*calm, row("d", up=False), row("e", failed=3))
    assert out_of_line(gone_and_failing) == {
        "d": "gone: gone",
        "e": "3 requests failed in the last 60 s",
    }


def test_sglang_figures_from_the_metrics_its_docs_publish():
    """Hand-read from the scrape: 162 running, 2,826 queued, a quarter of the token pool in use;
    the ITL median falls in the 0.075-0.1 s bucket at (3,700,378.5 - 433,413) / (4,950,195 -
    433,413) of its width, and the TTFT median beyond the last finite bound (30 s)."""
    text = (FIXTURES / "sglang" / "metrics.txt").read_text()
    f = figures("sglang", Scrape.parse("sglang", text, 0.0), None)
    assert (f.running, f.waiting, f.kv_usage) == (162.0, 2826.0, 0.28)
    assert f.prefix_hit == pytest.approx(0.007507552643049313)
    itl = 0.075 + 0.025 * (7.400757e6 / 2 - 433413) / (4.950195e6 - 433413)
    assert f.latency["ITL"][0] == pytest.approx(itl)
    assert f.latency["TTFT"][0] == 30.0
    assert f.gen_tok_s is None  # a rate needs two scrapes


def stand_in(kind: str) -> Starlette:
    """A server answering as the published examples of SGLang or Ollama do."""
    base = FIXTURES / kind

    def file(name: str, media: str = "application/json"):
        return lambda request: Response((base / name).read_text(), media_type=media)

    if kind == "sglang":
        return Starlette(
            routes=[
                Route("/v1/models", file("models.json")),
                Route("/metrics", file("metrics.txt", "text/plain")),
            ]
        )
    return Starlette(
        routes=[Route("/api/version", file("version.json")), Route("/api/ps", file("ps.json"))]
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("sglang", ["running 162", "waiting 2826", "KV cache in use 28.0%", "ITL"]),
        (
            "ollama",
            [
                "Ollama 0.5.1",
                "mistral:latest 4.78 GiB, 4.78 in VRAM, until 2024-06-04 14:38:31",
                "Ollama has no latency histograms",
            ],
        ),
    ],
)
async def test_the_peer_console_on_sglang_and_ollama(kind, expect, monkeypatch):
    from pagechat.tui import peer_app

    monkeypatch.setattr(peer_app, "POLL_S", 0.2)
    with listening(stand_in(kind)) as url:
        found, model = detect(url)
        assert found == kind
        assert (
            model
            == {"sglang": "meta-llama/Llama-3.1-8B-Instruct", "ollama": "mistral:latest"}[kind]
        )
        app = peer_app.PeerApp(url, kind, model)
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_until(pilot, lambda: len(app.history) >= 2, 10, "two polls")
            await pilot.pause(0.1)
            shown = "\n".join(str(w.content) for w in app.query("Static"))
            for part in expect:
                assert part in shown, part


def pooled_from(urls: list[str], name: str) -> Histogram:
    """The test's own pooling: each server's /metrics read with prometheus_client, the counts of
    each bound added over servers."""
    counts: dict[float, float] = {}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            if family.name == f"pagechat:{name}":
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        counts[le] = counts.get(le, 0.0) + s.value
    return Histogram(tuple(sorted(counts.items())))


@pytest.mark.anyio
async def test_a_fleet_of_two_servers_and_a_llama_server_survives_one_dying(tiny_llama):
    """Two real `pagechat serve` processes and a llama-server (its recorded answers) in one
    table: the fleet's TTFT and ITL are the pooled buckets' percentiles; one server killed shows
    gone and is named out of line while the others go on; started again, it is back."""
    from pagechat.tui.fleet_app import FleetApp

    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with (
        serve_process(tiny_llama, ports[0]),
        serve_process(tiny_llama, ports[1]) as second,
        listening(replay("llamacpp", ["metrics_idle.txt"], ["slots_idle.json"])) as llama,
    ):
        app = FleetApp([*urls, llama])
        async with app.run_test(size=(200, 30)) as pilot:
            await wait_until(pilot, lambda: app.view and all(r.up for r in app.view.rows), 20, "up")
            assert [r.kind for r in app.view.rows] == ["pagechat", "pagechat", "llamacpp"]
            for url, words, n in ((urls[0], 4, 3), (urls[1], 200, 2)):  # short and long prompts
                for _ in range(n):
                    body = {"prompt": "one two " * words, "max_tokens": 6}
                    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).is_success
            await wait_until(
                pilot, lambda: app.view.latency["TTFT"].count == 5, 20, "the fleet's five TTFTs"
            )
            for label, name in (
                ("TTFT", "time_to_first_token_seconds"),
                ("ITL", "inter_token_latency_seconds"),
            ):
                want = pooled_from(urls, name)
                assert app.view.latency[label].buckets == want.buckets
                for q in (0.5, 0.9):
                    assert app.view.latency[label].quantile(q) == want.quantile(q)
            second.kill()
            second.wait(10)
            await wait_until(pilot, lambda: not app.view.rows[1].up, 10, "the second gone")
            assert (
                app.view.out_of_line[urls[1]]
                == "gone: ConnectError: [Errno 111] Connection refused"
            )
            assert app.view.rows[0].up and app.view.rows[2].up
            table = app.query_one("DataTable")
            assert str(table.get_row(urls[1])[-1]).startswith("gone since ")
            with serve_process(tiny_llama, ports[1]):
                await wait_until(pilot, lambda: app.view.rows[1].up, 60, "the second back")
                assert app.view.rows[1].kind == "pagechat" and urls[1] not in app.view.out_of_line
                await pilot.pause(0.2)
                assert str(table.get_row(urls[1])[-1]).startswith("back since ")


def test_watch_refuses_what_it_cannot_watch_in_one_line(capsys):
    with listening(replay("llamacpp", ["metrics_idle.txt"])) as llama:
        for args, message in (
            ([llama, llama], f"error: {llama} is given twice\n"),
            (
                [llama, "127.0.0.1:9"],
                "error: '127.0.0.1:9' is not a server's URL (http://HOST:PORT)\n",
            ),
            (
                ["http://127.0.0.1:notaport"],
                "error: 'http://127.0.0.1:notaport' is not a server's URL: Invalid port: "
                "'notaport'\n",
            ),
            (
                [llama, llama + "/x", "--kv-events", "tcp://127.0.0.1:5557"],
                "error: --kv-events reads one server's events: give one URL with it\n",
            ),
            (
                [llama, "--kv-events", "nowhere"],
                "error: --kv-events 'nowhere' is not a ZMQ endpoint (e.g. tcp://127.0.0.1:5557)\n",
            ),
            (
                [llama, "--kv-events-replay", "tcp://127.0.0.1:5558"],
                "error: --kv-events-replay needs --kv-events\n",
            ),
            (
                [llama, "--kv-events", "tcp://127.0.0.1:5557"],
                f"error: {llama} is llama.cpp, which publishes no KV events (vLLM does with "
                "--kv-events-config, pagechat with serve --kv-events)\n",
            ),
        ):
            code, _, err = cli(["watch", *args], capsys)
            assert (code, err) == (2, message), args


@pytest.mark.anyio
async def test_a_fleet_of_sglang_ollama_and_a_server_answering_nonsense(monkeypatch):
    """SGLang and Ollama each get their row from what they expose; a server whose /metrics is
    not Prometheus text stays a row, not answering, with why; Enter on a row opens that server's
    own console (here: the URL it would run `pagechat watch` on)."""
    from pagechat.tui.fleet_app import FleetApp

    async def models(request):
        return Response('{"data": [{"id": "m", "owned_by": "vllm"}]}')

    nonsense = Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/metrics", lambda r: Response("{not prometheus")),
        ]
    )
    with (
        listening(stand_in("sglang")) as sglang,
        listening(stand_in("ollama")) as ollama,
        listening(nonsense) as odd,
    ):
        app = FleetApp([sglang, ollama, odd])
        opened = []
        monkeypatch.setattr(app, "open_console", opened.append)
        async with app.run_test(size=(200, 20)) as pilot:
            await wait_until(pilot, lambda: app.view is not None, 10, "a poll")
            table = app.query_one("DataTable")
            sg, ol, bad = (table.get_row(u) for u in (sglang, ollama, odd))
            assert sg[1:6] == ["SGLang", "meta-llama/Llama-3.1-8B-Instruct", "28%", "162", "2826"]
            assert ol[1:4] == ["Ollama", "mistral:latest", "4.8 GiB VRAM"]
            assert str(bad[-1]) == "not answering" and app.view.out_of_line[odd].startswith(
                "gone: "
            )
            await pilot.press("down", "enter")
            await pilot.pause(0.1)
            assert opened == [ollama]


def test_a_slow_member_holds_no_other_up_and_an_odd_answer_is_said():
    """A member whose /metrics takes 10 s: the poll still returns within TIMEOUT_S with the
    others' rows, the slow one timed out; a vLLM whose speculation counters carry a
    position that is not a number is a row that says so, not a crash."""
    import asyncio
    import time

    from pagechat.tui.fleet import TIMEOUT_S, Fleet

    async def models(request):
        return Response('{"data": [{"id": "m", "owned_by": "vllm"}]}')

    async def slow_metrics(request):
        await asyncio.sleep(10)
        return Response("")

    odd = "vllm:spec_decode_num_drafts_total 4\n"
    odd += 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="first"} 2\n'
    slow = Starlette(routes=[Route("/v1/models", models), Route("/metrics", slow_metrics)])
    strange = Starlette(
        routes=[Route("/v1/models", models), Route("/metrics", lambda r: Response(odd))]
    )
    with (
        listening(slow) as slow_url,
        listening(strange) as odd_url,
        listening(stand_in("sglang")) as sglang,
    ):
        fleet = Fleet([slow_url, odd_url, sglang])
        try:
            start = time.monotonic()
            view = fleet.poll()
            assert time.monotonic() - start < TIMEOUT_S + 1
            by_url = {r.url: r for r in view.rows}
            assert by_url[sglang].up and not by_url[slow_url].up
            # its own request times out at TIMEOUT_S too: whichever ends first, it is not up
            assert by_url[slow_url].why in ("not answered yet", "ReadTimeout: timed out")
            assert not by_url[odd_url].up
            assert "invalid literal for int() with base 10: 'first'" in by_url[odd_url].why
        finally:
            fleet.close()
