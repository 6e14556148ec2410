"""`pagechat watch URL` and `pagechat serve --watch`: find out which server answers at URL and
open the console that fits it: the app itself on a pagechat server (RemoteEngine), the gauges of
peers.py on vLLM or llama.cpp's llama-server."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pagechat.core.errors import PagechatError
from pagechat.tools.http_client import model_card, server_url
from pagechat.tui.peers import KINDS

READY_S = 600.0  # a served model this slow to load is given up on


def detect(url: str, api_key: str | None = None) -> tuple[str, str]:
    """(kind, model) of the OpenAI-compatible server at url: its /v1/models says who owns the
    model (pagechat, vllm, llamacpp)."""
    card = model_card(url, api_key)
    kind = card.get("owned_by", "")
    if kind not in KINDS:
        raise PagechatError(
            f"{url} serves {card.get('id')!r} owned by {kind!r}; pagechat watches pagechat, vLLM "
            "and llama.cpp servers"
        )
    return kind, str(card.get("id"))


def watch(url: str, api_key: str | None, layout: str = "auto") -> int:
    """Open the console on the server at url until it quits; returns the exit code."""
    if layout not in ("auto", "tabs", "grid"):
        raise PagechatError(f"--layout must be auto, tabs or grid, got {layout!r}")
    url = server_url(url)
    kind, model = detect(url, api_key)
    if kind != "pagechat":
        from pagechat.tui.peer_app import PeerApp

        PeerApp(url, kind, model, api_key).run()
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
