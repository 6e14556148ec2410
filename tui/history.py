"""Saved chats: JSON files under $XDG_DATA_HOME/pagechat/chats, written atomically and read
defensively (a damaged file is named and skipped); Markdown export; `pagechat history`."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.core.params import CONSTRAINTS, Constraint, SamplingParams
from pagechat.core.sources import resolve_model

FORMAT_VERSION = 2  # 2: each reply records what produced it ("produced_by"); 1 is read as well
PARAM_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "seed",
    "ignore_eos",
    "n",
    "beam_width",
    "length_penalty",
    "early_stopping",
)
# a chat id is a file name in the chats folder: no separators, no leading dot, nothing to glob
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
ROLES = ("system", "user", "assistant")
SURROGATE = re.compile("[\ud800-\udfff]")  # undecodable input bytes reach Python as these
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


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


def check_chat_id(chat_id: str) -> str:
    """Return chat_id when it can only name a file inside the chats folder; else PagechatError."""
    if not isinstance(chat_id, str) or not ID_PATTERN.fullmatch(chat_id):
        raise PagechatError(
            f"chat id {chat_id!r} is not valid: ids are letters, digits, '-', '_' and '.' "
            "(`pagechat history` lists them)"
        )
    return chat_id


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def printable(text: str) -> str:
    """text with lone surrogates shown as U+FFFD, so that a terminal or Markdown file takes it."""
    return SURROGATE.sub("\ufffd", text)


def params_to_dict(p: SamplingParams) -> dict:
    """The sampling settings a chat keeps (stop strings and candidate counts are app policy),
    and a constraint whole (its schema or grammar with it, so a resumed chat has it)."""
    d = {k: getattr(p, k) for k in PARAM_FIELDS}
    if p.constraint is not None:
        c = p.constraint
        d["constraint"] = {"kind": c.kind, "spec": c.spec, "source": c.source}
    return d


def params_from_dict(d: dict, base: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from a saved dict, unknown keys ignored, missing keys from base."""
    params = replace(base or SamplingParams(), **{k: d[k] for k in PARAM_FIELDS if k in d})
    c = d.get("constraint")
    if isinstance(c, dict) and c.get("kind") in CONSTRAINTS:
        constraint = Constraint(c["kind"], str(c.get("spec", "")), str(c.get("source", "")))
        params = replace(params, constraint=constraint)
    return params


def model_fingerprint(model_dir: str | Path) -> str:
    """A content hash of a checkpoint that costs no weight reads: config.json, any weights index,
    and each weights file's name and size; a GGUF file's (an Ollama model's: its blob, named by
    its own sha256) name and size ('' when it cannot be read)."""
    h = hashlib.sha256()
    try:
        root = resolve_model(Path(model_dir))
        if root.is_file():
            h.update(f"{root.name}\0{root.stat().st_size}\0".encode())
            return "sha256:" + h.hexdigest()[:16]
        for path in sorted(root.iterdir()):
            if path.name == "config.json" or path.name.endswith(".index.json"):
                h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
            elif path.suffix in WEIGHT_SUFFIXES and path.is_file():
                h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    except (OSError, PagechatError):
        return ""
    return "sha256:" + h.hexdigest()[:16]


@dataclass
class ChatRecord:
    """One saved conversation: messages, system prompt and the sampling settings it ran with."""

    id: str = field(default_factory=new_chat_id)
    model: str = ""  # the model it ran on last (what `--resume` without MODEL opens)
    system: str = ""
    params: dict = field(default_factory=dict)
    # {"role", "content"[, "finish_reason", "stats", "error", "produced_by"]}
    messages: list[dict] = field(default_factory=list)
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)

    @property
    def title(self) -> str:
        """The first user message, shortened to one line."""
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        line = " ".join(printable(first).split())
        return line[:60] + ("…" if len(line) > 60 else "") if line else "(empty)"

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def last_model(self) -> tuple[str, str]:
        """(path, fingerprint) of the model that produced the latest reply ('' where unknown)."""
        for m in reversed(self.messages):
            made = m.get("produced_by") or {}
            if made.get("model"):
                return str(made["model"]), str(made.get("model_hash") or "")
        return self.model, ""

    def to_json(self) -> str:
        """The file's text. Lone surrogates (undecodable input) are written as JSON escapes: the
        file stays valid UTF-8 and reads back the same string."""
        text = json.dumps({"version": FORMAT_VERSION, **asdict(self)}, indent=1, ensure_ascii=False)
        return SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)

    @classmethod
    def from_json(cls, text: str) -> ChatRecord:
        """Parse and check a chat file's text; ValueError says what is wrong, in a few words."""
        if not text.strip():
            raise ValueError("the file is empty")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            why = f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            raise ValueError(why) from None
        except RecursionError:
            raise ValueError("not valid JSON (nested too deeply)") from None
        check_shape(d)
        keys = ("id", "model", "system", "params", "messages", "created", "updated")
        return cls(**{k: d[k] for k in keys if k in d})

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
        return printable("\n".join(lines))


