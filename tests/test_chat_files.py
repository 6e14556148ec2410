"""Nothing the user wrote is lost: chat files written atomically and read defensively, chat ids
that cannot leave the chats folder, save failures said truthfully (the app keeps the chat and
offers to export it), faithful per-reply history, and a real kill -9 of `pagechat run`."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pagechat.cli.launch as launch
import pytest
from conftest import cli
from drive import advance, tiny_model_dir, type_prompt, wait_reply_done, wait_until
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.tui.app import PagechatApp
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.export_screen import ExportScreen
from pagechat.tui.history import ChatRecord, ChatStore, model_fingerprint
from pagechat.tui.session import ChatSession

CHAT_ID = "20250101-120000-abcd"
BAD_ID = "is not valid: ids are letters, digits, '-', '_' and '.' (`pagechat history` lists them)"
DAMAGED = {  # file bytes -> what `history` and `--resume` say is wrong with them
    "empty": (b"", "the file is empty"),
    "blank": (b" \n\t", "the file is empty"),
    "bad json": (
        b'{"id": "x", "messages": [',
        "not valid JSON (Expecting value at line 1, column 26)",
    ),
    "invalid utf-8": (
        b'{"id": "x", "messages": []}\xff',
        "not valid UTF-8 (byte 0xff at offset 27)",
    ),
    "a list": (b"[1, 2]", "not a pagechat chat (a JSON list, not an object)"),
    "no messages": (b'{"id": "x"}', "not a pagechat chat (no list of messages)"),
    "bad message": (
        b'{"id": "x", "messages": [{"role": "user", "content": 3}]}',
        "not a pagechat chat (message 1 has no text content)",
    ),
    "id leaving the folder": (
        b'{"id": "../../etc/x", "messages": []}',
        "not a pagechat chat (id '../../etc/x' is not a chat id)",
    ),
    "newer format": (
        b'{"version": 9, "id": "x", "messages": []}',
        "written by a newer pagechat (format 9; this one reads 1 to 2)",
    ),
    "deep nesting": (b"[" * 100_000, "not valid JSON (nested too deeply)"),
    "bad constraint": (
        b'{"id": "x", "messages": [], "params": {"constraint": {"kind": 3}}}',
        "not a pagechat chat (params.constraint is not an object of text)",
    ),
}


def good_chat(**kw) -> ChatRecord:
    messages = [
        {"role": "user", "content": "What is a KV block?"},
        {"role": "assistant", "content": "Sixteen tokens.", "finish_reason": "stop"},
    ]
    return ChatRecord(**({"id": CHAT_ID, "model": "/m/tiny", "messages": messages} | kw))


def assert_error(code, err: str, message: str) -> None:
    """Exit code 2 and exactly one line on stderr: `error: message`; no traceback."""
    assert (code, err) == (2, f"error: {message}\n")


@pytest.fixture
def chats(tmp_path, monkeypatch) -> ChatStore:
    """An empty chats folder under a private XDG_DATA_HOME."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    store = ChatStore()
    store.root.mkdir(parents=True)
    return store


@pytest.fixture
def opened(monkeypatch) -> list[dict]:
    """Stand in for starting the engine and the app: record what `run` would open them with."""
    calls: list[dict] = []

    def fake_open(path, config, chat, params, store, save, layout, notices, when_full) -> int:
        calls.append(
            dict(
                path=path,
                config=config,
                chat=chat,
                params=params,
                save=save,
                notices=notices,
                when_full=when_full,
            )
        )
        return 0

    monkeypatch.setattr(launch, "open_app", fake_open)
    return calls


# -- damaged files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", DAMAGED)
def test_history_lists_a_damaged_file_as_unreadable_and_the_rest(case, chats, capsys):
    data, why = DAMAGED[case]
    chats.save(good_chat())
    (chats.root / "broken.json").write_bytes(data)
    code, out, err = cli(["history", "--json"], capsys)
    assert code == 0 and [c["id"] for c in json.loads(out)] == [CHAT_ID]
    assert err == f"unreadable chat file {chats.root / 'broken.json'}: {why} (skipped)\n"
    code, out, err = cli(["history"], capsys)
    assert code == 0 and CHAT_ID in out and "What is a KV block?" in out
    assert err.count("\n") == 1 and "Traceback" not in out + err


