"""`pagechat bench-serve` against a real `pagechat serve` process over 127.0.0.1: every request
is counted, token counts match what was asked, and a server that is not there is one line."""

from __future__ import annotations

import json

import pytest
from conftest import cli
from drive import free_port, serve_process
from pagechat.tools.bench_serve import LoadSpec, RequestResult, percentiles, prompts, summarise


@pytest.fixture(scope="module")
def server(tiny_llama):
    port = free_port()
    with serve_process(tiny_llama, port):
        yield f"http://127.0.0.1:{port}"


def test_every_request_is_counted(server, tiny_llama, capsys):
    code, out, err = cli(
        [
            "bench-serve",
            server,
            "--requests",
            "6",
            "--concurrency",
            "1,3",
            "--prompt-words",
            "12",
            "--output-tokens",
            "5",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["load"]["model"] == tiny_llama.name  # the first model /v1/models lists
    for level, conc in zip(data["levels"], (1, 3)):
        assert level["concurrency"] == conc and level["completed"] == 6 and level["failed"] == 0
        assert round(level["output_tok_s"] * level["duration_s"]) == 6 * 5
        assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]  # each got a first token
        assert level["itl_ms"] and level["tpot_ms"]["p50"] > 0


def test_watched_levels_read_the_event_stream(server, capsys):
    """--watched runs each level again with a watcher on /pagechat/events, which reads the
    engine's records (at least its EngineInfo and a batch per request's start and end)."""
    code, out, err = cli(
        [
            "bench-serve",
            server,
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--prompt-words",
            "8",
            "--output-tokens",
            "4",
            "--watched",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    plain, watched = json.loads(out)["levels"]
    assert plain["watched_bytes"] is None and plain["completed"] == 4
    assert watched["completed"] == 4 and watched["watched_bytes"] > 10_000


def test_a_missing_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = cli(["bench-serve", url, "--requests", "1"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: cannot reach {url}: ")  # tools/http_client.model_card


def test_percentiles_are_nearest_rank():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentiles(values) == pytest.approx({"mean": 50.5, "p50": 50, "p90": 90, "p99": 99})
    assert percentiles([]) == {}


def test_failed_requests_are_counted_not_timed():
    ok = RequestResult(ok=True, prompt_tokens=3, output_tokens=4, ttft=0.1, latency=0.4)
    bad = RequestResult(ok=False, error="HTTP 400: nope")
    report = summarise([ok, bad], concurrency=2, duration=2.0)
    assert (report.completed, report.failed, report.first_error) == (1, 1, "HTTP 400: nope")
    assert report.output_tok_s == 2.0 and report.total_tok_s == 3.5
    assert report.tpot_ms["p50"] == pytest.approx(100.0)


def test_each_run_sends_new_prompts():
    """Levels (and a level's watched run) draw their own prompts, seeded: each starts with its run
    and its number, so no run finds the prompts of one before it in a prefix cache."""
    spec = LoadSpec(url="u", model="m", requests=8, prompt_words=16, output_tokens=4, seed=0)
    names = ("1", "16", "16 watched")
    runs = [prompts(spec, run) for run in names]
    assert runs[0] == prompts(spec, "1")  # seeded: runs of the command compare
    assert all(
        p.startswith(f"{run}.{i}: ") for run, ps in zip(names, runs) for i, p in enumerate(ps)
    )
    assert len({p.split(": ", 1)[1] for ps in runs for p in ps}) == 3 * 8  # new words too
