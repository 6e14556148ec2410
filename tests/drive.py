"""Driving the app headless (Pilot): waits on engine work, sending prompts; a server listening on
127.0.0.1, in this process or as a real `pagechat serve`; used by the tests and the screenshot
script."""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from pagechat.core.events import EngineInfo
from pagechat.core.wire import loads, unpack
from pagechat.tui.app import PagechatApp
from textual.pilot import Pilot


@functools.cache
def tiny_model_dir() -> Path:
    """A tiny random llama checkpoint (seed 1: identical bytes every time), made once per
    process."""
    from pagechat.tools.make_model import make_model

    return make_model(
        Path(tempfile.mkdtemp(prefix="pagechat-tiny-")) / "tiny-llama", "llama", "tiny", seed=1
    )


def tabs_app(model_dir: Path, tmp_path: Path, params, **config) -> PagechatApp:
    """The app on a fresh float32 CPU engine (config: EngineConfig fields), chats saved under
    tmp_path, panels as tabs."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.tui.client import ThreadedEngine
    from pagechat.tui.history import ChatStore

    engine = Engine(model_dir, EngineConfig(device="cpu", dtype="float32", **config))
    sequences(engine)  # from the start: the loop releases each request once it has ended
    return PagechatApp(
        ThreadedEngine(engine), params=params, store=ChatStore(tmp_path / "chats"), layout="tabs"
    )


_RELEASED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sequences(engine) -> Mapping:
    """Every sequence the engine has run, by id: its live requests, then those it has released.
    The app's loop releases a request once it has ended and the app has been told; the tests
    compare what the app shows with the engine's own record, so they keep what it lets go."""
    if engine not in _RELEASED:
        kept = _RELEASED[engine] = {}
        requests = engine.requests
        release = requests.release

        def keeping(request_id: int):
            kept.update((c, requests[c]) for c in requests[request_id].children)
            kept[request_id] = release(request_id)
            return kept[request_id]

        requests.release = keeping
    return ChainMap(engine.requests, _RELEASED[engine])


async def wait_until(
    pilot: Pilot, predicate: Callable[[], bool], timeout: float = 30.0, what: str = ""
) -> None:
    """Poll predicate between short pauses (one pause is flaky for background work); TimeoutError
    after timeout."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate}")
        await pilot.pause(0.05)


async def type_prompt(pilot: Pilot, text: str) -> None:
    """Type text into the prompt box with real key presses and press Enter."""
    app: PagechatApp = pilot.app  # type: ignore[assignment]
    app.query_one("#prompt").focus()
    before = len(app.session.messages)
    await pilot.press(*["space" if c == " " else c for c in text])
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(app.session.messages) > before, 5, "the prompt to be sent")


async def wait_reply_done(pilot: Pilot, timeout: float = 60.0) -> None:
    """Wait until the last reply finished and the UI has drained every engine event."""
    app: PagechatApp = pilot.app  # type: ignore[assignment]

    def done() -> bool:
        msgs = app.session.messages
        return bool(msgs) and not msgs[-1].streaming and not app.frames.render_pending

    await wait_until(pilot, done, timeout, "the reply to finish")
    await pilot.pause(0.1)


async def wait_tokens(pilot: Pilot, n: int, timeout: float = 60.0) -> None:
    """Wait until the reply in flight has at least n tokens on screen."""
    app: PagechatApp = pilot.app  # type: ignore[assignment]

    def enough() -> bool:
        msg = app.session.messages[-1] if app.session.messages else None
        return msg is not None and (len(msg.tokens) >= n or not msg.streaming)

    await wait_until(pilot, enough, timeout, f"{n} reply tokens")


async def send_and_advance(pilot: Pilot, text: str, steps: int) -> None:
    """Pause the engine, send text, run exactly `steps` engine steps, and let the UI render them: a
    fixed mid-reply state."""
    app: PagechatApp = pilot.app  # type: ignore[assignment]
    app.loop.pause()
    await type_prompt(pilot, text)
    await advance(pilot, steps)


async def advance(pilot: Pilot, steps: int) -> None:
    """With the engine paused: run exactly `steps` engine steps and wait until the UI has drawn
    them."""
    app: PagechatApp = pilot.app  # type: ignore[assignment]
    app.loop.advance(steps)
    app.loop.sync(timeout=60)
    await wait_until(
        pilot, lambda: not app.frames.render_pending, 10, "the UI to draw the engine's events"
    )
    await pilot.pause(0.05)


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAIN = "from pagechat.cli.main import main; main()"


@contextmanager
def serve_process(model_dir: Path, port: int, *args: str) -> Iterator[subprocess.Popen]:
    """`pagechat serve MODEL --port PORT ARGS` as a real process, once it answers /health; it is
    killed on leaving (a test may kill it sooner)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, "serve", str(model_dir), "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):  # bounded: 60 s for torch's import and the model's load
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode())
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextmanager
def listening(app) -> Iterator[str]:
    """An ASGI app under a real uvicorn server on a free 127.0.0.1 port, in a thread; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", http="h11", lifespan="on", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


class Watcher:
    """Reads /pagechat/events on a thread, rebuilding the records as RemoteEngine does."""

    def __init__(self, url: str) -> None:
        self.events: list = []
        self.info: EngineInfo | None = None
        self.snapshot = None
        self._stop = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "no EngineInfo"

    def _read(self, url: str) -> None:
        with httpx.stream("GET", url + "/pagechat/events", timeout=30) as r:
            for line in r.iter_lines():
                if self._stop:
                    return
                if not line.startswith("data: "):
                    continue
                obj = loads(line[6:])
                if isinstance(obj, EngineInfo):
                    self.info, self.snapshot = obj, obj.blocks
                    self._ready.set()
                    continue
                evs, self.snapshot = unpack(obj, self.snapshot)
                self.events += evs

    def close(self) -> None:
        self._stop = True

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # a failed assert too: the stream ends, the server can shut down

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def ended(self) -> bool:
        """The server ended the stream."""
        return not self._thread.is_alive() and not self._stop
