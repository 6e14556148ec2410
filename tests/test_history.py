"""Saved chats: atomic JSON under XDG_DATA_HOME/pagechat, list, resume by id, Markdown, the CLI."""

from __future__ import annotations

import json
import os

import pytest
from conftest import cli
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.tui.history import (
    ChatRecord,
    ChatStore,
    chats_dir,
    export_markdown,
    params_from_dict,
    params_to_dict,
)
from pagechat.tui.session import ChatSession


def chat(**kw) -> ChatRecord:
    return ChatRecord(
        model="/m/tiny",
        system="be brief",
        messages=[
            {"role": "user", "content": "What is a KV block?"},
            {
                "role": "assistant",
                "content": "Sixteen tokens of keys and values.",
                "finish_reason": "stop",
            },
        ],
        **kw,
    )


def test_data_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert chats_dir() == tmp_path / "pagechat" / "chats"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert str(chats_dir()).endswith(".local/share/pagechat/chats")


def test_save_is_atomic_and_round_trips(tmp_path):
    store = ChatStore(tmp_path)
    c = chat()
    path = store.save(c, extra=tmp_path / "copy.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, "copy.json"]
    )  # no temp files left
    back = store.load(c.id)
    assert back.messages == c.messages and back.system == "be brief"
    assert json.loads((tmp_path / "copy.json").read_text())["id"] == c.id
    assert store.load(c.id[:15]).id == c.id  # a unique prefix is enough


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    store = ChatStore(tmp_path)
    c = chat()
    store.save(c)
    c.messages.append({"role": "user", "content": "more"})
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        store.save(c)
    assert len(store.load(c.id).messages) == 2 and [p.suffix for p in tmp_path.iterdir()] == [
        ".json"
    ]


def test_list_skips_unreadable_files_and_sorts_newest_first(tmp_path):
    store = ChatStore(tmp_path)
    a, b = chat(id="20250101-000000-aaaa"), chat(id="20250102-000000-bbbb")
    store.save(a)
    store.save(b)
    (tmp_path / "broken.json").write_text("{not json")
    assert [c.id for c in store.list()] == [b.id, a.id]
    with pytest.raises(PagechatError, match="pagechat history"):
        store.load("nope")


def test_params_round_trip_and_session_restores_messages():
    p = SamplingParams(temperature=0.3, top_p=0.8, top_k=5, seed=9)
    assert params_to_dict(params_from_dict(params_to_dict(p))) == params_to_dict(p)
    s = ChatSession(chat(params=params_to_dict(p)), SamplingParams())
    assert s.params.temperature == 0.3 and [m.role for m in s.messages] == ["user", "assistant"]
    assert s.conversation()[0] == {"role": "system", "content": "be brief"}


def test_markdown_export(tmp_path):
    path = export_markdown(chat(), tmp_path)
    text = path.read_text()
    assert (
        "## User\n\nWhat is a KV block?" in text and "## Assistant" in text and "be brief" in text
    )


def test_history_command_lists_saved_chats(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    code, out, _ = cli(["history"], capsys)
    assert code == 0 and "no saved chats" in out
    c = chat()
    ChatStore().save(c)
    code, out, _ = cli(["history", "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["id"] == c.id and json.loads(out)[0]["turns"] == 1
    code, out, _ = cli(["history"], capsys)
    assert c.id in out and "What is a KV block?" in out


def test_run_refuses_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    code, _, err = cli(["run", str(tmp_path / "missing")], capsys)
    assert code == 2 and err.startswith("error: model directory") and "make-model" in err
    code, _, err = cli(["run", str(tmp_path), "--resume", "nope", "--layout", "tabs"], capsys)
    assert code == 2 and "pagechat history" in err
    code, _, err = cli(["run", str(tmp_path), "--top-p", "2"], capsys)
    assert code == 2 and "top-p must be in (0, 1]" in err


def test_run_without_model_dir_uses_the_demo_or_says_how_to_make_a_model(
    monkeypatch, capsys, tmp_path
):
    import pagechat.tools.demo as demo

    assert demo.model_or_demo(None) == demo.chat_model_dir()
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)  # an install that lost its demo files
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    code, _, err = cli(["run"], capsys)
    assert code == 2 and "pagechat make-model" in err and len(err.strip().splitlines()) == 1


def test_saved_settings_keep_answers_and_beams():
    """A reply's record names how many answers it was asked for, and a resumed chat asks so too."""
    from pagechat.tui.history import params_from_dict, params_to_dict

    for p in (
        SamplingParams(n=4, seed=3),
        SamplingParams(beam_width=2, length_penalty=0.5, early_stopping="never"),
    ):
        saved = json.loads(json.dumps(params_to_dict(p)))
        assert params_from_dict(saved) == p
