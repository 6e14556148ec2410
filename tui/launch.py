"""`pagechat run`: find the model (or the demo), load the engine under a progress bar, open the app."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.demo import model_or_demo
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.tui.history import ChatRecord, ChatStore

DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512)


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def leave_a_core_for_the_ui() -> int | None:
    """Run torch's CPU thread pool on one core fewer than it would take, unless OMP_NUM_THREADS says otherwise.

    The UI thread needs a core of its own: with every core in torch's pool, each parallel op waits for the
    worker that the UI thread (or the terminal) has just preempted. Measured on the 2-core machine, demo
    model: 115-142 tok/s in the app with 2 threads, 201-252 with 1, ~250 headless either way. Returns the new
    thread count, if set.
    """
    import torch

    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or threads < 2:
        return None
    torch.set_num_threads(threads - 1)
    return threads - 1


def load_engine(model_dir: Path, config: EngineConfig):
    """Build the Engine while a rich progress bar shows what is loading and for how long."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pagechat.core.engine import Engine
    from pagechat.core.memory import fmt_bytes

    console = Console(stderr=True)
    label = f"loading {model_dir.name} ({fmt_bytes(weights_bytes(model_dir))} of safetensors)"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        progress.add_task(label, total=None)
        engine = Engine(model_dir, config)
    console.print(f"loaded {model_dir.name}: {engine.precision} on {engine.device}, "
                  f"{engine.blocks.num_blocks} KV blocks of {engine.blocks.block_size} tokens, "
                  f"{'decode graphs' if engine.graphs else 'eager'}", style="dim")
    return engine


def run_app(model_dir: Path | None, config: EngineConfig, overrides: dict, *, resume: str | None = None,
            save: Path | None = None, system: str | None = None, layout: str = "auto") -> int:
    """Open the app on the model; returns the exit code."""
    if layout not in ("auto", "tabs", "grid"):
        raise PagechatError(f"--layout must be auto, tabs or grid, got {layout!r}")
    path = model_or_demo(model_dir, config.quant)
    store = ChatStore()
    chat = store.load(resume) if resume else ChatRecord(model=str(path))
    if system is not None:
        chat.system = system
    params = replace(DEFAULT_PARAMS, **{k: v for k, v in overrides.items() if v is not None}).validate()
    if resume and chat.params:
        from pagechat.tui.history import params_from_dict

        params = replace(params_from_dict(chat.params, params), **{k: v for k, v in overrides.items()
                                                                    if v is not None}).validate()
    chat.params = {}
    engine = load_engine(path, config)
    if engine.device.type == "cpu" and (threads := leave_a_core_for_the_ui()):
        print(f"torch runs on {threads} CPU thread{'s' * (threads > 1)}, one core left to the app "
              "(set OMP_NUM_THREADS to choose)", file=sys.stderr)
    from pagechat.tui.app import PagechatApp

    app = PagechatApp(engine, chat=chat, params=params, store=store, save_path=save, layout=layout)
    app.run()
    if app.session.messages:
        print(f"chat saved as {app.session.record.id} (pagechat run {path} --resume {app.session.record.id})",
              file=sys.stderr)
    return 0
