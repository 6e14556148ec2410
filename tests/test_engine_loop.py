"""The app's engine loop over a long sitting: every request it starts (chat replies, their samples,
branches, aborted ones, background load) is forgotten by the engine once it has ended and the app
has been told, so the engine's state does not grow with the number of replies."""

from __future__ import annotations

from collections import deque

from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.engine_loop import NOTHING
from pagechat.core.events import Finished, Started
from pagechat.core.params import SamplingParams
from pagechat.tui.engine_loop import AppLoop
from pagechat.tui.protocol import Send, StartLoad, Stop


class ScriptPort:
    """The app, scripted: one command each time the loop waits (it has nothing to step), and
    gone once the script is done; every event kept."""

    def __init__(self, commands) -> None:
        self.commands, self.events = deque(commands), []

    def take(self, block: bool):
        if not block:
            return NOTHING
        return self.commands.popleft() if self.commands else None

    def emit(self, event) -> None:
        self.events.append(event)

    def flush(self, idle: bool) -> None:
        pass


def chat(k: int) -> list[dict]:
    return [{"role": "user", "content": f"Question number {k}: what is {k} plus {k}?"}]


def test_the_engine_keeps_no_request_once_the_app_has_been_told(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", kv_blocks=96))
    commands = []
    for k in range(12):
        params = SamplingParams(temperature=0.8, max_tokens=8, seed=k, n=1 + k % 3)
        commands.append(Send(k, chat(k), params))
    # a reply stopped before it ends, and a branch beside the reply in flight
    commands += [Send(12, chat(12), SamplingParams(max_tokens=64, ignore_eos=True)), Stop()]
    commands += [Send(13, chat(13), SamplingParams(max_tokens=6), prefix=(5, 6), beside=True)]
    commands.append(StartLoad(count=24, rate=1000.0, max_tokens=6))
    port = ScriptPort(commands)
    AppLoop(engine, port).run()
    started = {e.request_id for e in port.events if isinstance(e, Started)}
    ended = {e.request_id for e in port.events if isinstance(e, Finished)}
    assert len(started) == 14 + 24 and started <= ended  # each told as it ended
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks() == 96  # every block free or cached-free
