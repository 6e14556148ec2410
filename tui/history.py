"""Saved chats: JSON files under $XDG_DATA_HOME/pagechat/chats, written atomically; Markdown
export; `pagechat history`."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams

FORMAT_VERSION = 1
PARAM_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "seed",
    "ignore_eos",
)


def data_dir() -> Path:
    """$XDG_DATA_HOME/pagechat, or ~/.local/share/pagechat when XDG_DATA_HOME is unset."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pagechat"


def chats_dir() -> Path:
    """Where autosaved chats live."""
    return data_dir() / "chats"


def new_chat_id() -> str:
    """A sortable, unique id: local time plus 4 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def params_to_dict(p: SamplingParams) -> dict:
    """The sampling settings a chat keeps (stop strings and candidate counts are app policy)."""
    return {k: getattr(p, k) for k in PARAM_FIELDS}


def params_from_dict(d: dict, base: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from a saved dict, unknown keys ignored, missing keys from base."""
    return replace(base or SamplingParams(), **{k: d[k] for k in PARAM_FIELDS if k in d})


@dataclass
class ChatRecord:
    """One saved conversation: messages, system prompt and the sampling settings it ran with."""

    id: str = field(default_factory=new_chat_id)
    model: str = ""
    system: str = ""
    params: dict = field(default_factory=dict)
    messages: list[dict] = field(
        default_factory=list
    )  # {"role", "content"[, "finish_reason", "stats"]}
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)

    @property
    def title(self) -> str:
        """The first user message, shortened to one line."""
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        line = " ".join(first.split())
        return line[:60] + ("…" if len(line) > 60 else "") if line else "(empty)"

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def to_json(self) -> str:
        return json.dumps({"version": FORMAT_VERSION, **asdict(self)}, indent=1, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ChatRecord:
        d = json.loads(text)
        return cls(
            **{
                k: d[k]
                for k in ("id", "model", "system", "params", "messages", "created", "updated")
                if k in d
            }
        )

    def to_markdown(self) -> str:
        """The chat as a Markdown document: a heading per message, settings on top."""
        lines = [
            f"# pagechat chat {self.id}",
            "",
            f"- model: `{self.model}`",
            f"- created: {self.created}",
            "- params: " + ", ".join(f"{k}={v}" for k, v in self.params.items()),
            "",
        ]
        if self.system:
            lines += ["## System", "", self.system, ""]
        for m in self.messages:
            lines += [f"## {m['role'].capitalize()}", "", m["content"], ""]
            if m.get("finish_reason") == "abort":
                lines += ["*(stopped)*", ""]
        return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file beside it and a rename: a crash leaves old or new,
    never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ChatStore:
    """The directory of autosaved chats."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or chats_dir()

    def path(self, chat_id: str) -> Path:
        return self.root / f"{chat_id}.json"

    def save(self, chat: ChatRecord, extra: Path | None = None) -> Path:
        """Autosave the chat (and write it to `extra` too, for --save)."""
        chat.updated = now_iso()
        text = chat.to_json()
        write_atomic(self.path(chat.id), text)
        if extra is not None:
            write_atomic(extra, text)
        return self.path(chat.id)

    def load(self, chat_id: str) -> ChatRecord:
        """A saved chat by id (or unique id prefix); a missing one is a PagechatError saying what
        to run."""
        path = self.path(chat_id)
        if not path.is_file():
            matches = (
                sorted(self.root.glob(f"{chat_id}*.json")) if self.root.is_dir() and chat_id else []
            )
            if len(matches) != 1:
                why = "is ambiguous" if matches else "was not found"
                raise PagechatError(
                    f"chat {chat_id!r} {why} in {self.root}; `pagechat history` lists saved chats"
                )
            path = matches[0]
        try:
            return ChatRecord.from_json(path.read_text(encoding="utf-8"))
        except (ValueError, TypeError, KeyError) as e:
            raise PagechatError(f"cannot read saved chat {path}: {e}") from None

    def list(self) -> list[ChatRecord]:
        """Every readable saved chat, most recently updated first (unreadable files are skipped)."""
        chats = []
        for path in self.root.glob("*.json") if self.root.is_dir() else ():
            try:
                chats.append(ChatRecord.from_json(path.read_text(encoding="utf-8")))
            except (ValueError, TypeError, KeyError, OSError):
                continue
        return sorted(chats, key=lambda c: (c.updated, c.id), reverse=True)


def export_markdown(chat: ChatRecord, directory: Path | None = None) -> Path:
    """Write the chat as Markdown into directory (default: the current one, else the data dir);
    returns the path."""
    name = f"pagechat-{chat.id}.md"
    for d in [directory] if directory else [Path.cwd(), data_dir() / "exports"]:
        try:
            path = d / name
            write_atomic(path, chat.to_markdown())
            return path
        except OSError:
            continue
    raise PagechatError(f"cannot write {name} to {directory or Path.cwd()}")


def print_history(store: ChatStore | None = None, as_json: bool = False) -> int:
    """`pagechat history`: one line per saved chat (or JSON); returns the exit code."""
    from rich.console import Console
    from rich.table import Table

    store = store or ChatStore()
    chats = store.list()
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "id": c.id,
                        "updated": c.updated,
                        "model": c.model,
                        "turns": c.turns,
                        "title": c.title,
                        "path": str(store.path(c.id)),
                    }
                    for c in chats
                ]
            )
        )
        return 0
    console = Console()
    if not chats:
        console.print(f"no saved chats in {store.root}; start one with `pagechat run`")
        return 0
    table = Table(title=f"saved chats in {store.root}", title_justify="left", box=None)
    for col in ("id", "updated", "turns", "model", "first message"):
        table.add_column(col, no_wrap=col != "first message", overflow="fold")
    for c in chats:
        table.add_row(c.id, c.updated.replace("T", " "), str(c.turns), Path(c.model).name, c.title)
    console.print(table)
    console.print("resume one with: pagechat run MODEL_DIR --resume ID", style="dim")
    return 0
