"""The app's handles on the engine: commands reach it in the order the UI gave them, and the
engine's own process delivers the same events and block maps as a thread of the app's process."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest
from drive import sequences, tiny_model_dir
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.events import BlocksChanged, Finished, FirstToken, MemoryRead, Started
from pagechat.core.params import SamplingParams
from pagechat.core.report import StepReport
from pagechat.core.wire import pack, unpack
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.engine_process import EngineProcess

PARAMS = SamplingParams(temperature=0.8, max_tokens=50, seed=1, ignore_eos=True)
CHAT = [{"role": "user", "content": "hello"}]
CONFIG = EngineConfig(device="cpu", dtype="float32", kv_blocks=64)


@pytest.fixture
def loop():
    engine = Engine(tiny_model_dir(), CONFIG)
    sequences(engine)  # the loop releases each request once it has ended: count them all
    loop = ThreadedEngine(engine).start()
    yield loop
    loop.close()


def commands_seen(loop) -> list:
    return [e for e in loop.events if not isinstance(e, MemoryRead)]


def test_a_held_send_waits_for_release(loop):
    loop.send(1, CHAT, PARAMS, hold=True)
    time.sleep(0.2)  # the engine thread is idle, waiting for commands: nothing has reached it
    assert not loop.engine.requests and not commands_seen(loop)
    loop.release()
    assert loop.sync()
    assert [type(e) for e in commands_seen(loop)][:1] == [Started]
    assert len(sequences(loop.engine)) == 1


def test_a_command_after_a_held_send_sends_it_first(loop):
    loop.pause()
    loop.send(1, CHAT, PARAMS, hold=True)
    loop.stop()  # Esc before the app released the send: the reply starts, then stops, in that order
    assert loop.sync()
    started, finished = [e for e in loop.events if isinstance(e, (Started, Finished))]
    assert isinstance(started, Started) and started.ticket == 1
    assert (
        isinstance(finished, Finished)
        and finished.request_id == started.request_id
        and finished.reason == "abort"
    )
    loop.release()  # nothing is held any more: no second start
    assert loop.sync() and len(sequences(loop.engine)) == 1


def test_block_deltas_rebuild_every_snapshot_of_a_busy_pool():
    """Shared prefixes, cached-free blocks, aborts and finishes: what crosses the pipe rebuilds each
    snapshot."""
    engine = Engine(tiny_model_dir(), CONFIG)
    prompt = list(range(5, 45))
    for i in range(3):
        engine.requests.add(
            prompt + [50 + i] * (i + 1),
            SamplingParams(temperature=0.8, max_tokens=12 + 6 * i, seed=i),
        )
    sent = held = engine.block_map.snapshot()
    steps = 0
    while engine.has_unfinished():
        events = [engine.step()]
        steps += 1
        if steps == 4:
            engine.requests.abort(2)
            events.append(BlocksChanged(engine.block_map.snapshot()))
        batch, sent = pack(events, sent)
        got, held = unpack(pickle.loads(pickle.dumps(batch)), held)
        truth = engine.block_map.snapshot()
        assert held == truth and all(e.blocks == truth for e in got if isinstance(e, StepReport))
        assert [type(e) for e in got] == [type(e) for e in events]
        r = events[0]
        if steps > 4 and not any(
            o.finished for o in r.outputs
        ):  # a decode step touches its tail blocks only
            assert len(batch[1][1]) <= r.num_seqs < len(truth.blocks)
    assert steps > 10 and held.num_cached > 0


def drain(loop, until, timeout: float = 60.0) -> list:
    """Events until one satisfies `until` (the app's timer would drain them the same way)."""
    got, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        while loop.events:
            got.append(loop.events.popleft())
            if until(got[-1]):
                return got
        time.sleep(0.01)
    raise TimeoutError(f"no event matched after {timeout} s: {got[-3:]}")


def reply(loop, params: SamplingParams) -> list:
    loop.send(7, [{"role": "user", "content": "hello there " * 20}], params)
    return drain(loop, lambda e: isinstance(e, Finished))


def test_the_engine_process_matches_the_engine_thread():
    """Same model, same requests: the child process's events carry the tokens, texts and block maps
    of a thread."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=3, ignore_eos=True)
    runs = {}
    for name, make in (
        ("thread", lambda: ThreadedEngine(Engine(tiny_model_dir(), CONFIG))),
        ("process", lambda: EngineProcess(tiny_model_dir(), CONFIG)),
    ):
        loop = make().start()
        try:
            assert loop.info.memory.num_blocks == 64 and loop.info.device.type == "cpu"
            events = reply(loop, params) + reply(
                loop, params
            )  # the second turn hits the prefix cache
            assert loop.sync()
            events += list(loop.events)
        finally:
            loop.close()
        reports = [e for e in events if isinstance(e, StepReport)]
        runs[name] = (
            [t for r in reports for o in r.outputs for t in o.token_ids],
            "".join(o.text_delta for r in reports for o in r.outputs),
            [s for r in reports for s in r.samples],
            [
                (type(e).__name__, getattr(e, "output_tokens", None))
                for e in events
                if isinstance(e, (Started, FirstToken, Finished))
            ],
            reports[-1].blocks,
            [e.readings.rss > 0 for e in events if isinstance(e, MemoryRead)][-1:],
        )
    thread, process = runs["thread"], runs["process"]
    assert len(thread[0]) == 80 and thread[4].prefix_hit_tokens > 0
    assert process[:2] == thread[:2] and process[3:5] == thread[3:5] and process[5] == [True]
    for a, b in zip(
        process[2], thread[2], strict=True
    ):  # logits differ in the last bits with the thread count
        assert a.token_id == b.token_id and len(a.candidates) == len(b.candidates)
        for x, y in zip(a.candidates, b.candidates):
            assert (x.token_id, x.text, x.kept, x.chosen) == (y.token_id, y.text, y.kept, y.chosen)
            assert x.prob == pytest.approx(y.prob, abs=1e-4)


def test_a_model_the_engine_process_cannot_load_is_a_one_line_error(tmp_path: Path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PagechatError) as err:
        EngineProcess(tmp_path, CONFIG)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_the_client_tells_a_process_that_died_or_went_silent_from_an_idle_one():
    """An idle engine process keeps saying it is alive (heartbeats), so silence means stopped."""
    from pagechat.core.wire import SILENT_S

    killed, stopped = (EngineProcess(tiny_model_dir(), CONFIG).start() for _ in range(2))
    try:
        time.sleep(SILENT_S + 0.5)  # idle longer than the silence that counts as stopped
        assert killed.failure() is None and stopped.failure() is None
        os.kill(killed.pid, signal.SIGKILL)
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(SILENT_S + 0.5)
        assert killed.failure() == f"the engine process {killed.pid} exited (exit code -9)"
        assert f"the engine process {stopped.pid} stopped answering (" in stopped.failure()
        assert not killed.sync(0.1)
    finally:
        for client in (killed, stopped):
            client.abandon()
    assert not stopped.is_alive() and stopped.failure() is None  # abandoned: not a failure


def test_commands_and_events_are_frozen_dataclasses():
    """What crosses between the app and the engine is typed, immutable and picklable."""
    from dataclasses import fields, is_dataclass
    from typing import get_args

    from pagechat.tui.protocol import Command, Event, Send, Stop

    for cls in (*get_args(Command), *get_args(Event)):
        assert is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    assert [f.name for f in fields(Send)][3:] == ["prefix", "when_full", "beside"]
    for cmd in (Send(1, CHAT, PARAMS), Stop()):
        assert pickle.loads(pickle.dumps(cmd)) == cmd
