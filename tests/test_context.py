"""Long chats go on: the oldest turns leave the context (never the system prompt, never the new
question), or a full chat is refused in one line; in the app, with a marker and a meter."""

from __future__ import annotations

import pytest
from drive import tabs_app, tiny_model_dir, type_prompt, wait_reply_done
from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.tui.context import fit_turns, reply_room
from pagechat.tui.screens import status_line


def words(messages: list[dict]) -> list[int]:
    """A stand-in tokenizer: one token per word, two per message for its role."""
    return [0] * sum(2 + len(m["content"].split()) for m in messages)


def chat(turns: int, system: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for i in range(turns):
        msgs += [
            {"role": "user", "content": f"question {i} " + "w " * 6},
            {"role": "assistant", "content": f"answer {i} " + "w " * 6},
        ]
    return msgs + [{"role": "user", "content": "last one"}]


def test_a_chat_that_fits_is_sent_whole():
    msgs = chat(3)
    ids, dropped = fit_turns(msgs, words, context=200, room=10)
    assert dropped == 0 and len(ids) == len(words(msgs))


def test_the_oldest_turns_go_first_and_whole_with_a_quarter_of_the_context_to_spare():
    msgs = chat(5)  # 4 + 5 * 2 * 10 + 4 = 108 tokens
    ids, dropped = fit_turns(msgs, words, context=80, room=10)
    kept = msgs[:1] + msgs[1 + dropped :]
    assert dropped == 6 and kept[1]["content"].startswith("question 3")  # three turns went
    assert len(ids) == len(words(kept)) <= 80 - 10 - 20 < len(words(msgs[:1] + msgs[1 + 4 :]))


def test_the_new_question_and_the_system_prompt_always_stay():
    msgs = chat(2)
    ids, dropped = fit_turns(msgs, words, context=10, room=5)
    assert dropped == 4 and len(ids) == len(words([msgs[0], msgs[-1]]))  # too long: the engine's
    ids, dropped = fit_turns(chat(2, system=False), words, context=10, room=5)
    assert dropped == 4


def test_a_full_chat_set_to_refuse_says_so_in_one_line():
    with pytest.raises(PagechatError) as e:
        fit_turns(chat(5), words, context=80, room=10, when_full="refuse")
    assert str(e.value) == (
        "the chat is full: its next turn needs 108 tokens and 10 for the reply, and the context "
        "holds 80; Ctrl+N starts a new chat"
    )


def test_the_reply_keeps_room_but_at_most_a_quarter_of_the_context():
    assert reply_room(512, 512) == 128 and reply_room(40, 512) == 40 and reply_room(9, 2) == 1


@pytest.mark.anyio
async def test_a_long_chat_in_the_app_goes_on_with_a_marker_and_a_meter(tmp_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    app = tabs_app(tiny_model_dir(), tmp_path, params, max_model_len=160)
    async with app.run_test(size=(120, 36)) as pilot:
        s = app.session
        for i in range(12):
            await type_prompt(pilot, f"turn {i} please")
            await wait_reply_done(pilot)
            reply = s.messages[-1]
            assert reply.error is None and len(reply.tokens) == 16, reply.error
            assert s.context_used() <= 160
            if s.context_from:
                break
        assert s.context_from > 0 and s.messages[s.context_from].role == "user"
        marker = app.main.chat_log.query_one(".context-marker")
        assert f"the {s.context_from} messages above are out of the model's context" in str(
            marker.render()
        )
        line = status_line(app.loop.info, s, app.theme_variables).plain
        assert f"context {s.context_used()}/160 ({s.context_from} earlier messages out)" in line
        # the kept part is a prefix the cache serves: the next turn fits and hits it
        first = s.context_from
        await type_prompt(pilot, "and now")
        await wait_reply_done(pilot)
        reply = s.messages[-1]
        assert s.context_from == first and reply.timing.cached_tokens >= 16
        assert reply.timing.cached_tokens > reply.timing.prompt_tokens // 2


@pytest.mark.anyio
async def test_a_full_chat_set_to_refuse_says_start_a_new_one(tmp_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    app = tabs_app(tiny_model_dir(), tmp_path, params, max_model_len=96)
    app.turns.when_full = "refuse"
    async with app.run_test(size=(120, 36)) as pilot:
        for i in range(6):
            await type_prompt(pilot, f"turn {i} please")
            await wait_reply_done(pilot)
            if app.session.messages[-1].error:
                break
        reply = app.session.messages[-1]
        assert reply.error.startswith("the chat is full: its next turn needs ")
        assert reply.error.endswith("Ctrl+N starts a new chat") and app.session.context_from == 0


def test_run_takes_what_a_full_chat_does(tmp_path, capsys, monkeypatch):
    import pagechat.cli.launch as launch
    from conftest import cli
    from test_cli_errors import assert_one_line_error

    seen = []
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "open_app", lambda *args: seen.append(args[-1]) or 0)
    assert cli(["run", "--when-full", "refuse"], capsys)[0] == 0 and seen == ["refuse"]
    code, _, err = cli(["run", "--when-full", "sometimes"], capsys)
    assert_one_line_error(code, err, "--when-full must be drop or refuse, got 'sometimes'")