@pytest.mark.parametrize("case", DAMAGED)
def test_resuming_a_damaged_chat_is_one_line(case, chats, capsys, opened):
    data, why = DAMAGED[case]
    (chats.root / "broken.json").write_bytes(data)
    code, _, err = cli(["run", "--resume", "broken"], capsys)
    assert_error(code, err, f"cannot read saved chat {chats.root / 'broken.json'}: {why}")
    assert opened == []


def test_a_file_that_cannot_be_read_is_listed_too(chats, capsys):
    (chats.root / "folder.json").mkdir()
    code, out, err = cli(["history", "--json"], capsys)
    assert (code, out, err) == (
        0,
        "[]\n",
        f"unreadable chat file {chats.root / 'folder.json'}: Is a directory (skipped)\n",
    )


# -- chat ids --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chat_id",
    ["../x", "../../etc/passwd", "/etc/passwd", "", "a/b", ".hidden", "x*", "a b", "a\nb", "é"],
)
def test_a_chat_id_that_could_leave_the_chats_folder_is_refused(chat_id, chats, capsys, opened):
    code, _, err = cli(["run", "--resume", chat_id], capsys)
    assert_error(code, err, f"chat id {chat_id!r} {BAD_ID}")
    assert opened == [] and list(chats.root.iterdir()) == []


def test_an_unknown_or_ambiguous_id_says_what_to_run(chats, capsys, opened):
    chats.save(good_chat())
    chats.save(good_chat(id=CHAT_ID[:-1] + "e"))
    code, _, err = cli(["run", "--resume", "2024"], capsys)
    assert_error(
        code,
        err,
        f"chat '2024' was not found in {chats.root}; `pagechat history` lists saved chats",
    )
    code, _, err = cli(["run", "--resume", "2025"], capsys)
    assert_error(
        code, err, f"chat '2025' is ambiguous in {chats.root}; `pagechat history` lists saved chats"
    )


# -- --save and the chats folder -------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,message",
    [
        ("/nonexistent-dir/chat.json", "folder /nonexistent-dir does not exist"),
        ("/dev/null/chat.json", "/dev/null is not a folder"),
        ("/proc/chat.json", "cannot write in /proc (No such file or directory)"),
        ("/tmp", "is a folder; name a file such as /tmp/chat.json"),
    ],
)
def test_save_to_a_place_that_cannot_be_written_is_refused_at_start(
    target, message, chats, capsys, opened
):
    code, _, err = cli(["run", "--save", target], capsys)
    assert_error(code, err, f"--save {target}: {message}")
    assert opened == []


def test_save_into_a_read_only_folder_is_refused_at_start(chats, capsys, opened, monkeypatch):
    """Tests run as root, whom chmod does not stop: the folder says EROFS as a read-only mount
    would."""
    import tempfile

    def read_only(*args, dir=None, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    target = chats.root / "copy.json"
    code, _, err = cli(["run", "--save", str(target)], capsys)
    assert_error(
        code, err, f"--save {target}: cannot write in {chats.root} (Read-only file system)"
    )


def test_a_chats_folder_that_cannot_be_written_is_said_when_the_app_opens(
    tmp_path, monkeypatch, capsys, opened
):
    monkeypatch.setenv("XDG_DATA_HOME", "/dev/null/data")
    code, _, err = cli(["run"], capsys)
    assert (code, err) == (0, "")
    assert opened[0]["notices"] == (
        "cannot make /dev/null/data/pagechat/chats (Not a directory): this chat will not be "
        "saved there; Ctrl+O writes it where you say",
    )


# -- which model a resumed chat runs on ------------------------------------------------------------
@pytest.fixture
def models(tmp_path) -> tuple[Path, Path]:
    """Two checkpoints: the tiny llama, and a copy whose config differs."""
    own = tiny_model_dir()
    other = tmp_path / "other"
    shutil.copytree(own, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-5}))
    return own, other


def chat_made_on(model: Path) -> ChatRecord:
    made = {"model": str(model), "model_hash": model_fingerprint(model), "precision": "float32"}
    c = good_chat(model=str(model))
    c.messages[1]["produced_by"] = made
    return c


