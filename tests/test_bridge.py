"""EngineLoop, the engine's thread as the app drives it: commands reach the engine in the order the UI gave them."""

from __future__ import annotations

import time

import pytest

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.tui.bridge import EngineLoop, Finished, Started
from pagechat.tui.drive import tiny_model_dir

PARAMS = SamplingParams(temperature=0.8, max_tokens=50, seed=1, ignore_eos=True)
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
def loop():
    loop = EngineLoop(Engine(tiny_model_dir(), EngineConfig(device="cpu", dtype="float32"))).start()
    yield loop
    loop.close()


def test_a_held_send_waits_for_release(loop):
    loop.send(1, CHAT, PARAMS, hold=True)
    time.sleep(0.2)  # the engine thread is idle, waiting for commands: nothing has reached it
    assert not loop.engine.requests and not loop.events
    loop.release()
    assert loop.sync()
    assert [type(e) for e in loop.events][:1] == [Started] and len(loop.engine.requests) == 1


def test_a_command_after_a_held_send_sends_it_first(loop):
    loop.pause()
    loop.send(1, CHAT, PARAMS, hold=True)
    loop.stop()  # Esc before the app released the send: the reply starts, then stops, in that order
    assert loop.sync()
    started, finished = [e for e in loop.events if isinstance(e, (Started, Finished))]
    assert isinstance(started, Started) and started.ticket == 1
    assert isinstance(finished, Finished) and finished.request_id == started.request_id and finished.reason == "abort"
    loop.release()  # nothing is held any more: no second start
    assert loop.sync() and len(loop.engine.requests) == 1
