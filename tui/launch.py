"""`pagechat run`: find the model (or the demo), start the engine's process under a progress
bar, open the app."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.tools.demo import model_or_demo
from pagechat.tui.history import ChatRecord, ChatStore

DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512)


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def start_engine(model_dir: Path, config: EngineConfig):
    """Start the engine's process; wait under a progress bar until it has loaded the model."""
    from pagechat.core.memory import fmt_bytes
    from pagechat.tui.engine_process import EngineProcess
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    label = f"loading {model_dir.name} ({fmt_bytes(weights_bytes(model_dir))} of safetensors)"
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        progress.add_task(label, total=None)
        client = EngineProcess(model_dir, config)
    i = client.info
    threads = f", {i.threads} CPU thread{'s' * (i.threads > 1)}" if i.device.type == "cpu" else ""
    console.print(
        f"loaded {model_dir.name}: {i.precision} on {i.device}{threads} in process {client.pid}, "
        f"{i.memory.num_blocks} KV blocks of {i.memory.block_size} tokens, "
        f"{'decode graphs' if i.graphs else 'eager'}",
        style="dim",
    )
    return client


def run_app(
    model_dir: Path | None,
    config: EngineConfig,
    overrides: dict,
    *,
    resume: str | None = None,
    save: Path | None = None,
    system: str | None = None,
    layout: str = "auto",
) -> int:
    """Open the app on the model; returns the exit code."""
    if layout not in ("auto", "tabs", "grid"):
        raise PagechatError(f"--layout must be auto, tabs or grid, got {layout!r}")
    path = model_or_demo(model_dir, config.quant)
    store = ChatStore()
    chat = store.load(resume) if resume else ChatRecord(model=str(path))
    if system is not None:
        chat.system = system
    params = replace(
        DEFAULT_PARAMS, **{k: v for k, v in overrides.items() if v is not None}
    ).validate()
    if resume and chat.params:
        from pagechat.tui.history import params_from_dict

        params = replace(
            params_from_dict(chat.params, params),
            **{k: v for k, v in overrides.items() if v is not None},
        ).validate()
    chat.params = {}
    client = start_engine(path, config)
    try:
        from pagechat.tui.app import PagechatApp

        app = PagechatApp(
            client, chat=chat, params=params, store=store, save_path=save, layout=layout
        )
        app.run()
    finally:
        client.close()
    if app.session.messages:
        chat_id = app.session.record.id
        print(
            f"chat saved as {chat_id} (pagechat run {path} --resume {chat_id})",
            file=sys.stderr,
        )
    return 0
