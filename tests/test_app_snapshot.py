"""Snapshot tests (pytest-textual-snapshot): the main screen after one reply at a fixed seed on the
tiny model.

Numbers that vary between runs (times, tok/s, RSS) are fixed where the engine takes them: its
clock reads a fixed step later each time, and its memory readings are fixed.
Update the stored SVGs with `pytest tests/test_app_snapshot.py --snapshot-update` after a deliberate
change.
"""

from __future__ import annotations

import pytest
from drive import send_and_advance, tiny_model_dir, type_prompt, wait_reply_done
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.memory import Readings
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import Roofline
from pagechat.tui.app import PagechatApp
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.history import ChatRecord, ChatStore
from pagechat.tui.widgets.chat import PromptInput

PARAMS = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7, ignore_eos=True)
TICK_S = 0.005  # the engine's clock here: each reading this much later than the last
READINGS = Readings(rss=64 << 20, mem_total=128 << 20)  # the engine process's memory, fixed


def snapshot_app(tmp_path, layout: str) -> PagechatApp:
    engine = Engine(tiny_model_dir(), EngineConfig(device="cpu", dtype="float32", kv_blocks=96))
    return PagechatApp(
        ThreadedEngine(engine),
        chat=ChatRecord(id="snapshot", model="tiny-llama"),
        params=PARAMS,
        store=ChatStore(tmp_path / "chats"),
        layout=layout,
    )


async def chat_then_hold(pilot) -> None:
    """One finished turn, then a second reply held after exactly 20 engine steps (mid-stream,
    blocks in use)."""
    pilot.app.query_one(PromptInput).cursor_blink = False
    await type_prompt(pilot, "hello blocks")
    await wait_reply_done(pilot)
    await send_and_advance(pilot, "and again", 20)
    pilot.app.set_focus(None)
    await pilot.wait_for_scheduled_animations()


def test_main_screen_tabs(snap_compare, tmp_path):
    assert snap_compare(
        snapshot_app(tmp_path, "tabs"), terminal_size=(120, 34), run_before=chat_then_hold
    )


def test_main_screen_all_panels(snap_compare, tmp_path):
    assert snap_compare(
        snapshot_app(tmp_path, "grid"), terminal_size=(170, 46), run_before=chat_then_hold
    )


@pytest.fixture(autouse=True)
def _quiet_notifications(monkeypatch):
    """Toasts time out on the wall clock; keep them out of the snapshots."""
    monkeypatch.setattr(PagechatApp, "notify", lambda self, *a, **k: None)


class EngineClock:
    """The engine's time.perf_counter here: each reading TICK_S after the last, so that every time,
    rate and step bar is the same from run to run (only the engine's thread reads it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += TICK_S
        return self.now


ROOFLINE = Roofline(bandwidth=30e9, peak_flops=400e9)  # measured per machine: fixed here


@pytest.fixture(autouse=True)
def _fixed_numbers(monkeypatch):
    """The engine's timestamps and memory readings vary between runs: fixed at their source."""
    clock = EngineClock()
    for module in ("engine", "requests", "beam", "events"):  # core's modules that read the time
        monkeypatch.setattr(f"pagechat.core.{module}.time", clock)
    monkeypatch.setattr("pagechat.core.engine_loop.read_memory", lambda device: READINGS)
    monkeypatch.setattr(Roofline, "measure", classmethod(lambda cls, device, dtype: ROOFLINE))
