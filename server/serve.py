"""`pagechat serve`: load the engine, build the application around it, run it under uvicorn."""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import zmq
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.events import EngineInfo
from pagechat.core.memory import weight_report
from pagechat.core.threads import EngineThread
from pagechat.server.app import ServerState, create_app
from pagechat.server.engine_loop import ServerLoop
from pagechat.server.kv_events import KVEventPublisher
from pagechat.server.metrics import ServerMetrics
from pagechat.server.prompts import Limits, PromptEncoder
from pagechat.server.watch import Watchers

SHUTDOWN_S = 3  # seconds requests and watchers get to end after Ctrl+C


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where the server listens, who may call it, and the model's name in the API."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # default: the model directory's name
    log_level: str = "info"
    kv_events: str | None = None  # publish prefix-cache events as vLLM does, on this ZMQ endpoint
    kv_events_replay: str | None = None  # and answer replay requests on this one
    kv_events_topic: str = ""


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server others can reach without a key, or None."""
    if api_key or is_loopback(host):
        return None
    return (
        f"WARNING: serving on {host} without --api-key: anyone who can reach this machine can "
        "use the model. Pass --api-key KEY (clients send it as a Bearer token), or bind to "
        "127.0.0.1."
    )


def kv_publisher(settings: ServerSettings) -> KVEventPublisher | None:
    """The KV-event publisher --kv-events asks for (one line when its endpoint cannot bind)."""
    if not settings.kv_events:
        return None
    try:
        return KVEventPublisher(
            settings.kv_events, settings.kv_events_replay, settings.kv_events_topic
        )
    except zmq.ZMQError as e:
        replay = settings.kv_events_replay
        where = settings.kv_events + (f" / {replay}" if replay else "")
        raise PagechatError(f"--kv-events: cannot bind {where}: {e}") from None


def build_state(
    engine: Engine, settings: ServerSettings, thread: EngineThread | None = None
) -> ServerState:
    """The routes' shared state around a loaded engine (thread: the one it was loaded on)."""
    name = settings.model_name or engine.model_dir.resolve().name.removesuffix(".gguf")
    info = EngineInfo.of(engine)
    num_blocks, block_size = len(info.blocks.blocks), info.blocks.block_size
    limits = Limits(engine.max_model_len, num_blocks * block_size, engine.spec.vocab_size)
    metrics = ServerMetrics(name, num_blocks)
    watchers = Watchers(info)
    return ServerState(
        loop=ServerLoop(engine, metrics, watchers, kv_publisher(settings), thread),
        metrics=metrics,
        watchers=watchers,
        encoder=PromptEncoder(engine.model_dir, limits),
        model_name=name,
        api_key=settings.api_key,
        max_n=engine.config.max_seqs,
    )


def load_state(model_dir: Path, config: EngineConfig, settings: ServerSettings) -> ServerState:
    """Load the engine and build the state on the thread its loop will run on (EngineThread):
    every torch op of the server's engine runs there, EngineInfo's roofline measure too."""
    thread = EngineThread()
    try:
        return thread.submit(
            lambda: build_state(Engine(model_dir, config), settings, thread)
        ).result()
    except BaseException:  # a model that does not load, or Ctrl+C: no loop will run there
        thread.close()
        raise


def serve(model_dir: Path, config: EngineConfig, settings: ServerSettings) -> None:
    """Load the model and serve it until interrupted."""
    try:
        state = load_state(model_dir, config, settings)
    except KeyboardInterrupt:
        # Ctrl+C while the engine thread is inside torch's C++: the interpreter's exit under it
        # aborts the process ("terminate called without an active exception"); nothing is held
        sys.stderr.flush()
        os._exit(130)
    engine = state.loop.engine
    print(
        f"pagechat serve: {model_dir} as {state.model_name!r} ({engine.precision}, "
        f"{state.metrics.num_blocks} KV blocks of {engine.config.block_size} tokens) on "
        f"http://{settings.host}:{settings.port}/v1; weights: "
        f"{weight_report(engine.model).formats()}",
        file=sys.stderr,
    )
    warning = exposure_warning(settings.host, settings.api_key)
    if warning:
        print(f"\n\033[1;31m{warning}\033[0m\n", file=sys.stderr)
    uvicorn.run(
        create_app(state),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http="h11",  # its ASGI spec version makes Starlette watch for disconnects mid-stream
        # watchers' event streams never end by themselves: Ctrl+C closes them after this long
        timeout_graceful_shutdown=SHUTDOWN_S,
    )
