"""The app driven with real key presses (Textual Pilot) on a tiny random model: every panel
shows the engine's records."""

from __future__ import annotations

from dataclasses import replace

import pytest
from drive import (
    advance,
    send_and_advance,
    sequences,
    tabs_app,
    type_prompt,
    wait_reply_done,
    wait_tokens,
    wait_until,
)
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from pagechat.tui.app import PagechatApp
from pagechat.tui.client import ThreadedEngine
from pagechat.tui.engine_process import EngineProcess
from pagechat.tui.history import ChatStore
from pagechat.tui.screens import HelpScreen
from pagechat.tui.widgets.blocks import FREE, BlockGrid, BlocksPanel
from pagechat.tui.widgets.chat import ChatLog, PromptInput, ReplyView, TokenView, printable
from pagechat.tui.widgets.controls import ControlsPanel
from pagechat.tui.widgets.panel import Readout
from pagechat.tui.widgets.sampling import SamplingPanel
from pagechat.tui.widgets.timing import TimingPanel
from rich.console import Console
from textual import events
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input, Static, Tabs

pytestmark = pytest.mark.anyio
SIZE = (120, 36)
LONG = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=400, seed=3, ignore_eos=True)


def make_app(model_dir, tmp_path, params: SamplingParams = LONG, **config) -> PagechatApp:
    return tabs_app(model_dir, tmp_path, params, **config)


def spy_reports(engine: Engine) -> list:
    """Record every StepReport the engine makes, independently of the app."""
    seen: list = []
    step = engine.step

    def recording_step():
        report = step()
        seen.append(report)
        return report

    engine.step = recording_step
    return seen


async def test_prompt_streams_a_reply(model_dir, tmp_path, monkeypatch):
    shown: list[tuple[bool, int, str]] = []  # what each repaint of a reply showed
    update_view = ReplyView.update_view

    def recording_update(view: ReplyView) -> None:
        update_view(view)
        body = str(view.query_one(".reply-body").render())
        shown.append((view.message.streaming, len(view.message.tokens), body))

    monkeypatch.setattr(ReplyView, "update_view", recording_update)
    app = make_app(model_dir, tmp_path, replace(LONG, max_tokens=60))
    async with app.run_test(size=SIZE) as pilot:
        # then step the engine a few tokens at a time, so every stage is seen on screen
        app.loop.pause()
        await type_prompt(pilot, "hello there")
        for _ in range(3):
            app.loop.advance(5)
            app.loop.sync()
            await wait_until(pilot, lambda: not app.frames.render_pending, 10, "a repaint")
        app.loop.resume()
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        seq = sequences(app.loop.engine)[reply.request_id]
        partial = [(n, body) for streaming, n, body in shown if streaming and 0 < n < 60]
        assert len({n for n, _ in partial}) >= 3, "the reply was not painted as it grew"
        texts = [
            (n, *body.rsplit("\n", 1)) for n, body in partial
        ]  # the streaming text, then its meta line
        assert all(
            printable(seq.text).startswith(text.rstrip("▌")) for _, text, _ in texts
        )  # a growing prefix
        assert all(meta.startswith(f"{n} tokens · generating") for n, _, meta in texts)
        assert reply.content == seq.text and len(reply.tokens) == 60
        assert [t.token_id for t in reply.tokens] == seq.output_ids
        view = app.query_one(ChatLog).views[id(reply)]
        assert view.has_class("-done") and reply.finish_reason == "length"
        assert (
            app.files.store.load(app.session.record.id).messages[-1]["content"] == seq.text
        )  # autosaved


