"""`pagechat run`: find the model (the chat's own when resuming, or the demo), check where the
chat will be saved, start the engine's process under a progress bar, open the app."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError
from pagechat.core.gguf import split_parts
from pagechat.core.memory import fmt_bytes
from pagechat.core.params import SamplingParams
from pagechat.core.sources import check_model_dir, gguf_file, ollama_model
from pagechat.tools.demo import model_or_demo
from pagechat.tui.context import WHEN_FULL
from pagechat.tui.history import (
    ChatRecord,
    ChatStore,
    check_save_path,
    model_fingerprint,
    params_from_dict,
    rescue_chat,
)

DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512)


def weights_label(model_dir: Path) -> str:
    """What loading reads: '270 MiB of safetensors', '93.8 MiB of GGUF'."""
    gguf = gguf_file(model_dir)
    files, kind = (
        (split_parts(gguf), "GGUF") if gguf else (model_dir.glob("*.safetensors"), "safetensors")
    )
    return f"{fmt_bytes(sum(p.stat().st_size for p in files))} of {kind}"


def start_engine(model_dir: Path, config: EngineConfig):
    """Start the engine's process; wait under a progress bar until it has loaded the model."""
    from pagechat.tui.engine_process import EngineProcess
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    label = f"loading {model_dir.name} ({weights_label(model_dir)})"
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
        f"{'decode graphs' if i.graphs else 'eager'}; weights: {i.memory.weights.formats()}",
        style="dim",
    )
    return client


def chat_model(
    chat: ChatRecord | None, model_dir: Path | None, quant: str | None, strict: bool
) -> tuple[Path, str | None]:
    """(the model to run, a warning to show): the chat's own model when resuming without a
    MODEL; another model than the chat's is said (or refused with `strict`)."""
    if chat is None:
        return model_or_demo(model_dir, quant), None
    own, own_hash = chat.last_model()
    if model_dir is None:
        if not own:
            return model_or_demo(None, quant), None
        if not model_exists(Path(own)):
            raise PagechatError(
                f"chat {chat.id} ran on {own}, which is not there any more; name a MODEL "
                "to continue it on another model"
            )
        return Path(own), None
    path = model_or_demo(model_dir, quant)
    why = other_model(own, own_hash, path)
    if why is None:
        return path, None
    if strict:
        raise PagechatError(
            f"chat {chat.id} {why}; run it without MODEL to use its own model, or without "
            "--strict to go on with this one"
        )
    return path, f"chat {chat.id} {why}; its earlier replies keep the record of their model"


def model_system(path: Path) -> str | None:
    """A new chat's system prompt when --system gives none: an Ollama model's own, as `ollama
    run` starts with it."""
    ollama = ollama_model(path)
    return ollama.system.strip() if ollama is not None and ollama.system else None


def model_exists(path: Path) -> bool:
    """Whether a chat's model is still there (a directory, a GGUF file, an Ollama model)."""
    try:
        check_model_dir(path)
    except PagechatError:
        return False
    return True


def other_model(own: str, own_hash: str, path: Path) -> str | None:
    """How `path` differs from the model a chat ran on, in words; None when it is the same."""
    if not own:
        return None
    new_hash = model_fingerprint(path)
    if own_hash and new_hash:
        if own_hash == new_hash:
            return None  # the same files, wherever they are now
        if Path(own).resolve() == path.resolve():
            return f"ran on {own} ({own_hash}), whose files have changed since ({new_hash})"
        return f"ran on {own} ({own_hash}), not on {path} ({new_hash})"
    if Path(own).resolve() == path.resolve():
        return None
    return f"ran on {own}, not on {path}"


def confirm(question: str) -> bool:
    """Ask on the terminal; yes unless the answer starts with n (Ctrl+D or Ctrl+C: no)."""
    try:
        answer = input(f"{question} [Y/n] ")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return False
    return not answer.strip().lower().startswith("n")


def run_app(
    model_dir: Path | None,
    config: EngineConfig,
    overrides: dict,
    *,
    resume: str | None = None,
    save: Path | None = None,
    system: str | None = None,
    layout: str = "auto",
    strict: bool = False,
    when_full: str = "drop",
) -> int:
    """Open the app on the model; returns the exit code. Everything that can be refused is checked
    before the model loads."""
    if layout not in ("auto", "tabs", "grid"):
        raise PagechatError(f"--layout must be auto, tabs or grid, got {layout!r}")
    if when_full not in WHEN_FULL:
        raise PagechatError(f"--when-full must be drop or refuse, got {when_full!r}")
    store = ChatStore()
    resumed = store.load(resume) if resume is not None else None
    path, warning = chat_model(resumed, model_dir, config.quant, strict)
    if save is not None:
        check_save_path(save)
    chat = resumed or ChatRecord()
    chat.model = str(path)  # the model it runs on now, which `--resume` alone opens next time
    if resumed is None:
        system = model_system(path) if system is None else system
    if system is not None:
        chat.system = system
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        params = replace(params_from_dict(chat.params, DEFAULT_PARAMS), **given).validate()
    except PagechatError as e:
        raise PagechatError(f"saved chat {chat.id}: {e}") from None
    chat.params = {}
    notices = [warning] if warning else []
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
        if sys.stdin.isatty() and not confirm(f"go on with chat {chat.id} on {path}?"):
            print(f"chat {chat.id} left as it was", file=sys.stderr)
            return 1
    try:
        store.check_writable()
    except PagechatError as e:
        notices.append(f"{e}: this chat will not be saved there; Ctrl+O writes it where you say")
    return open_app(path, config, chat, params, store, save, layout, tuple(notices), when_full)


def open_app(path, config, chat, params, store, save, layout, notices, when_full="drop") -> int:
    """Start the engine, run the app until it quits, and say where the chat went."""
    from pagechat.tui.session import engine_facts

    client = start_engine(path, config)
    try:
        from pagechat.tui.app import PagechatApp

        facts = engine_facts(client.info, config.draft)
        app = PagechatApp(
            client,
            chat=chat,
            params=params,
            store=store,
            save_path=save,
            layout=layout,
            facts=facts,
            notices=notices,
            when_full=when_full,
        )
        app.run()
    finally:
        client.close()
    say_where_it_went(app.session, path)
    return 0


def say_where_it_went(session, path: Path) -> None:
    """The last line: where the chat is saved, or truthfully where it is not and where it went."""
    if not session.messages:
        return
    chat_id = session.record.id
    if session.save_error is not None:
        print(session.save_error, file=sys.stderr)
    if session.saved:
        print(f"chat saved as {chat_id} (pagechat run --resume {chat_id})", file=sys.stderr)
        return
    record = session.to_record()
    copy = rescue_chat(record)
    if copy is not None:
        print(f"the chat is in {copy}", file=sys.stderr)
        return
    print("no folder took a copy of the chat, so here it is:", file=sys.stderr)
    print(record.to_json())
