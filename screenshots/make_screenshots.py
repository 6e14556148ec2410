"""Regenerate the README screenshots: `python screenshots/make_screenshots.py [--model DIR]`.

Drives the real app headless (Textual Pilot) on the demo chat model (speculating with the demo
draft), or on --model DIR (speculating by n-gram lookup), and writes SVGs here; PNGs too when
`rsvg-convert` is installed (Debian: librsvg2-bin). The console on a vLLM server is drawn only with
`--vllm URL` (a running vLLM server, which the script loads with requests while it watches; with
`--vllm-kv-events ENDPOINT [--vllm-kv-replay ENDPOINT]` its prefix-cache map from its KV events
too), the real model's samples only with `--gguf FILE` (SmolLM2-135M-Instruct's Q4_1 GGUF), the
fleet view only with `--fleet [URL ...]` (three demo servers, one stopped midway, and those).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.server.app import create_app
from pagechat.server.serve import ServerSettings, build_state
from pagechat.tools.demo import chat_model_dir, draft_model_dir
from pagechat.tools.kv_events import EventFeed
from pagechat.tui.app import PagechatApp
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.fleet_app import FleetApp
from pagechat.tui.history import ChatRecord, ChatStore
from pagechat.tui.load import load_prompt
from pagechat.tui.peer_app import PeerApp
from pagechat.tui.remote import RemoteEngine
from pagechat.tui.widgets.chat import PromptInput

OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(OUT.parent / "tests"))  # the Pilot helpers the tests drive the app with
from drive import (  # noqa: E402
    advance,
    listening,
    send_and_advance,
    type_prompt,
    wait_reply_done,
    wait_until,
)


def save(app: PagechatApp, name: str) -> None:
    """SVG from Textual, then PNG by rsvg-convert (xml:space keeps text runs' leading spaces)."""
    svg = OUT / f"{name}.svg"
    app.save_screenshot(svg.name, path=str(OUT))
    svg.write_text(svg.read_text().replace("<svg ", '<svg xml:space="preserve" ', 1))
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-o", str(svg.with_suffix(".png")), str(svg)], check=True)
    print("wrote", svg)


def make_app(
    model: Path, store: Path, params: SamplingParams, layout: str, **config
) -> PagechatApp:
    engine = Engine(model, EngineConfig(device="cpu", dtype="float32", **config))
    return PagechatApp(
        ThreadedEngine(engine),
        chat=ChatRecord(id="20250101-120000-demo", model=str(model)),
        params=params,
        store=ChatStore(store),
        layout=layout,
        autosave=False,
    )


async def quiet(pilot) -> None:
    pilot.app.query_one(PromptInput).cursor_blink = False
    pilot.app.notify = lambda *a, **k: None  # no toasts in the pictures


async def main_screen(model: Path, store: Path) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=120, seed=1)
    app = make_app(model, store, params, "grid")
    async with app.run_test(size=(180, 50)) as pilot:
        await quiet(pilot)
        await type_prompt(pilot, "What is a KV block?")
        await wait_reply_done(pilot)
        await send_and_advance(pilot, "What is the prefix cache?", 12)
        pilot.app.set_focus(None)
        await pilot.pause(0.3)
        save(app, "main")


async def sampling_screen(model: Path, store: Path) -> None:
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=6, max_tokens=40, seed=2, num_candidates=10
    )
    app = make_app(model, store, params, "tabs")
    async with app.run_test(size=(120, 36)) as pilot:
        await quiet(pilot)
        await type_prompt(pilot, "Tell me about copy-on-write.")
        await wait_reply_done(pilot)
        await pilot.press("ctrl+r", *["left"] * 6)
        await pilot.pause(0.3)
        save(app, "sampling")
        app.main.show_panel("memory")
        app.inspector.refresh_memory()
        await pilot.pause(0.3)
        save(app, "memory")


async def speculation_screen(model: Path, store: Path, speculation: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=80, seed=3)
    app = make_app(model, store, params, "tabs", num_draft=4, **speculation)
    async with app.run_test(size=(120, 36)) as pilot:
        await quiet(pilot)
        await type_prompt(pilot, "Explain speculative decoding.")
        await wait_reply_done(pilot)
        app.main.show_panel("speculation")
        await pilot.pause(0.3)
        save(app, "speculation")


async def samples_screen(model: Path, store: Path) -> None:
    """8 samples of one prompt decoding together in a small pool, mid-reply."""
    params = SamplingParams(temperature=1.5, top_p=1.0, max_tokens=60, seed=4)
    app = make_app(model, store, params, "grid", kv_blocks=96, block_size=4)
    async with app.run_test(size=(180, 50)) as pilot:
        await quiet(pilot)
        await pilot.press("f9", "f9", "f9")  # 1 -> 2 -> 4 -> 8 samples
        await send_and_advance(pilot, "Write a poem about blocks.", 16)
        pilot.app.set_focus(None)
        await pilot.pause(0.6)
        save(app, "samples")