async def test_a_long_streaming_reply_shows_its_last_screenful(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await send_and_advance(pilot, "hello there", 390)
        reply, log = app.session.messages[-1], app.query_one(ChatLog)
        view = log.views[id(reply)]
        body = view.query_one(".reply-body")
        note, *text, meta = str(body.render()).split("\n")
        assert reply.streaming and note.startswith("⋯ ") and "more lines above" in note
        assert (
            0 < body.size.height <= log.size.height
        )  # no taller than the chat: no re-layout per line
        squeeze = lambda t: "".join(t.split())  # noqa: E731 - wrapping drops the spaces at line breaks
        assert squeeze(printable(reply.content)).endswith(squeeze("".join(text)).rstrip("▌"))
        assert len(squeeze("".join(text))) < len(squeeze(reply.content)) and meta.startswith(
            f"{len(reply.tokens)} tokens"
        )
        app.loop.resume()
        await wait_reply_done(pilot)
        assert view.has_class("-done") and not body.display  # the whole reply, as Markdown
        await wait_until(
            pilot,
            lambda: log.scroll_y == log.max_scroll_y > 0,
            5,
            "the chat to follow the reply's end",
        )


@pytest.mark.parametrize("layout, size", [("tabs", (100, 30)), ("grid", (160, 45))])
async def test_a_streaming_reply_takes_the_room_below_its_prompt_with_no_layout_pass(
    model_dir, tmp_path, monkeypatch, layout, size
):
    layouts: list[int] = []  # Textual's whole-screen layout passes: the messages when each ran
    refresh_layout = Screen._refresh_layout

    def counting(screen, *args, **kwargs):
        layouts.append(len(app.session.messages))
        return refresh_layout(screen, *args, **kwargs)

    monkeypatch.setattr(Screen, "_refresh_layout", counting)
    app = make_app(model_dir, tmp_path)
    app.main.layout_mode = layout  # grid: every panel beside the chat, each redrawn per frame
    async with app.run_test(size=size) as pilot:
        assert app.screen.has_class(f"-{layout}")
        await send_and_advance(pilot, "an opening question", 10)
        app.action_stop()
        await wait_reply_done(pilot)
        await send_and_advance(
            pilot,
            "and a second question, long enough to wrap over two lines of the chat "
            "column beside the panels",
            1,
        )
        layouts.clear()
        for _ in range(7):  # 350 tokens: in tabs longer than the room, so the body shows its tail
            await advance(pilot, 50)
        assert layouts == []
        log, reply = app.query_one(ChatLog), app.session.messages[-1]
        view, user = log.views[id(reply)], log.views[id(app.session.messages[-2])]
        assert reply.streaming and len(reply.tokens) == 351
        assert (
            user.size.height > 1 and log.region.y < user.region.y
        )  # the question, whole, at the top...
        assert (
            view.region.bottom == log.region.bottom
        )  # ...and the reply down to the chat's bottom edge
        first_line = str(view.query_one(".reply-body").render()).split("\n")[0]
        assert ("more lines above" in first_line) == (layout == "tabs")
        app.action_stop()
        await wait_reply_done(pilot)


async def test_a_readout_asks_for_a_layout_only_when_its_height_can_change():
    class Two(App):
        def compose(self):
            yield Readout(id="fixed")
            yield Readout(id="auto")

        def on_mount(self):
            self.query_one("#fixed").styles.height = 2  # like the blocks panel's header

    app = Two()
    async with app.run_test(size=(20, 10)) as pilot:
        asked: list[tuple[str, bool]] = []
        for r in app.query(Readout):
            r.show("one line")
            update = r.update
            r.update = lambda text, layout, r=r, update=update: (
                asked.append((r.id, layout)),
                update(text, layout=layout),
            )
        await pilot.pause()
        for text in ("three\nlines\nnow", "a line long enough to wrap over three rows", "one"):
            for r in app.query(Readout):
                r.show(text)
            await pilot.pause()
        assert asked == [
            ("fixed", False),  # cut to its 2 rows, as before: nothing moves
            ("auto", True),
            ("fixed", False),
            ("auto", False),  # three rows again
            ("fixed", False),
            ("auto", True),
        ]


async def test_the_first_token_is_drawn_at_once_whatever_the_frame_budget(
    model_dir, tmp_path, monkeypatch
):
    # no frame is ever within budget...
    monkeypatch.setattr("pagechat.tui.frames.UI_CPU_BUDGET", 1e-9)
    # ...nor overdue while advance() waits (10 s)
    monkeypatch.setattr("pagechat.tui.frames.MAX_FRAME_GAP", 30.0)
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_advance(
            pilot, "hello", 1
        )  # waits until the UI has drawn the engine's events
        reply = app.session.messages[-1]
        assert reply.streaming and len(reply.tokens) == 1
        assert str(
            app.query_one(ChatLog).views[id(reply)].query_one(".reply-body").render()
        ).startswith(printable(reply.content))


async def test_temperature_change_mid_reply_applies_from_the_next_token(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_advance(pilot, "count", 4)
        reply = app.session.messages[-1]
        n = len(reply.tokens)
        app.action_focus_controls()
        await pilot.pause()
        await pilot.press(*"0.3", "enter")
        assert app.session.params.temperature == 0.3
        await advance(pilot, 4)
        temps = [t.record.params.temperature for t in reply.tokens]
        assert temps[:n] == [0.8] * n and set(temps[n:]) == {0.3}, (
            n,
            len(temps),
            reply.streaming,
            reply.finish_reason,
            reply.error,
            [note.message for note in app._notifications],  # the engine's refusals, if any
        )
        assert sequences(app.loop.engine)[reply.request_id].sampling.params.temperature == 0.3
        app.action_stop()
        await wait_reply_done(pilot)


async def test_block_panel_counts_equal_the_block_manager_while_decoding(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, block_size=4)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_advance(pilot, "blocks please", 1)
        for steps in (5, 20):
            await advance(pilot, steps)
            panel = app.query_one(BlocksPanel)
            truth = app.loop.engine.block_map.snapshot()
            shown = panel.snapshot
            for name in ("num_used", "num_cached", "num_free", "num_shared", "tokens_stored"):
                assert getattr(shown, name) == getattr(truth, name), name
            assert shown.blocks == truth.blocks
            assert f"used {truth.num_used}/{len(truth.blocks)}" in str(
                panel.query_one("#blocks-header").render()
            )
            grid = app.query_one(BlockGrid)
            assert (
                grid.fold == 1
                and sum(glyph != FREE for glyph, _ in grid._cells)
                == truth.num_used + truth.num_cached
            )
            assert app.session.streaming is not None  # still decoding
        app.action_stop()
        await wait_reply_done(pilot)


async def test_keys_of_one_read_reach_the_prompt_before_enter_sends_it(model_dir, tmp_path):
    """Keys that arrive in one read of the terminal (a paste it does not bracket, tmux send-keys
    "text" Enter) go into the app's queue together: Enter's priority binding must see the text
    typed ahead of it, and Alt+Enter's newline land after it."""
    app = make_app(model_dir, tmp_path, replace(LONG, max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#prompt").focus()
        await pilot.pause()
        for key, char in [("a", "a"), ("b", "b"), ("alt+enter", None), ("c", "c"), ("enter", "\r")]:
            app.post_message(events.Key(key, char))
        await wait_until(pilot, lambda: app.session.messages, 5, "the prompt to be sent")
        assert app.session.messages[0].content == "ab\nc"
        await wait_reply_done(pilot)


async def test_escape_stops_the_reply_and_keeps_its_text(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_advance(pilot, "go on", 5)
        await pilot.press("escape")
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        seq = sequences(app.loop.engine)[reply.request_id]
        assert reply.finish_reason == "abort" == seq.finish_reason
        assert reply.content == seq.text and 4 <= len(reply.tokens) < 400
        assert app.loop.engine.block_map.snapshot().num_used == 0
        assert app.files.store.load(app.session.record.id).messages[-1]["finish_reason"] == "abort"


async def test_the_app_on_an_engine_process(model_dir, tmp_path):
    """What `pagechat run` uses: reply, block map and memory readings from the child process."""
    config = EngineConfig(device="cpu", dtype="float32", kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = Engine(model_dir, config)  # the oracle: the same engine run in this process
    engine.requests.add(
        engine.requests.encode_chat([{"role": "user", "content": "hello there"}]), greedy
    )
    while engine.has_unfinished():
        engine.step()
    app = PagechatApp(
        EngineProcess(model_dir, config),
        params=greedy,
        store=ChatStore(tmp_path / "chats"),
        layout="tabs",
    )
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "hello there")
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        assert [t.token_id for t in reply.tokens] == engine.requests[0].output_ids
        assert reply.content == engine.requests[0].text and reply.finish_reason == "length"
        await wait_until(
            pilot,
            lambda: app.query_one(BlocksPanel).snapshot == engine.block_map.snapshot(),
            10,
            "the block map of the child's pool",
        )
        assert app.readings is not None and app.readings.rss > 0
        app.settings.set_params(replace(greedy, max_tokens=400))
        for _ in range(3):
            await type_prompt(pilot, "go on")
            await wait_tokens(pilot, 3)
            await pilot.press("escape")
            await wait_reply_done(pilot)
            last = app.session.messages[-1]
            if last.finish_reason != "length":
                break
            # the child decoded all 400 tokens (0.4 s on a fast CPU) before Escape reached it: a
            # fresh chat (the context holds one such reply), and again
            await pilot.press("ctrl+n")
        assert last.finish_reason == "abort" and 3 <= len(last.tokens) < 400
        await pilot.press("ctrl+n")
        await wait_until(
            pilot, lambda: app.query_one(BlocksPanel).snapshot.num_used == 0, 10, "blocks freed"
        )
        assert app.query_one(BlocksPanel).snapshot.num_cached > 0
    assert not app.loop.is_alive()  # the app closed its engine


async def test_ctrl_n_frees_the_chats_blocks_and_keeps_the_prefix_cache(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, block_size=4)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_advance(pilot, "a prompt long enough to fill some blocks", 6)
        rid = app.session.messages[-1].request_id
        assert any(rid in b.owners for b in app.loop.engine.block_map.snapshot().blocks)
        old_id = app.session.record.id
        await pilot.press("ctrl+n")
        await wait_until(
            pilot,
            lambda: app.query_one(BlocksPanel).snapshot.num_used == 0,
            10,
            "blocks freed on screen",
        )
        truth = app.loop.engine.block_map.snapshot()
        assert truth.num_used == 0 and not any(rid in b.owners for b in truth.blocks)
        assert truth.num_cached > 0  # the prompt's full blocks stay in the prefix cache
        assert app.session.record.id != old_id and not app.session.messages
        assert not app.query_one(ChatLog).children
        assert app.files.store.load(old_id).messages[-1]["finish_reason"] == "abort"


async def test_selecting_a_reply_token_shows_the_samplers_record(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(LONG, max_tokens=12, top_k=5))
    reports = spy_reports(app.loop.engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "pick one")
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        records = [s for r in reports for s in r.samples if s.seq_id == reply.request_id]
        panel = app.query_one(SamplingPanel)
        await pilot.press("ctrl+r", "left", "left")  # keyboard: the third token from the end
        await pilot.pause()
        assert app.main.active_panel == "sampling" and panel.record is records[-3]
        table = str(panel.query_one("#sampling-table").render())
        for c in records[-3].candidates:
            assert f"{c.logit:6.2f}" in table and f"{c.prob:.3f}" in table
        assert "cut top-k" in table  # candidates 6.. were cut by top-k=5
        await pilot.click(TokenView, offset=(0, 0))  # mouse: the first token
        await pilot.pause()
        assert app.query_one(ReplyView).selected == 0 and panel.record is records[0]
        await pilot.press("escape")  # unpin: back to the newest token
        assert panel.record is app.session.latest_sample


async def test_invalid_control_values_are_refused_inline(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        controls = app.query_one(ControlsPanel)
        app.query_one("#ctl-top_p").focus()
        await pilot.press(*"1.5", "enter")
        assert controls.error == "refused: top-p must be in (0, 1], got 1.5"
        assert (
            app.query_one("#ctl-top_p").has_class("-refused") and app.session.params.top_p == 0.95
        )
        app.query_one("#ctl-top_k").focus()
        await pilot.press(*"many", "enter")
        assert "top-k must be a whole number" in controls.error and app.session.params.top_k == 0
        app.query_one("#ctl-top_k").focus()
        await pilot.press("ctrl+u", *"7", "enter")  # a valid value clears the refusal
        assert controls.error == "" and app.session.params.top_k == 7
        app.query_one("#ctl-seed").focus()  # a seed no generator takes never reaches the engine
        await pilot.press("ctrl+u", *str(2**70), "enter")
        assert controls.error == f"refused: seed must be between 0 and 2^63 - 1, got {2**70}"
        app.query_one("#ctl-seed", Input).value = "1" * 5000  # more digits than int() reads
        await pilot.press("enter")
        assert controls.error.startswith("refused: seed must be a whole number, got '111")
        await type_prompt(pilot, "still answers")
        await wait_reply_done(pilot)
        assert app.session.messages[-1].error is None


async def test_engine_refusals_are_shown_and_the_app_stays_up(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, max_model_len=24)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(
            pilot, "this prompt is far too long for a context of only twenty four tokens"
        )
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        assert reply.finish_reason == "error" and "context is 24" in reply.error
        assert any("context is 24" in str(n.message) for n in app._notifications)
        await type_prompt(pilot, "short")  # still usable
        await wait_reply_done(pilot)
        assert app.session.messages[-1].finish_reason in ("stop", "length")


async def test_keys_nudge_params_help_and_resize(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    app.main.layout_mode = "auto"
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.screen.has_class("-tabs")
        await pilot.press("f6", "f6", "f7")
        assert app.session.params.temperature == 1.0 and app.session.params.top_p == 0.9
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.press("a", "ctrl+j", "b", "alt+enter")  # new lines, nothing sent
        assert prompt.text == "a\nb\n" and not app.session.messages
        prompt.clear()
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        console = Console(width=240, record=True)  # wide enough that no row wraps
        console.print(app.screen.query_one("#help-box Static", Static).content)
        shown = console.export_text()
        for b in Binding.make_bindings([*app.BINDINGS, *PromptInput.BINDINGS, *ReplyView.BINDINGS]):
            assert (b.tooltip or b.description) in shown, b  # every binding, in its own words
        assert "Ctrl+N" in shown and "Shift+Enter / Alt+Enter / Ctrl+J" in shown
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.resize_terminal(200, 50)
        assert app.screen.has_class("-grid")
        await pilot.resize_terminal(80, 20)  # below the supported 100x30: squeezed, but no crash
        await pilot.resize_terminal(100, 30)
        assert app.screen.has_class("-tabs")
        await pilot.press("f2")
        assert app.main.active_panel == "sampling" and app.query_one(SamplingPanel).display
        for _ in range(3):  # keys in one burst (as a terminal delivers them): each switch counts
            app.action_next_panel()
        await pilot.pause(0.2)
        assert app.main.active_panel == "memory" == app.query_one("#panel-tabs", Tabs).active
        await pilot.click("#panel-tabs Tab#timing")  # a click on a tab still switches
        await pilot.pause(0.2)
        assert app.main.active_panel == "timing" and app.query_one(TimingPanel).display


async def test_speculation_panel_shows_the_engines_draft_records(model_dir, tmp_path):
    engine = Engine(model_dir, EngineConfig(device="cpu", dtype="float32", ngram=True, num_draft=3))
    reports = spy_reports(engine)
    sequences(engine)  # before the loop releases the reply's request
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    app = PagechatApp(
        ThreadedEngine(engine), params=params, store=ChatStore(tmp_path / "chats"), layout="tabs"
    )
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "the the the the the the")
        await wait_reply_done(pilot)
        app.main.show_panel("speculation")
        await pilot.pause()
        seen_drafts = [d for r in reports for d in r.drafts]
        assert list(app.session.drafts) == seen_drafts and seen_drafts
        seq = sequences(engine)[app.session.messages[-1].request_id]
        text = str(app.query_one("#spec-summary").render())
        if seq.spec.drafted:
            assert f"acceptance {100 * seq.spec.acceptance_rate:.0f}%" in text
        assert app.session.speculation() == seq.spec  # the engine's totals, not a recount
        if seq.spec.emitted:
            assert f"({seq.spec.steps} fwd, {seq.spec.emitted} tok)" in text
        assert str(app.query_one("#spec-state").render()).startswith("on")
        app.main.show_panel("controls")
        await pilot.pause()
        await pilot.click("#ctl-spec")  # switch it off with the mouse
        await wait_until(pilot, lambda: not engine.speculate, 5, "speculation off")
        app.main.show_panel("speculation")
        await pilot.pause()
        assert str(app.query_one("#spec-state").render()).startswith("off")


async def test_a_pool_bigger_than_the_panel_is_folded_and_says_so(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, kv_blocks=6000)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        grid = app.query_one(BlockGrid)
        assert grid.fold > 1 and len(grid._cells) == -(-6000 // grid.fold)
        assert f"1 cell = {grid.fold} blocks" in str(app.query_one(BlocksPanel).border_title)
        titles = {
            c.title for c in app.get_system_commands(app.screen)
        }  # the command palette's entries
        assert {
            "New chat",
            "Stop reply",
            "Export Markdown",
            "Inspect reply tokens",
            "Help: keys",
        } <= titles


async def test_a_constraint_from_the_controls_holds_the_next_reply(model_dir, tmp_path):
    """A schema file typed in the Controls panel holds the next reply to it: the sampler's records
    name the grammar's cuts and the panel says what it allowed, the reply says it was held, the
    timing panel counts the masks, and the saved chat keeps the schema; a bad file is refused."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(schema))
    app = make_app(model_dir, tmp_path, replace(LONG, max_tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        controls = app.query_one(ControlsPanel)
        app.query_one("#ctl-constraint").focus()
        await pilot.press(*str(tmp_path / "nope.json"), "enter")
        assert controls.error.startswith("refused: cannot read")
        app.query_one("#ctl-constraint", Input).value = str(path)
        await pilot.press("enter")
        assert controls.error == "" and app.session.params.constraint.source == str(path)
        await type_prompt(pilot, "is it ok?")
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        if reply.finish_reason == "stop":
            jsonschema.validate(json.loads(reply.content), schema)
        assert reply.content.startswith("{")
        records = [t.record for t in reply.tokens if t.record is not None]
        assert records and all(r.allowed is not None for r in records)
        assert any(c.cut_by == "grammar" for r in records for c in r.candidates)
        assert "json schema ok.json" in str(app.query_one(ReplyView).meta_text())
        await pilot.press("ctrl+r")
        await pilot.pause()
        shown = str(app.query_one(SamplingPanel).query_one("#sampling-params").render())
        assert "grammar" in shown and "allowed" in shown
        assert app.session.grammar[1] > 0
        saved = app.files.store.load(app.session.record.id).messages[-1]
        assert saved["produced_by"]["params"]["constraint"]["spec"] == json.dumps(schema)