def test_resume_without_a_model_opens_the_chats_own_model(models, chats, capsys, opened):
    own, _ = models
    chats.save(chat_made_on(own))
    code, _, err = cli(["run", "--resume", CHAT_ID], capsys)
    assert (code, err) == (0, "") and opened[0]["path"] == own and opened[0]["notices"] == ()
    assert opened[0]["chat"].messages == chat_made_on(own).messages


def test_resume_on_another_model_says_so_or_refuses_with_strict(models, chats, capsys, opened):
    own, other = models
    chats.save(chat_made_on(own))
    said = (
        f"chat {CHAT_ID} ran on {own} ({model_fingerprint(own)}), not on {other} "
        f"({model_fingerprint(other)})"
    )
    code, _, err = cli(["run", str(other), "--resume", CHAT_ID], capsys)
    warning = f"{said}; its earlier replies keep the record of their model"
    assert (code, err) == (0, f"warning: {warning}\n") and opened[0]["notices"] == (warning,)
    assert opened[0]["path"] == other and opened[0]["chat"].model == str(other)
    code, _, err = cli(["run", str(other), "--resume", CHAT_ID, "--strict"], capsys)
    assert_error(
        code,
        err,
        f"{said}; run it without MODEL to use its own model, or without --strict to go on "
        "with this one",
    )
    assert len(opened) == 1
    code, _, err = cli(["run", str(own), "--resume", CHAT_ID, "--strict"], capsys)
    assert (code, err) == (0, "") and len(opened) == 2  # its own model: nothing to say


@pytest.mark.parametrize("answer,opens", [("n\n", False), ("\n", True), ("", False)])
def test_resume_on_another_model_in_a_terminal_asks(
    answer, opens, models, chats, capsys, opened, monkeypatch
):
    """On a terminal the warning is a question: Enter goes on, n (or end of input) does not."""
    own, other = models
    chats.save(chat_made_on(own))
    stdin = io.StringIO(answer)
    stdin.isatty = lambda: True
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = cli(["run", str(other), "--resume", CHAT_ID], capsys)
    assert f"go on with chat {CHAT_ID} on {other}? [Y/n]" in out
    assert (code, len(opened)) == ((0, 1) if opens else (1, 0))
    assert opens or err.endswith(f"chat {CHAT_ID} left as it was\n")
    assert chats.load(CHAT_ID).model == str(own)  # nothing is written before the app opens


def test_resume_of_a_chat_whose_model_is_gone(chats, capsys, opened):
    chats.save(good_chat(model="/gone/model"))
    code, _, err = cli(["run", "--resume", CHAT_ID], capsys)
    assert_error(
        code,
        err,
        f"chat {CHAT_ID} ran on /gone/model, which is not there any more; name a MODEL to "
        "continue it on another model",
    )


# -- writing ---------------------------------------------------------------------------------------
def test_a_crash_between_write_and_rename_leaves_the_old_file(chats, monkeypatch):
    chat = good_chat()
    path = chats.save(chat)
    old = path.read_bytes()
    chat.messages.append({"role": "user", "content": "and then?"})

    def crash(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError) as raised:
        chats.save(chat)
    assert (raised.value.filename, raised.value.strerror) == (str(path), "Read-only file system")
    assert path.read_bytes() == old and [p.name for p in chats.root.iterdir()] == [path.name]


def test_text_that_is_not_utf8_is_saved_and_read_back(chats):
    chat = good_chat(system="sys \udcfe")
    chat.messages[0]["content"] = "bytes \udcff\udcfe from a pasted file"
    path = chats.save(chat)
    path.read_bytes().decode("utf-8")  # the file itself is valid UTF-8
    back = chats.load(CHAT_ID)
    assert back.messages == chat.messages and back.system == "sys \udcfe"
    assert "bytes \ufffd\ufffd from" in back.to_markdown()


def test_a_prompt_that_is_not_utf8_never_breaks_autosave(chats):
    session = ChatSession(good_chat(), SamplingParams())
    session.add_user("pasted \udcff bytes")
    assert session.save(chats) is None and session.saved
    assert chats.load(CHAT_ID).messages[-1] == {"role": "user", "content": "pasted \udcff bytes"}