async def real_samples_screen(gguf: Path, store: Path) -> None:
    """8 answers of a real model (SmolLM2-135M-Instruct's Q4_1 GGUF) to one question, sampled
    together from the prompt's blocks; the Memory panel names the file's formats."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=4)
    app = make_app(gguf, store, params, "grid")
    async with app.run_test(size=(180, 50)) as pilot:
        await quiet(pilot)
        await pilot.press("f9", "f9", "f9")  # 1 -> 2 -> 4 -> 8 samples
        await type_prompt(pilot, "What is the capital of France?")
        await wait_reply_done(pilot, 120)
        pilot.app.set_focus(None)
        await pilot.pause(0.6)
        save(app, "real-samples")


async def beams_screen(model: Path, store: Path) -> None:
    """A finished beam search of 4 beams: its hypotheses with their scores."""
    params = SamplingParams(temperature=0.0, max_tokens=40, seed=5)
    app = make_app(model, store, params, "tabs")
    async with app.run_test(size=(120, 36)) as pilot:
        await quiet(pilot)
        await pilot.press("f10", "f10")  # off -> 2 -> 4 beams
        await type_prompt(pilot, "What is the prefix cache?")
        await wait_reply_done(pilot)
        await pilot.press("alt+right")
        app.main.show_panel("sched")
        pilot.app.set_focus(None)
        await pilot.pause(0.3)
        save(app, "beams")


async def branches_screen(model: Path, store: Path) -> None:
    """Two branches of a reply decoding beside each other: one at its 6th token with the next
    candidate, one the turn asked again at another temperature; the history's blocks shared."""
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=8)
    app = make_app(model, store, params, "grid", kv_blocks=96, block_size=4)
    async with app.run_test(size=(180, 50)) as pilot:
        await quiet(pilot)
        await type_prompt(pilot, "Tell me about copy-on-write.")
        await wait_reply_done(pilot)
        app.loop.pause()
        reply = app.session.messages[-1]
        app.answers.branch(reply, 5)
        app.settings.set_params(SamplingParams(temperature=1.2, top_p=0.95, max_tokens=48, seed=9))
        app.answers.branch(reply.samples[0], -1)
        await advance(pilot, 10)
        pilot.app.set_focus(None)
        await pilot.pause(0.3)
        save(app, "branches")


async def load_screen(model: Path, store: Path) -> None:
    """Background load in a 64-block pool: batching, prefix hits and preemption, a chat among."""
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=60, seed=6)
    app = make_app(model, store, params, "grid", kv_blocks=64, block_size=4)
    async with app.run_test(size=(180, 50)) as pilot:
        await quiet(pilot)
        app.query_one("#ctl-load-count").value = "16"
        app.query_one("#ctl-load-rate").value = "100"  # all before the first step: the same picture
        app.loop.pause()
        await pilot.press("ctrl+l")
        await pilot.pause(0.5)
        await advance(pilot, 12)
        await type_prompt(pilot, "What is preemption?")
        await advance(pilot, 14)
        pilot.app.set_focus(None)
        await pilot.pause(0.3)
        save(app, "load")


def clients(
    url: str, model: str, count: int, max_tokens: int, system: str | None = None
) -> threading.Event:
    """Other clients of a server: `count` threads sending streamed chat requests of the built-in
    prompts one after another (under one system prompt, if given), until the event returned is
    set or the server goes."""
    stop = threading.Event()
    head = [{"role": "system", "content": system}] if system else []

    def client(k: int) -> None:
        while not stop.is_set():
            body = {
                "model": model,
                "messages": head + load_prompt(k),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                return
            k += count

    for k in range(count):
        threading.Thread(target=client, args=(k,), daemon=True).start()
    return stop


async def watch_screen(model: Path, store: Path) -> None:
    """`pagechat watch` on a pagechat server that six other clients load: their requests in the
    block map and scheduler (a 128-block pool), the console's own chat among them."""
    engine = Engine(model, EngineConfig(device="cpu", dtype="float32", kv_blocks=128, block_size=4))
    state = build_state(engine, ServerSettings(model_name="chat"))
    with listening(create_app(state)) as url:
        params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=200, seed=6)
        app = PagechatApp(
            RemoteEngine(url),
            chat=ChatRecord(id="20250101-120000-demo", model=f"{url} chat"),
            params=params,
            store=ChatStore(store),
            layout="grid",
            autosave=False,
        )
        async with app.run_test(size=(180, 50)) as pilot:
            await quiet(pilot)
            others = clients(url, "chat", 6, 120)
            await wait_until(pilot, lambda: len(app.sched.live) >= 6, 30, "the load")
            await type_prompt(pilot, "What is a KV cache?")
            await wait_until(pilot, lambda: len(app.session.messages[-1].tokens) >= 12, 30)
            pilot.app.set_focus(None)
            save(app, "watch")
            others.set()


