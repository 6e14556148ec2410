"""The app never stays stuck (Pilot): a step that fails ends its reply with the reason, a loop or
an engine process that dies or stops answering is noticed within 2 s and replaced by a new engine
on the same model, the chat and its finished replies are kept, and Ctrl+R asks a failed reply
again."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from drive import send_and_advance, type_prompt, wait_reply_done, wait_until
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.tui.app import PagechatApp
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.engine_process import EngineProcess
from pagechat.tui.history import ChatStore

pytestmark = pytest.mark.anyio
SIZE = (120, 36)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONFIG = EngineConfig(device="cpu", dtype="float32")


def app_on(client, tmp_path) -> PagechatApp:
    return PagechatApp(client, params=GREEDY, store=ChatStore(tmp_path / "chats"), layout="tabs")


def saved(app: PagechatApp) -> list[dict]:
    path = app.files.store.path(app.session.record.id)
    return json.loads(path.read_text())["messages"]


def breaks_once(engine: Engine, name: str, at_call: int):
    """Make engine.<name> raise RuntimeError on its at_call-th call (once)."""
    real, calls = getattr(engine, name), []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    setattr(engine, name, broken)


async def test_a_failed_step_ends_the_reply_and_ctrl_r_asks_again(model_dir, tmp_path):
    engine = Engine(model_dir, CONFIG)
    prompt = engine.requests.encode_chat([{"role": "user", "content": "hello"}])
    want = engine.generate([prompt], GREEDY)[0].text  # as a fresh engine answers the turn
    breaks_once(engine, "_forward", 4)  # mid-reply: after the prompt and two decode steps
    app = app_on(ThreadedEngine(engine), tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "hello")
        await wait_reply_done(pilot)
        failed = app.session.messages[-1]
        assert failed.finish_reason == "error"
        assert failed.error == "engine step failed: RuntimeError: boom"
        assert saved(app)[-1]["error"] == failed.error
        await pilot.press("ctrl+r")
        await wait_reply_done(pilot)
        user, reply = app.session.messages  # the failed reply's place is taken by the new one
        assert user.content == "hello" and reply is not failed
        assert reply.error is None and reply.content == want
        assert [m["content"] for m in saved(app)] == ["hello", want]


async def test_a_loop_that_dies_is_replaced_and_the_chat_kept(model_dir, tmp_path):
    engine = Engine(model_dir, CONFIG)
    app = app_on(ThreadedEngine(engine), tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "first")
        await wait_reply_done(pilot)
        first = app.session.messages[-1].content
        breaks_once(engine, "_schedule", 2)  # outside a step's work: the loop itself ends
        await type_prompt(pilot, "second")
        failed = app.session.messages[-1]
        await wait_until(pilot, lambda: failed.error is not None, 2, "the app to notice")
        assert failed.error == "the engine stopped: the engine failed: RuntimeError: boom"
        await wait_until(pilot, lambda: not app.supervisor.restarting, 60, "a new engine")
        assert app.loop.engine is not engine and app.session.messages[1].content == first
        await pilot.press("ctrl+r")
        await wait_reply_done(pilot)
        assert app.session.messages[-1].error is None and len(app.session.messages) == 4
        assert [m.get("error") for m in saved(app)] == [None] * 4


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_an_engine_process_killed_or_stopped_is_noticed_within_2_s(sig, model_dir, tmp_path):
    """A real signal to the engine's process mid-reply: SIGKILL ends it, SIGSTOP leaves it alive
    but silent. The engine is paused after three steps of the reply, so the signal lands before
    it ends (the tiny model writes 400 tokens in 0.2 s: a signal sent after the first tokens came
    once landed after the last)."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    app = app_on(EngineProcess(model_dir, CONFIG), tmp_path)
    app.session.params = GREEDY
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "first")
        await wait_reply_done(pilot)
        app.session.params = params
        await send_and_advance(pilot, "second", 3)
        assert app.session.messages[-1].tokens and app.session.messages[-1].streaming
        pid = app.loop.pid
        os.kill(pid, sig)
        t0, reply = time.monotonic(), app.session.messages[-1]
        await wait_until(pilot, lambda: reply.error is not None, 5, "the app to notice")
        assert time.monotonic() - t0 < 2.0
        assert (
            not reply.streaming
            and reply.error.startswith(f"the engine stopped: the engine process {pid} ")
            and ("exited (exit code -9)" if sig == signal.SIGKILL else "stopped answering")
            in (reply.error)
        )
        await wait_until(pilot, lambda: not app.supervisor.restarting, 60, "a new engine")
        assert app.loop.pid != pid and app.loop.is_alive()
        app.session.params = GREEDY
        await pilot.press("ctrl+r")
        await wait_reply_done(pilot)
        assert [m.error for m in app.session.messages] == [None] * 4
        assert len(app.session.messages[-1].tokens) == 12


async def test_a_reply_that_cannot_start_fails_and_can_be_asked_again(model_dir, tmp_path):
    """The engine raising while it starts a reply (here the chat template) ends that reply."""
    engine = Engine(model_dir, CONFIG)
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    app = app_on(ThreadedEngine(engine), tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "hello")
        await wait_reply_done(pilot, timeout=5)
        assert app.session.messages[-1].error == "the chat template failed: no system role"
        engine.tokenizer.chat_template = template
        await pilot.press("ctrl+r")
        await wait_reply_done(pilot)
        assert app.session.messages[-1].error is None and len(app.session.messages) == 2