def test_a_session_whose_save_fails_says_so_keeps_a_copy_and_says_when_it_works_again(
    chats, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    session = ChatSession(good_chat(), SamplingParams())
    real = os.replace

    def read_only(src, dst):
        if Path(dst).parent == chats.root:
            raise OSError(errno.EROFS, "Read-only file system")
        real(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    note = session.save(chats)
    copy = tmp_path / f"pagechat-{CHAT_ID}.json"
    assert (note.severity, note.text) == (
        "error",
        f"chat NOT saved to {chats.path(CHAT_ID)}: Read-only file system; a copy is in {copy}. "
        "It stays in memory: Ctrl+O writes it to a path you type",
    )
    assert json.loads(copy.read_text())["messages"] == good_chat().messages
    assert session.save(chats) is None  # said once
    monkeypatch.setattr(os, "replace", real)
    note = session.save(chats)
    assert (note.severity, note.text) == (
        "information",
        f"chat saved again in {chats.path(CHAT_ID)}",
    )


# -- the app ---------------------------------------------------------------------------------------
SIZE = (120, 36)
PARAMS = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=7, ignore_eos=True)


def make_app(store: ChatStore, params: SamplingParams = PARAMS) -> PagechatApp:
    engine = Engine(tiny_model_dir(), EngineConfig(device="cpu", dtype="float32"))
    return PagechatApp(ThreadedEngine(engine), params=params, store=store, layout="tabs")


def notes(app: PagechatApp) -> list[tuple[str, str]]:
    return [(n.severity, n.message) for n in app._notifications]


@pytest.mark.anyio
async def test_the_app_says_a_save_failed_keeps_the_chat_and_exports_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(ChatStore(Path("/dev/null/chats")))
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "hello")
        await wait_reply_done(pilot)
        chat_id = app.session.record.id
        copy = tmp_path / f"pagechat-{chat_id}.json"
        failed = (
            f"chat NOT saved to /dev/null/chats/{chat_id}.json: Not a directory; a copy is in "
            f"{copy}. It stays in memory: Ctrl+O writes it to a path you type"
        )
        assert notes(app) == [("error", failed)]  # said once, though saved at send and at finish
        await type_prompt(pilot, "more")
        await wait_reply_done(pilot)
        assert notes(app) == [("error", failed)]
        kept = [m.as_dict() for m in app.session.messages]
        assert [m["role"] for m in kept] == ["user", "assistant", "user", "assistant"]
        assert json.loads(copy.read_text())["messages"] == kept
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, ExportScreen), 5, "the export box")
        assert app.screen.query_one("#export-path").value == str(copy)
        assert str(app.screen.query_one("#export-why").render()) == failed.split(". It")[0]
        await pilot.press("ctrl+u", *"/dev/null/x.json", "enter")
        error = app.screen.query_one("#export-error")
        assert (
            str(error.render())
            == "cannot write /dev/null/x.json: Not a directory; try another path"
        )
        await pilot.press("ctrl+u", *"mine.json", "enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, ExportScreen), 5, "it to close")
        assert notes(app)[-1] == ("information", f"chat written to {tmp_path / 'mine.json'}")
        assert json.loads((tmp_path / "mine.json").read_text())["messages"] == kept


@pytest.mark.anyio
async def test_each_reply_records_what_produced_it(tmp_path):
    store = ChatStore(tmp_path / "chats")
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        app.loop.pause()
        await type_prompt(pilot, "hello")
        await advance(pilot, 5)
        at = len(app.session.messages[-1].tokens)
        app.settings.set_params(replace(PARAMS, temperature=0.2))
        app.loop.resume()
        await wait_reply_done(pilot)
        await type_prompt(pilot, "again")
        await wait_reply_done(pilot)
    first, second = [m for m in store.load(app.session.record.id).messages if "stats" in m]
    params = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 40,
        "seed": 7,
        "ignore_eos": True,
        "n": 1,
        "beam_width": 1,
        "length_penalty": 1.0,
        "early_stopping": False,
    }
    engine = {
        "model": str(tiny_model_dir()),
        "model_hash": model_fingerprint(tiny_model_dir()),
        "precision": "float32",
        "quant": None,
        "device": "cpu",
        "proposer": None,
    }
    changed = [{"at_token": at, "params": params | {"temperature": 0.2}}]
    assert first["produced_by"] == engine | {"params": params, "changes": changed}
    assert second["produced_by"] == engine | {"params": params | {"temperature": 0.2}}
    assert first["stats"]["output_tokens"] == 40 and first["stats"]["total_ms"] > 0