async def vllm_screen(url: str) -> None:
    """The console on a running vLLM server, loaded by four clients for 25 polls."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    app = PeerApp(url, "vllm", model)
    async with app.run_test(size=(160, 40)) as pilot:
        others = clients(url, model, 4, 64)
        await wait_until(pilot, lambda: len(app.history) >= 25, 60, "25 polls")
        save(app, "watch-vllm")
        others.set()


SHARED_SYSTEM = (
    "You are the help desk of a small bookshop by the old port. It opens from nine to six, "
    "Tuesday to Saturday, and from ten to four on Sundays. Books may be returned within thirty "
    "days with the receipt. Answer in one or two short sentences."
)


async def vllm_events_screen(url: str, events: str, replay: str | None) -> None:
    """The console on a running vLLM server with its KV events: four clients under one system
    prompt, so their prefixes share its blocks."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    app = PeerApp(url, "vllm", model, events=EventFeed(events, replay))
    async with app.run_test(size=(180, 50)) as pilot:
        others = clients(url, model, 4, 48, SHARED_SYSTEM)

        def drawn() -> bool:
            v = app.cache_view
            return bool(v and len(v.chains) >= 8 and all(c.leaf in app.texts for c in v.chains[:8]))

        await wait_until(pilot, drawn, 120, "eight cached prefixes, named")
        await wait_until(pilot, lambda: len(app.history) >= 10, 60, "ten polls")
        save(app, "watch-vllm-events")
        others.set()


async def fleet_screen(model: Path, peers: list[str]) -> None:
    """The fleet view: three pagechat servers and the given peers under load, one pagechat
    server stopped midway (it stays in the table as gone)."""
    servers = []
    for _ in range(3):
        engine = Engine(model, EngineConfig(device="cpu", dtype="float32", kv_blocks=256))
        servers.append(
            listening(create_app(build_state(engine, ServerSettings(model_name="chat"))))
        )
    urls = [s.__enter__() for s in servers]
    stops = [clients(u, "chat", n, 64) for u, n in zip(urls, (4, 1, 1))]
    for peer in peers:
        stops.append(clients(peer, httpx.get(f"{peer}/v1/models").json()["data"][0]["id"], 2, 32))
    try:
        app = FleetApp([*urls, *peers])
        async with app.run_test(size=(200, 16)) as pilot:
            await wait_until(
                pilot, lambda: app.view and len(app.view.rows) == len(urls) + len(peers), 30
            )
            await pilot.pause(15)
            stops[2].set()
            servers[2].__exit__(None, None, None)
            await wait_until(pilot, lambda: not app.view.rows[2].up, 30, "the third server gone")
            await pilot.pause(3)
            save(app, "fleet")
    finally:
        for stop in stops:
            stop.set()
        for s in servers[:2]:
            s.__exit__(None, None, None)


async def run(
    model: Path,
    store: Path,
    speculation: dict,
    vllm: str | None,
    gguf: Path | None,
    events: tuple[str, str | None] | None,
    fleet: list[str] | None,
) -> None:
    if vllm:
        await vllm_screen(vllm)
        if events:
            await vllm_events_screen(vllm, *events)
    if fleet is not None:
        await fleet_screen(model, fleet)
    await watch_screen(model, store)
    await main_screen(model, store)
    await samples_screen(model, store)
    await beams_screen(model, store)
    await branches_screen(model, store)
    await load_screen(model, store)
    await sampling_screen(model, store)
    await speculation_screen(model, store, speculation)
    if gguf:  # last: its weights would count in the other pictures' RSS
        await real_samples_screen(gguf, store)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the demo chat model)")
    parser.add_argument("--vllm", help="a running vLLM server's URL: its console's screenshot too")
    parser.add_argument(
        "--gguf", type=Path, help="SmolLM2-135M-Instruct's GGUF: the real model's samples too"
    )
    parser.add_argument(
        "--vllm-kv-events", help="its KV events' endpoint: the prefix-cache map's screenshot too"
    )
    parser.add_argument("--vllm-kv-replay", help="and its replay endpoint")
    parser.add_argument(
        "--fleet",
        nargs="*",
        help="the fleet view's screenshot, with these servers' URLs beside three demo servers",
    )
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        speculation = {"ngram": True} if args.model else {"draft": str(draft_model_dir())}
        model = args.model or chat_model_dir()
        events = (args.vllm_kv_events, args.vllm_kv_replay) if args.vllm_kv_events else None
        asyncio.run(run(model, Path(tmp), speculation, args.vllm, args.gguf, events, args.fleet))