def check_shape(d: object) -> None:
    """Raise ValueError naming the first part of a parsed chat file that is not a pagechat chat."""

    def bad(what: str) -> ValueError:
        return ValueError(f"not a pagechat chat ({what})")

    if not isinstance(d, dict):
        raise bad(f"a JSON {type(d).__name__}, not an object")
    version = d.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise bad(f"version {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"written by a newer pagechat (format {version}; this one reads 1 to 2)")
    if not isinstance(d.get("messages"), list):
        raise bad("no list of messages")
    if not isinstance(d.get("id"), str) or not ID_PATTERN.fullmatch(d["id"]):
        raise bad(f"id {d.get('id')!r} is not a chat id")
    for key in ("model", "system", "created", "updated"):
        if not isinstance(d.get(key, ""), str):
            raise bad(f"{key} is not text")
    params = d.get("params", {})
    if not isinstance(params, dict) or not all(
        v is None or isinstance(v, int | float) for k, v in params.items() if k != "constraint"
    ):
        raise bad("params is not an object of numbers")
    constraint = params.get("constraint", {})
    if not isinstance(constraint, dict) or not all(isinstance(v, str) for v in constraint.values()):
        raise bad("params.constraint is not an object of text")
    for i, m in enumerate(d["messages"], 1):
        check_message(m, i, bad)


def check_message(m: object, i: int, bad) -> None:
    """A saved message: a known role, text content, and objects where stats and records go."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad(f"message {i} has no role of {', '.join(ROLES)}")
    if not isinstance(m.get("content"), str):
        raise bad(f"message {i} has no text content")
    for key in ("finish_reason", "error"):
        if not isinstance(m.get(key), str | None):
            raise bad(f"message {i}'s {key} is not text")
    stats = m.get("stats", {})
    if not isinstance(stats, dict) or not all(
        v is None or isinstance(v, int | float) for v in stats.values()
    ):
        raise bad(f"message {i}'s stats are not numbers")
    if not isinstance(m.get("produced_by", {}), dict):
        raise bad(f"message {i}'s produced_by is not an object")
    answers = m.get("answers", {})
    each = answers.get("each", []) if isinstance(answers, dict) else None
    kept = answers.get("kept") if isinstance(answers, dict) else None
    in_range = kept is None or type(kept) is int and (not each or 0 <= kept < len(each))
    if not isinstance(each, list) or not in_range:
        raise bad(f"message {i}'s answers are not a list with the index of the one kept")
    for a in each:
        check_message(a, i, bad)


def write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary file beside it (flushed, fsynced) and a rename: a
    crash leaves the old file or the new one, never half. An OSError names `path`."""
    tmp = None
    try:
        if path.parent.exists() and not path.parent.is_dir():  # mkdir would say "File exists"
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        sync_dir(path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def sync_dir(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a power cut (where the OS allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def check_writable(folder: Path, what: str) -> None:
    """PagechatError unless a file can be created in folder (a temporary one, removed again)."""
    if not folder.exists():
        raise PagechatError(f"{what}: folder {folder} does not exist")
    if not folder.is_dir():
        raise PagechatError(f"{what}: {folder} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pagechat-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise PagechatError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def check_save_path(path: Path) -> Path:
    """--save PATH: a file that can be written, in a folder that exists; else one line."""
    if path.is_dir():
        raise PagechatError(f"--save {path}: is a folder; name a file such as {path}/chat.json")
    check_writable(path.parent, f"--save {path}")
    return path


def read_chat(path: Path) -> ChatRecord:
    """A chat file, checked: PagechatError names the file and what is wrong with it."""
    try:
        data = path.read_bytes()
        chat = ChatRecord.from_json(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        why = f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
    except ValueError as e:
        why = str(e)
    except OSError as e:
        why = e.strerror or str(e)
    else:
        if ID_PATTERN.fullmatch(path.stem):
            chat.id = path.stem  # the file's name is the id it is resumed and saved under
        return chat
    raise PagechatError(f"cannot read saved chat {path}: {why}")


class ChatStore:
    """The directory of autosaved chats."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or chats_dir()

    def path(self, chat_id: str) -> Path:
        return self.root / f"{check_chat_id(chat_id)}.json"

    def save(self, chat: ChatRecord, extra: Path | None = None) -> Path:
        """Autosave the chat (and write it to `extra` too, for --save). Both are tried; the first
        OSError is raised after, naming its file."""
        chat.updated = now_iso()
        text = chat.to_json()
        errors = []
        for path in (self.path(chat.id), extra):
            try:
                if path is not None:
                    write_atomic(path, text)
            except OSError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return self.path(chat.id)

    def check_writable(self) -> None:
        """PagechatError unless chats can be saved here (the folder is made if missing)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PagechatError(f"cannot make {self.root} ({e.strerror or e})") from None
        check_writable(self.root, "chats folder")

    def load(self, chat_id: str) -> ChatRecord:
        """A saved chat by id (or unique id prefix); a missing or damaged one is a PagechatError
        saying what to run."""
        path = self.path(chat_id)
        if not path.is_file():
            matches = sorted(self.root.glob(f"{chat_id}*.json")) if self.root.is_dir() else []
            if len(matches) != 1:
                why = "is ambiguous" if matches else "was not found"
                raise PagechatError(
                    f"chat {chat_id!r} {why} in {self.root}; `pagechat history` lists saved chats"
                )
            path = matches[0]
        return read_chat(path)

    def scan(self) -> tuple[list[ChatRecord], list[tuple[Path, str]]]:
        """(readable chats, most recently updated first; (path, why) of each unreadable file)."""
        chats, bad = [], []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else ():
            try:
                chats.append(read_chat(path))
            except PagechatError as e:
                bad.append((path, str(e).removeprefix(f"cannot read saved chat {path}: ")))
        return sorted(chats, key=lambda c: (c.updated, c.id), reverse=True), bad

    def list(self) -> list[ChatRecord]:
        """Every readable saved chat, most recently updated first (unreadable files are skipped)."""
        return self.scan()[0]


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


def export_chat(chat: ChatRecord, path: Path) -> Path:
    """Write the chat to a path the user chose: Markdown for .md, else the chat file's JSON
    (which `--resume` reads once copied into the chats folder). OSError when it cannot."""
    path = path.expanduser().absolute()
    if path.is_dir():
        path = path / f"pagechat-{chat.id}.json"
    write_atomic(path, chat.to_markdown() if path.suffix == ".md" else chat.to_json())
    return path


def rescue_chat(chat: ChatRecord) -> Path | None:
    """When the chats folder cannot be written: a copy in the current folder, else the temporary
    one; None if neither takes it."""
    for folder in (Path.cwd(), Path(tempfile.gettempdir())):
        try:
            return export_chat(chat, folder / f"pagechat-{chat.id}.json")
        except OSError:
            continue
    return None


def print_history(store: ChatStore | None = None, as_json: bool = False) -> int:
    """`pagechat history`: one line per saved chat (or JSON), and one line on stderr per file that
    cannot be read; returns the exit code."""
    from rich.console import Console
    from rich.table import Table

    store = store or ChatStore()
    chats, unreadable = store.scan()
    for path, why in unreadable:
        print(f"unreadable chat file {path}: {why} (skipped)", file=sys.stderr)
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
        model = printable(Path(c.model).name)
        table.add_row(c.id, printable(c.updated.replace("T", " ")), str(c.turns), model, c.title)
    console.print(table)
    console.print(
        "resume one with: pagechat run --resume ID (on its own model) or "
        "pagechat run MODEL --resume ID",
        style="dim",
    )
    return 0
