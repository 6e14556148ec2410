"""--threads: the option reaches torch on every engine command, bad counts are one-line errors,
and the default follows the rule in core/threads.py (no timing here: docs/benchmarks.md)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import cli
from pagechat.core import threads as threads_mod
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.threads import apply_threads, default_threads, env_threads
from test_cli_errors import assert_one_line_error


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Every test here changes torch's thread count; the others run on what conftest set."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "cores,busy,threads",
    [
        (2, 0.0, 2),  # a quiet machine: every core
        (2, 0.05, 2),  # background noise takes no core
        (2, 0.25, 1),  # a process using a quarter of a core takes it
        (2, 1.0, 1),  # one busy loop on two cores
        (2, 2.0, 1),  # both cores busy: still one thread, never zero
        (1, 0.0, 1),
        (8, 1.0, 7),
        (8, 2.9, 5),  # 2.9 cores' worth of others: three cores taken
        (4, 9.0, 1),  # busier than the machine has cores
    ],
)
def test_default_is_one_thread_per_free_core(cores, busy, threads):
    assert default_threads(cores, busy) == threads


@pytest.mark.parametrize(
    "value,threads", [("3", 3), ("1", 1), ("", None), ("0", None), ("x", None)]
)
def test_omp_num_threads_is_read_when_it_is_a_count(value, threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert env_threads() == threads


def test_apply_threads_without_a_count(monkeypatch):
    """None: OMP_NUM_THREADS if set, else the default for the cores and load seen now."""
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads_mod, "others_busy", lambda: 1.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert apply_threads(None) == 2 and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert apply_threads(None) == 3 and torch.get_num_threads() == 3
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1  # a count wins over both


def test_others_busy_is_a_share_of_cores():
    busy = threads_mod.others_busy(0.05)
    assert 0.0 <= busy <= threads_mod.usable_cores() + 1  # tick rounding


def test_engine_applies_its_config(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(threads=2, kv_blocks=8, graphs=False))
    assert engine.threads == 2 and torch.get_num_threads() == 2


def test_generate_reports_the_threads_it_ran_on(tiny_llama, capsys):
    code, out, err = cli(
        ["generate", str(tiny_llama), "-p", "hi", "--max-tokens", "2", "--json", "--threads", "2"],
        capsys,
    )
    assert code in (None, 0), err
    assert json.loads(out)["stats"]["threads"] == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("threads,seen", [(2, 2), (None, 1)])
def test_the_apps_engine_process_applies_them(threads, seen, tiny_llama):
    """`pagechat run` builds its engine in a spawned process: the count reaches it through the
    config (None: the process reads OMP_NUM_THREADS, which conftest sets to 1, from the
    environment it inherits), and the app's "loaded ..." line shows what the process reports."""
    from pagechat.tui.engine_process import EngineProcess

    client = EngineProcess(tiny_llama, EngineConfig(threads=threads, kv_blocks=8)).start()
    try:
        assert client.info.threads == seen
    finally:
        client.close()


COMMANDS = {  # every command that runs the engine's torch ops, with its required arguments
    "generate": ["generate", "-p", "hi"],
    "run": ["run"],
    "bench": ["bench"],
    "bench-kv": ["bench-kv"],
    "serve": ["serve"],
    "eval": ["eval", "MODEL", "--text", "TEXT"],
    "bench-quant": ["bench-quant", "MODEL"],
    "quantize": ["quantize", "MODEL", "OUT"],
}


@pytest.mark.parametrize("bad", ["0", "-1"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_bad_thread_counts(command, bad, tiny_llama, tmp_path, capsys):
    """Refused in one line before any model loads; names the value given."""
    text = tmp_path / "t.txt"
    text.write_text("hello")
    args = [
        {"MODEL": str(tiny_llama), "TEXT": str(text), "OUT": str(tmp_path / "out")}.get(a, a)
        for a in COMMANDS[command]
    ]
    code, _, err = cli([*args, "--threads", bad], capsys)
    assert_one_line_error(code, err, f"--threads must be >= 1, got {bad}")
    assert not (tmp_path / "out").exists()


def test_an_engine_thread_runs_its_calls_in_order_on_one_thread():
    """Each call's result or exception comes back through its future; close ends the thread."""
    thread = threads_mod.EngineThread()
    ran: list[tuple[int, int]] = []
    futures = [
        thread.submit(lambda i=i: ran.append((i, threading.get_ident())) or i) for i in range(5)
    ]
    failed = thread.submit(lambda: 1 / 0)
    assert [f.result(timeout=5) for f in futures] == list(range(5))
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=5)
    assert [i for i, _ in ran] == list(range(5))
    assert {t for _, t in ran} == {thread.thread.ident} != {threading.get_ident()}
    thread.close()
    thread.thread.join(timeout=5)
    assert not thread.thread.is_alive()