# -- kill -9 mid-reply -----------------------------------------------------------------------------
SLOW_STEPS = """\
# Makes the engine's steps slow once a flag file exists, so that a reply is surely in flight
# when the test kills the app (the tiny model otherwise finishes a reply in milliseconds).
import os
import time

flag = os.environ.get("PAGECHAT_TEST_SLOW_FLAG")
if flag:
    from pagechat.core.engine import Engine

    step = Engine.step

    def slow_step(self):
        if os.path.exists(flag):
            time.sleep(0.2)
        return step(self)

    Engine.step = slow_step
"""


class Terminal:
    """`pagechat ARGS` in a pseudo-terminal; a thread keeps reading its screen output."""

    def __init__(self, args: list[str], env: dict) -> None:
        import fcntl
        import pty
        import struct
        import termios
        import threading

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the app, the leader of its own session and process group
            code = "from pagechat.cli.main import main; main()"
            os.execvpe(sys.executable, [sys.executable, "-c", code, *args], env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 36, 120, 0, 0))
        self.output = bytearray()
        self.status: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            self.output += data

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def send(self, text: str) -> None:
        """Type text into the prompt and, once it shows, press Enter (a "\\r" in the same burst
        of input may be taken as part of the text, not as the key)."""
        seen = len(self.output)
        self.type(text)
        poll(lambda: text in self.output[seen:].decode("utf-8", "replace"), 30, "typed text")
        time.sleep(0.3)
        self.type("\r")

    def kill(self) -> None:
        """SIGKILL to the app's process group: the app and the engine's process it started."""
        if self.status is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.wait(30)

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
            elif time.monotonic() > end:
                raise TimeoutError(f"pagechat still running after {timeout} s")
            else:
                time.sleep(0.1)
        return self.status

    def screen_text(self) -> str:
        return self.output.decode("utf-8", "replace")


def poll(predicate, timeout: float, what: str):
    """predicate's first truthy value, polled until timeout (then TimeoutError naming what)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def saved_messages(folder: Path) -> list[dict]:
    """The messages of the one chat file in folder ([] while there is none, or it is mid-write)."""
    files = list(folder.glob("*.json")) if folder.is_dir() else []
    try:
        return json.loads(files[0].read_text())["messages"] if files else []
    except (OSError, ValueError):
        return []


def test_kill_9_mid_reply_loses_only_the_reply_in_flight(tmp_path):
    model = tiny_model_dir()
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_STEPS)
    flag = tmp_path / "slow"
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), TERM="xterm-256color")
    env["PAGECHAT_TEST_SLOW_FLAG"] = str(flag)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    folder = tmp_path / "data" / "pagechat" / "chats"
    args = ["run", str(model), "--max-tokens", "60", "--ignore-eos", "--seed", "1"]
    app = Terminal([*args, "--layout", "tabs"], env)
    try:
        poll(lambda: "Enter sends" in app.screen_text(), 180, "the app to draw its prompt")
        app.send("first question")
        done = poll(
            lambda: [m for m in saved_messages(folder) if m.get("finish_reason") == "length"],
            120,
            "the first reply to be saved",
        )
        flag.touch()  # from now on each engine step takes 0.2 s: 60 tokens take 12 s
        app.send("second question")
        poll(lambda: len(saved_messages(folder)) == 3, 60, "the second question to be saved")
        time.sleep(1.5)  # a few tokens into the second reply
        app.kill()
    finally:
        app.kill()
    messages = saved_messages(folder)
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "first question"),
        ("assistant", done[0]["content"]),
        ("user", "second question"),
    ]
    assert messages[1]["stats"]["output_tokens"] == 60 and messages[1]["produced_by"]["model"]
    chat_id = next(folder.glob("*.json")).stem
    assert list(folder.iterdir()) == [folder / f"{chat_id}.json"]  # no temp file left behind

    flag.unlink()
    again = Terminal(["run", "--resume", chat_id, "--layout", "tabs"], env)  # its own model
    try:
        poll(lambda: "second question" in again.screen_text(), 180, "the resumed chat on screen")
        again.type("\x11")  # Ctrl+Q
        assert os.waitstatus_to_exitcode(again.wait(60)) == 0
    finally:
        again.kill()
    assert f"chat saved as {chat_id}" in again.screen_text()
    assert saved_messages(folder) == messages
