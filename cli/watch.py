"""`pagechat watch URL [URL ...]` and `pagechat serve --watch`: find out which server answers at
URL and open the console that fits it: the app itself on a pagechat server (RemoteEngine), the
gauges of peers.py on vLLM, llama-server, SGLang or Ollama, those gauges and a block map from the
server's KV events with --kv-events, and with several URLs the fleet view."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq
from pagechat.core.errors import PagechatError
from pagechat.tools.http_client import server_url
from pagechat.tui.peers import KINDS, detect

READY_S = 600.0  # a served model this slow to load is given up on


@dataclass(frozen=True, slots=True)
class Events:
    """Where a server publishes its KV events (--kv-events and its companions)."""

    endpoint: str
    replay: str | None
    topic: str

    @classmethod
    def of(cls, endpoint: str | None, replay: str | None, topic: str) -> Events | None:
        if endpoint is None:
            if replay is not None:
                raise PagechatError("--kv-events-replay needs --kv-events")
            return None
        for flag, value in (("--kv-events", endpoint), ("--kv-events-replay", replay)):
            if value is not None:
                _check_endpoint(flag, value)
        return cls(endpoint, replay, topic)


def _check_endpoint(flag: str, endpoint: str) -> None:
    """A ZMQ endpoint a socket can connect to (tcp://HOST:PORT), or one line saying why not."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        raise PagechatError(
            f"{flag} {endpoint!r} is not a ZMQ endpoint (e.g. tcp://127.0.0.1:5557)"
        ) from None
    finally:
        sock.close(linger=0)


def watch(url: str, api_key: str | None, layout: str = "auto", events: Events | None = None) -> int:
    """Open the console on the server at url until it quits; returns the exit code."""
    if layout not in ("auto", "tabs", "grid"):
        raise PagechatError(f"--layout must be auto, tabs or grid, got {layout!r}")
    url = checked_url(url)
    kind, model = detect(url, api_key)
    if events is not None and kind in ("llamacpp", "ollama"):
        raise PagechatError(
            f"{url} is {KINDS[kind]}, which publishes no KV events (vLLM does with "
            "--kv-events-config, pagechat with serve --kv-events)"
        )
    if kind != "pagechat" or events is not None:
        from pagechat.tools.kv_events import EventFeed
        from pagechat.tui.peer_app import PeerApp

        feed = None if events is None else EventFeed(events.endpoint, events.replay, events.topic)
        PeerApp(url, kind, model, api_key, feed).run()
        return 0
    from pagechat.cli.launch import DEFAULT_PARAMS, say_where_it_went
    from pagechat.tui.app import PagechatApp
    from pagechat.tui.history import ChatRecord
    from pagechat.tui.remote import RemoteEngine

    client = RemoteEngine(url, api_key)
    note = (
        f"watching {url}: every client's requests are in the panels; this chat goes through its API"
    )
    try:
        app = PagechatApp(
            client,
            chat=ChatRecord(model=f"{url} {model}"),
            params=DEFAULT_PARAMS,
            layout=layout,
            notices=(note,),
        )
        app.run()
    finally:
        client.close()
    say_where_it_went(app.session, Path(model))
    return 0


def checked_url(url: str) -> str:
    """The server's base URL, or one line saying why `url` names no server."""
    if not url.startswith(("http://", "https://")):
        raise PagechatError(f"{url!r} is not a server's URL (http://HOST:PORT)")
    try:
        httpx.URL(url)
    except httpx.InvalidURL as e:
        raise PagechatError(f"{url!r} is not a server's URL: {e}") from None
    return server_url(url)


def watch_fleet(urls: list[str], api_key: str | None) -> int:
    """The fleet view on several servers until it quits (one not answering is shown gone)."""
    from pagechat.tui.fleet_app import FleetApp

    urls = [checked_url(u) for u in urls]
    twice = {u for u in urls if urls.count(u) > 1}
    if twice:
        raise PagechatError(f"{sorted(twice)[0]} is given twice")
    FleetApp(urls, api_key).run()
    return 0


def serve_and_watch(args: list[str], host: str, port: int, api_key: str | None) -> int:
    """`pagechat serve ... --watch`: the server in a child process (its log in a file), the console
    on it in this terminal; the server stops when the console quits."""
    if port == 0:
        raise PagechatError("--watch needs a --port to reach the server on (not 0)")
    fd, name = tempfile.mkstemp(prefix=f"pagechat-serve-{port}-", suffix=".log")
    log_path = Path(name)  # a new file of this user's: nothing else's is written over
    url = f"http://{_connectable(host)}:{port}"
    code = "from pagechat.cli.main import main; main()"
    with os.fdopen(fd, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", code, "serve", *args], stdout=log, stderr=log, env=os.environ
        )
    try:
        wait_ready(url, child, log_path)
        return watch(url, api_key)
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
        print(f"the server's log: {log_path}", file=sys.stderr)


def _connectable(host: str) -> str:
    """The host part of a URL that reaches a server listening on `host`."""
    if host in ("0.0.0.0", "::", ""):  # every interface: this machine's loopback is one
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def wait_ready(url: str, child: subprocess.Popen, log_path: Path) -> None:
    """Until the child server answers /health; its own last line when it exits first."""
    start = time.monotonic()
    print(f"starting the server on {url} (log: {log_path}) ...", file=sys.stderr)
    while time.monotonic() - start < READY_S:
        if child.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            last = lines[-1] if lines else f"exit code {child.returncode}"
            raise PagechatError(f"the server did not start: {last.removeprefix('error: ')}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise PagechatError(f"the server on {url} was not ready after {READY_S:.0f} s")
