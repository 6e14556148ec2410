"""RemoteEngine: the app on a running `pagechat serve`, as `pagechat watch URL` opens it.

The records come from the server's GET /pagechat/events (the very records `pagechat run` reads
from its engine process, as JSON: core/wire.py), so the panels show every client's requests. The
chat goes through the OpenAI API like any other client's; it names each request with an
X-Request-Id, so the app finds its own among the server's when the server says it started.

What a server's watcher cannot do is refused in one line: a branch (the API takes no prefix of
the reply), beam search, changing the settings of a reply in flight (they apply from the next
message), pausing or stepping the engine, speculation settings (the server's own flags).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import httpx
from pagechat.core.errors import PagechatError, one_line
from pagechat.core.events import EngineInfo, Started
from pagechat.core.params import SamplingParams
from pagechat.core.wire import SILENT_S, loads, unpack
from pagechat.tools.http_client import client, error_message, server_url
from pagechat.tui.client import EngineClient
from pagechat.tui.load import LoadPlan, load_params, load_prompt
from pagechat.tui.protocol import (
    Abort,
    Close,
    Command,
    LoadSet,
    ParamsApplied,
    Refused,
    Send,
    StartLoad,
    Stop,
    StopLoad,
    Sync,
    Synced,
    UpdateParams,
)

CONNECT_S = 5.0
READ_S = 10.0  # the event stream's heartbeat comes every BEAT_S; a reply may wait longer in line


def api_fields(params: SamplingParams, context: int) -> dict:
    """A request body's sampling fields for these settings (vLLM's names for the extras). A limit
    as long as the whole context is left out: the server then gives the reply all the room the
    prompt leaves, as the app's own engine does (a server refuses a prompt plus max_tokens that
    does not fit, as OpenAI's and vLLM's do)."""
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": params.max_tokens if params.max_tokens < context else None,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "ignore_eos": params.ignore_eos,
    }


class RemoteEngine(EngineClient):
    """A pagechat server's records, and chats through its API."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        """Connect to the server's event stream and read its EngineInfo; raises PagechatError
        when the server cannot be reached or is not a pagechat server."""
        self.url, self.api_key = server_url(url), api_key
        self._http = self._client(READ_S)
        try:
            self.model = self._http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            self._events = self._http.send(
                self._http.build_request("GET", "/pagechat/events"), stream=True
            )
            if self._events.status_code != 200:
                why = error_message(self._events)
                raise PagechatError(f"{self.url}/pagechat/events: {why}")
            self._lines = self._events.iter_lines()
            info = loads(next(line[6:] for line in self._lines if line.startswith("data: ")))
            if not isinstance(info, EngineInfo):
                raise ValueError("/pagechat/events did not start with an EngineInfo")
        except (httpx.HTTPError, StopIteration, ValueError, KeyError, IndexError) as e:
            self._http.close()
            raise PagechatError(f"cannot watch {self.url}: {one_line(e)}") from None
        super().__init__(info)
        self._snapshot = info.blocks
        self._heard = time.monotonic()
        self._why: str | None = None  # why the event stream ended
        self._reader = threading.Thread(target=self._read, name="pagechat-watch", daemon=True)
        self._lock = threading.Lock()
        self._mine: dict[str, int] = {}  # response id -> the app's ticket
        self._load_names: dict[str, str] = {}  # response id -> "load k"
        self._streams: dict[str, httpx.Response] = {}  # response id -> its open response
        self._cancelled: set[str] = set()  # stopped before their response was open
        self._reply: list[str] = []  # the reply in flight: its requests' response ids
        self._load_run = 0  # bumped by each StartLoad and StopLoad: an older load's thread ends

    def _client(self, read: float | None = None) -> httpx.Client:
        """A client of the server (one per thread that streams: each owns its connection); read:
        the longest silence it waits out (None: a reply, which may queue behind others)."""
        return client(self.url, self.api_key, httpx.Timeout(read, connect=CONNECT_S))

    def start(self) -> RemoteEngine:
        self._reader.start()
        return self

    # -- the events --------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            for line in self._lines:
                self._heard = time.monotonic()
                if line.startswith("data: "):
                    events, self._snapshot = unpack(loads(line[6:]), self._snapshot)
                    for ev in events:
                        self._deliver(self._named(ev) if isinstance(ev, Started) else ev)
            self._why = "the server ended the event stream"
        except (httpx.HTTPError, ValueError) as e:
            self._why = one_line(e)

    def _named(self, ev: Started) -> Started:
        """A request the server started, as the app knows it: its own chat reply by its ticket,
        its load by its number."""
        with self._lock:
            ticket = self._mine.pop(ev.ref, None)
            label = self._load_names.pop(ev.ref, None)
        if ticket is not None:
            return replace(ev, ticket=ticket, label="chat")
        if label is not None:
            return replace(ev, label=label)
        return ev

    # -- the API -----------------------------------------------------------------------------------
    def _request(self, body: dict, ticket: int | None, name: str | None = None) -> str:
        """Start a streamed chat request on a thread; returns its response id."""
        rid = uuid.uuid4().hex
        ref = f"chatcmpl-{rid}"
        with self._lock:
            if ticket is not None:
                self._mine[ref] = ticket
            if name is not None:
                self._load_names[ref] = name
        thread = threading.Thread(
            target=self._stream, args=(body, rid, ref, ticket), daemon=True, name="pagechat-chat"
        )
        thread.start()
        return ref

    def _stream(self, body: dict, rid: str, ref: str, ticket: int | None) -> None:
        """Read a request's stream to its end (its text reaches the app as the server's records);
        closing it from another thread aborts the request on the server."""
        http = self._client()
        request = http.build_request(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}
        )
        try:
            response = http.send(request, stream=True)
            with self._lock:
                self._streams[ref] = response
                if ref in self._cancelled:  # Stop came while it was being sent
                    self._cancelled.discard(ref)
                    response.close()
            try:
                if response.status_code != 200:
                    self._refuse(ref, ticket, error_message(response))
                    return
                for _ in response.iter_lines():
                    pass
            finally:
                response.close()
        except (httpx.HTTPError, RuntimeError) as e:  # closed by Stop, or the server went away
            if ticket is not None and not self._closed:
                self._refuse(ref, ticket, one_line(e))
        finally:
            http.close()
            with self._lock:
                self._streams.pop(ref, None)
                self._load_names.pop(ref, None)
                self._cancelled.discard(ref)

    def _refuse(self, ref: str, ticket: int | None, message: str) -> None:
        with self._lock:
            mine = self._mine.pop(ref, None) is not None
        if ticket is not None and mine:  # not started: the server refused it
            self._deliver(Refused(ticket, f"the server refused it: {message}"))

    def _close_streams(self, refs) -> None:
        """Close these requests' streams (the server aborts them); one still being sent is
        closed as soon as its response opens."""
        with self._lock:
            streams = [self._streams.get(r) for r in refs]
            self._cancelled.update(r for r, s in zip(refs, streams) if s is None)
        for response in streams:
            if response is not None:
                response.close()

    def _send(self, cmd: Send) -> None:
        if cmd.prefix:
            self._deliver(
                Refused(cmd.ticket, "a served chat cannot branch: the API has no reply prefix")
            )
            return
        if cmd.params.beam_width > 1:
            self._deliver(Refused(cmd.ticket, "beam search is not part of the OpenAI API"))
            return
        if not cmd.beside:
            self._close_streams(self._reply)
        body = {"model": self.model, "messages": cmd.messages, "stream": True}
        body.update(api_fields(cmd.params, self.info.memory.max_model_len))
        self._reply = [self._request(body, cmd.ticket)]

    def _start_load(self, cmd: StartLoad) -> None:
        """Background load through the API, as other clients would send it: `count` chat
        requests at `rate` a second from the built-in prompts."""
        self._load_run += 1
        run = self._load_run
        plan = LoadPlan(cmd.count, cmd.rate, time.perf_counter())
        self._deliver(LoadSet(cmd.count))

        def feed() -> None:
            while plan.left and self._load_run == run and not self._closed:
                due = plan.due(time.perf_counter())
                for k in due:
                    body = {"model": self.model, "messages": load_prompt(k), "stream": True}
                    params = load_params(k, cmd.max_tokens)
                    body.update(api_fields(params, self.info.memory.max_model_len))
                    self._request(body, None, f"load {k + 1}")
                if due:
                    self._deliver(LoadSet(plan.left))
                time.sleep(min(0.05, plan.wait(time.perf_counter())))

        threading.Thread(target=feed, daemon=True, name="pagechat-load").start()

    def _stop_load(self) -> None:
        self._load_run += 1
        with self._lock:
            refs = [r for r in self._streams if r not in self._reply and r not in self._mine]
        self._close_streams(refs)
        self._deliver(LoadSet(0))

    def _post(self, cmd: Command) -> None:
        if isinstance(cmd, Send):
            self._send(cmd)
        elif isinstance(cmd, Stop):
            self._close_streams(self._reply)
        elif isinstance(cmd, UpdateParams):  # the server takes settings with each request
            self._deliver(ParamsApplied(None, cmd.params, 0))
        elif isinstance(cmd, StartLoad):
            self._start_load(cmd)
        elif isinstance(cmd, StopLoad):
            self._stop_load()
        elif isinstance(cmd, Sync):
            self._deliver(Synced(cmd.n))
        elif isinstance(cmd, Close):
            self._shut()
        elif not isinstance(cmd, Abort):  # samples not kept end with their request
            what = type(cmd).__name__.lower()
            self._deliver(
                Refused(
                    None,
                    f"{what}: a server's engine runs on its own; its watchers only send requests",
                )
            )

    def _shut(self) -> None:
        self._load_run += 1
        with self._lock:
            streams = list(self._streams.values())
        for response in streams:
            response.close()
        self._events.close()

    # -- the transport's questions -----------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def _join(self, timeout: float) -> None:
        self._reader.join(timeout)
        self._http.close()

    def failure(self) -> str | None:
        if self._closed:
            return None
        if not self._reader.is_alive() and self._reader.ident is not None:
            return f"the server at {self.url} stopped sending: {self._why}"
        silent = time.monotonic() - self._heard
        if silent > SILENT_S:
            return f"the server at {self.url} stopped answering ({silent:.1f} s silent)"
        return None

    def restarted(self) -> RemoteEngine:
        return RemoteEngine(self.url, self.api_key)

    def abandon(self) -> None:
        self._closed = True
        self._shut()
        self._http.close()
