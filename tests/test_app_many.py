"""Many sequences in the app, driven with real key presses (Textual Pilot) on a tiny random model:
several answers to one prompt and keeping one, beams, background load, and the scheduler panel."""

from __future__ import annotations

from dataclasses import replace

import pytest
from drive import advance, sequences, tabs_app, type_prompt, wait_reply_done, wait_until
from pagechat.core.params import SamplingParams
from pagechat.tui.app import PagechatApp
from pagechat.tui.session import Message
from pagechat.tui.widgets.chat import AnswersView, AnswerView, ChatLog
from pagechat.tui.widgets.controls import ControlsPanel
from pagechat.tui.widgets.panel import Readout
from pagechat.tui.widgets.scheduler import SchedulerPanel
from textual.widgets import Input

pytestmark = pytest.mark.anyio
SIZE = (120, 36)
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=5, ignore_eos=True)


def make_app(model_dir, tmp_path, params: SamplingParams = PARAMS, **config) -> PagechatApp:
    return tabs_app(model_dir, tmp_path, params, **config)


def answers_view(app: PagechatApp) -> AnswersView:
    return app.query_one(ChatLog).views[id(app.session.messages[-1])]


async def test_n_samples_decode_together_and_the_kept_one_goes_on(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f9", "f9")  # 1 -> 2 -> 4 samples
        assert app.session.params.n == 4
        assert app.query_one("#ctl-n", Input).value == "4"
        await type_prompt(pilot, "tell me")
        await wait_reply_done(pilot)
        engine = app.loop.engine
        reply = app.session.messages[-1]
        seqs = [sequences(engine)[reply.request_id]]
        seqs += [sequences(engine)[c] for c in seqs[0].children]
        assert len(reply.samples) == 4 and len(seqs) == 4
        assert [a.content for a in reply.samples] == [s.text for s in seqs]
        assert [[t.token_id for t in a.tokens] for a in reply.samples] == [
            s.output_ids for s in seqs
        ]
        assert len({a.content for a in reply.samples}) > 1  # four different answers
        # the four decoded together: every decode step ran all of them
        view = answers_view(app)
        head = str(view.query_one(".answers-head").render())
        assert head.startswith("4 answers") and head.count("length") == 4
        await pilot.press("alt+right", "alt+right")
        assert reply.shown == 2 and [v.display for v in view.query(AnswerView)] == [
            False,
            False,
            True,
            False,
        ]
        await pilot.press("ctrl+t")
        assert reply.picked == 2 and reply.content == seqs[2].text
        assert "kept answer 3 of 4" in str(view.query_one(".answers-head").render())
        # the chat goes on from the kept answer; the saved chat names it and keeps every answer
        assert app.session.conversation()[-1] == {"role": "assistant", "content": seqs[2].text}
        saved = app.files.store.load(app.session.record.id).messages[-1]
        assert saved["content"] == seqs[2].text
        assert (saved["answers"]["of"], saved["answers"]["kept"]) == (4, 2)
        assert [a["content"] for a in saved["answers"]["each"]] == [s.text for s in seqs]


async def test_keeping_a_sample_mid_reply_frees_the_others_at_once(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(PARAMS, n=4, max_tokens=60))
    async with app.run_test(size=SIZE) as pilot:
        app.loop.pause()
        await type_prompt(pilot, "tell me more")
        await advance(pilot, 6)
        reply, engine = app.session.messages[-1], app.loop.engine
        ids = [a.request_id for a in reply.samples]
        assert None not in ids and all(a.streaming and a.tokens for a in reply.samples)
        await pilot.press("alt+left", "ctrl+t")  # the last answer
        app.loop.sync()
        assert [sequences(engine)[i].finished for i in ids] == [True, True, True, False]
        assert [engine.block_map.held(i)[0] > 0 for i in ids] == [False, False, False, True]
        await wait_until(pilot, lambda: not app.frames.render_pending, 10, "the aborts to be drawn")
        assert [a.finish_reason for a in reply.samples[:3]] == ["abort"] * 3
        assert reply.streaming  # the kept answer goes on
        app.loop.resume()
        await wait_reply_done(pilot)
        kept = sequences(engine)[ids[3]]
        assert reply.content == kept.text and kept.num_output_tokens == 60
        assert reply.finish_reason == "length"


async def test_sending_again_keeps_the_answer_shown(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(PARAMS, n=2))
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "one")
        await wait_reply_done(pilot)
        first = app.session.messages[-1]
        await pilot.press("alt+right")
        await type_prompt(pilot, "two")
        assert first.picked == 1 and first.content == first.samples[1].content
        await wait_reply_done(pilot)
        conv = app.session.conversation()  # the second reply has no kept answer yet
        assert conv[-2:] == [{"role": "assistant", "content": first.content}, conv[-1]]


async def test_a_samples_value_above_eight_is_refused(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.action_focus_controls()
        field = app.query_one("#ctl-n", Input)
        field.focus()
        field.value = "9"
        await pilot.press("enter")
        assert "samples must be at most 8" in app.query_one(ControlsPanel).error
        assert app.session.params.n == 1


async def test_the_scheduler_panel_lists_every_sample(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(PARAMS, n=3, max_tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        app.main.show_panel("sched")
        app.loop.pause()
        await type_prompt(pilot, "hello")
        await advance(pilot, 4)
        panel = app.query_one(SchedulerPanel)
        text = str(panel.query_one("#sched-seqs").render())
        reply = app.session.messages[-1]
        for k, a in enumerate(reply.samples, 1):
            assert f"chat s{k}" in text
            assert any(line.split()[0] == str(a.request_id) for line in text.splitlines()[1:])
        assert text.count("running") == 3
        steps = str(panel.query_one("#sched-steps").render()).splitlines()
        newest = steps[2]  # after a gap and the header: the three samples decoding together
        assert (
            newest.split()[1] == "dec"
            and newest.split()[2] == f"3/{app.loop.engine.config.max_batch_tokens}"
        )
        assert all(f"{a.request_id}:D1" in newest for a in reply.samples)
        assert "run 3" in str(panel.query_one("#sched-counts").render())


async def set_load_fields(pilot, count: int, rate: float) -> None:
    app = pilot.app
    app.query_one("#ctl-load-count", Input).value = str(count)
    app.query_one("#ctl-load-rate", Input).value = str(rate)


async def test_background_load_batches_hits_the_prefix_cache_and_preempts(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(PARAMS, max_tokens=30), kv_blocks=40, block_size=4)
    async with app.run_test(size=SIZE) as pilot:
        app.main.show_panel("sched")
        await set_load_fields(pilot, 14, 5)
        # paused until every request is in (they come over 2.6 s): on a fast machine a load
        # that ran as it came would end before the chat comes, and nothing would be preempted
        app.loop.pause()
        await pilot.press("ctrl+l")
        assert app.query_one(ControlsPanel).load_on
        engine = app.loop.engine
        await wait_until(pilot, lambda: len(sequences(engine)) >= 14, 10, "the load to start")
        await type_prompt(pilot, "hello under load")  # the chat is answered among them
        await wait_until(pilot, lambda: len(sequences(engine)) >= 15, 10, "the chat to start")
        app.loop.resume()
        await wait_reply_done(pilot)
        reply = app.session.messages[-1]
        assert reply.finish_reason == "length"
        assert sequences(engine)[reply.request_id].num_preemptions == 0  # the chat goes first
        load = [r for r, what in app.sched.labels.items() if what.startswith("load")]
        assert sorted(app.sched.labels[r] for r in load) == sorted(
            f"load {k}" for k in range(1, 15)
        )
        await wait_until(
            pilot, lambda: all(sequences(engine)[r].finished for r in load), 120, "the load to end"
        )
        await wait_until(pilot, lambda: not app.frames.render_pending, 10, "the last frame")
        assert app.sched.preemptions > 0  # the pool could not hold them all
        assert app.session.blocks.prefix_hit_tokens > 0  # repeated prompts share blocks
        assert {sequences(engine)[r].finish_reason for r in load} <= {"stop", "length"}
        assert not app.query_one(ControlsPanel).load_on  # it ran out by itself
        assert "load" not in str(app.query_one("#status").render())


async def test_ctrl_l_stops_the_load_and_frees_its_blocks(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, block_size=4)
    async with app.run_test(size=SIZE) as pilot:
        await set_load_fields(pilot, 6, 100)
        app.loop.pause()
        await pilot.press("ctrl+l")
        await advance(pilot, 5)
        engine = app.loop.engine
        assert len(sequences(engine)) == 6 and engine.block_map.snapshot().num_used > 0
        status = str(app.query_one("#status").render())
        assert "load 6 running" in status
        await pilot.press("ctrl+l")
        app.loop.sync()
        assert all(s.finish_reason == "abort" for s in sequences(engine).values())
        assert engine.block_map.snapshot().num_used == 0
        await wait_until(pilot, lambda: not app.frames.render_pending, 10, "the stop to be drawn")
        await pilot.pause(0.1)
        assert not app.query_one(ControlsPanel).load_on and not app.sched.live


def test_sixteen_sequences_have_sixteen_colours_and_shared_blocks_their_ref_count():
    from pagechat.core.blockmap import BlockInfo
    from pagechat.tui.app import PALETTE
    from pagechat.tui.widgets.blocks import OWNER_COLOURS, block_cell, owner_colour

    assert len({PALETTE[owner_colour(i)] for i in range(16)}) == 16
    assert len(OWNER_COLOURS) == 16
    cells = [block_cell(BlockInfo(0, "used", r, tuple(range(3, 3 + r)), 16), 16) for r in (1, 2, 9)]
    assert cells == [("█", "pc-note"), ("2", "pc-note"), ("9", "pc-note")]
    many = BlockInfo(0, "used", 12, tuple(range(12)), 16)
    assert block_cell(many, 16) == ("◆", "pc-accent")


def test_the_legend_names_the_sequences_and_says_how_many_more():
    from pagechat.core.blockmap import BlockInfo, BlockSnapshot
    from pagechat.tui.app import PALETTE
    from pagechat.tui.widgets.blocks import legend

    blocks = tuple(BlockInfo(i, "used", 1, (i,), 4) for i in range(16))
    snap = BlockSnapshot(4, blocks, 16, 0, 0, 0, 64, 64, 0, 0)
    names = {i: f"load {i + 1}" for i in range(16)} | {0: "chat"}
    text = legend(snap, PALETTE, names, 60).plain
    marks, owners = text.split("\n")
    assert owners.startswith("■0 chat  ■1 load 2  ■2 load 3") and owners.endswith(" more")
    shown = owners.count("■")
    assert owners.endswith(f"+{16 - shown} more") and len(owners) <= 2 * 60 - len(marks)
    assert legend(snap, PALETTE, names, 400).plain.count("■") == 16  # room for all


async def test_a_folded_pool_states_its_scale_from_the_first_frame(
    model_dir, tmp_path, monkeypatch
):
    from pagechat.tui.widgets.blocks import BlockGrid, BlocksPanel

    drawn: list[tuple[int, str]] = []  # (the grid's scale, the panel's title) at each describe
    describe = BlocksPanel.describe

    def recording(panel, snap):
        describe(panel, snap)
        drawn.append((panel.query_one(BlockGrid).fold, str(panel.border_title)))

    monkeypatch.setattr(BlocksPanel, "describe", recording)
    app = make_app(model_dir, tmp_path, kv_blocks=6000)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        fold = app.query_one(BlockGrid).fold
        assert fold > 1 and drawn
        assert all(f"1 cell = {k} blocks" in title for k, title in drawn)
        assert drawn[0][0] == fold  # never drawn at another scale first


async def test_beams_are_shown_like_samples_and_one_is_kept(model_dir, tmp_path):
    greedy = replace(PARAMS, temperature=0.0, max_tokens=12)
    app = make_app(model_dir, tmp_path, greedy)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f10", "f10")  # off -> 2 -> 4 beams
        assert app.session.params.beam_width == 4
        assert app.query_one("#ctl-beam_width", Input).value == "4"
        app.loop.pause()
        await type_prompt(pilot, "hello beams")
        await advance(pilot, 4)
        reply, view = app.session.messages[-1], answers_view(app)
        head = str(view.query_one(".answers-head").render())
        assert reply.beams and head.startswith("4 beams") and "searching" in head
        engine = app.loop.engine
        live = [s for s in engine.sequences() if s.role == "beam"]
        assert len(live) == 4  # the four running beams, each a line
        await pilot.press("ctrl+t")  # refused while searching
        assert reply.picked is None
        app.loop.resume()
        await wait_reply_done(pilot)
        root = sequences(engine)[reply.request_id]
        assert [a.content for a in reply.samples] == [b.text for b in root.beams]
        assert [a.finish_reason for a in reply.samples] == [
            f"score {b.score:.3f}" for b in root.beams
        ]
        head = str(view.query_one(".answers-head").render())
        assert head.count("score") == 4
        await pilot.press("alt+right", "ctrl+t")
        assert reply.picked == 1 and reply.content == root.beams[1].text


async def test_branching_the_last_reply_at_a_token(model_dir, tmp_path):
    app = make_app(model_dir, tmp_path, replace(PARAMS, max_tokens=20))
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "branch me")
        await wait_reply_done(pilot)
        reply, engine = app.session.messages[-1], app.loop.engine
        first = sequences(engine)[reply.request_id]
        await pilot.press("ctrl+r", "left", "left", "left", "left", "left")  # token 15 of 20
        await pilot.press("b")
        await wait_until(pilot, lambda: len(reply.samples) == 2, 5, "the branch")
        assert isinstance(answers_view(app), AnswersView)
        await wait_reply_done(pilot)
        original, branch = reply.samples
        assert original.content == first.text and not reply.streaming
        picked = original.tokens[14]
        alt = next(c for c in picked.record.candidates if not c.chosen)
        seq = sequences(engine)[branch.request_id]
        given = first.output_ids[:14] + [alt.token_id]
        assert seq.token_ids[: seq.num_prompt_tokens][-15:] == given  # the branch's own start
        assert seq.token_ids[: len(first.token_ids) - 20] == first.token_ids[:-20]  # the history
        assert seq.num_cached_tokens >= 16  # its history's full blocks were prefix-cache hits
        assert branch.content.startswith("".join(t.text for t in original.tokens[:14]) + alt.text)
        assert [t.token_id for t in branch.tokens] == given + seq.output_ids
        assert reply.shown == 1 and reply.picked is None
        await pilot.press("ctrl+t")
        assert reply.content == branch.content


async def test_answers_updated_before_their_view_has_composed_are_drawn_on_mount(
    model_dir, tmp_path
):
    app = make_app(model_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        reply = Message(
            "assistant", "", samples=[Message("assistant", "one"), Message("assistant", "two")]
        )
        log = app.query_one(ChatLog)
        mounted = log.add(reply)
        log.update(reply)  # a frame between a branch's remount and its compose: drawn on mount
        await mounted
        await pilot.pause()
        view = log.views[id(reply)]
        assert view.query_one(".answers-head", Readout).shown == view.head()
        assert view.shown_view().query_one(".reply-markdown").source == "one"


def test_the_block_map_marks_copies_and_hits_as_they_happen():
    """Each copy-on-write copy and prefix hit marks its block with a serial the snapshot states,
    so a view that skipped snapshots still sees every mark since the one it drew."""
    from pagechat.core.blockmap import BlockMap
    from pagechat.core.blocks import BlockManager

    bm = BlockManager(8, 4)
    view = BlockMap.watching(bm)
    bm.allocate(1, [1, 2, 3, 4, 5, 6])
    bm.commit(1, [1, 2, 3, 4, 5, 6], 6)
    first = view.snapshot()
    assert first.serial == 0 and all(b.mark == 0 for b in first.blocks)
    bm.fork(1, 2)
    ((old, new),) = bm.append(2, 1)  # the shared, partly filled tail is copied on write
    bm.allocate(3, [1, 2, 3, 4, 9])  # the first block is a prefix hit
    snap = view.snapshot()
    marked = {b.block_id: (b.mark, b.marked) for b in snap.blocks if b.mark > first.serial}
    assert marked == {new: (1, "copied"), bm.table(3)[0]: (2, "hit")} and snap.serial == 2


async def test_copies_and_hits_flash_in_the_grid_for_a_moment(model_dir, tmp_path):
    from pagechat.tui.widgets.blocks import FLASH_S, BlockGrid

    app = make_app(model_dir, tmp_path, replace(PARAMS, n=2))
    async with app.run_test(size=SIZE) as pilot:
        app.loop.pause()
        await type_prompt(pilot, "tell me")
        await advance(pilot, 2)  # the prompt, then the samples' first decode copies its tail
        grid = app.query_one(BlockGrid)
        flashed = [key for _, key in grid._cells if "!" in key]
        assert flashed and all(key.endswith("!copied") for key in flashed)
        await pilot.pause(FLASH_S + 0.3)
        assert not any("!" in key for _, key in grid._cells)
        app.loop.resume()
        await wait_reply_done(pilot)
        await pilot.press("ctrl+t")
        app.loop.pause()
        await type_prompt(pilot, "tell me more")  # its history's blocks are prefix hits
        await advance(pilot, 1)
        assert any(key.endswith("!hit") for _, key in grid._cells)


async def test_branches_run_together_each_with_its_settings_and_are_kept(model_dir, tmp_path):
    """Two branches of a reply (one at a token, one the turn asked again), each with the settings
    in force when it was asked, decode in one batch beside each other; each equals its request
    run alone on a fresh engine (seeded: whatever the batch); at most 4 run at once; every answer
    is saved with what made it and comes back on resume."""
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine
    from pagechat.tui.answers import MAX_BRANCHES
    from pagechat.tui.session import ChatSession

    app = make_app(model_dir, tmp_path, replace(PARAMS, max_tokens=20))
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "branch me twice")
        await wait_reply_done(pilot)
        reply, engine = app.session.messages[-1], app.loop.engine
        app.loop.pause()
        app.settings.set_params(replace(PARAMS, max_tokens=12, temperature=0.5, seed=11))
        await pilot.press("ctrl+r", "left", "left", "left", "left", "left", "b")  # at token 15
        app.settings.set_params(replace(PARAMS, max_tokens=12, temperature=1.3, seed=12))
        await pilot.press("ctrl+r", "a")  # the turn asked again
        await wait_until(pilot, lambda: len(reply.samples) == 3, 5, "two branches")
        await advance(pilot, 2)
        branches = reply.samples[1:]
        ran = {b.seq_id for b in app.session.latest.batch}
        assert {b.request_id for b in branches} <= ran  # decoded together in one step
        for k in range(MAX_BRANCHES - 2):
            app.answers.branch(reply.samples[0], 3 + k)
        assert sum(a.streaming for a in reply.samples) == MAX_BRANCHES
        app.answers.branch(reply.samples[0], 9)
        assert len(reply.samples) == 1 + MAX_BRANCHES  # refused: four run already
        app.loop.resume()
        await wait_reply_done(pilot)
        alone = Engine(model_dir, EngineConfig(device="cpu", dtype="float32"))
        for b in reply.samples[1:]:
            seq = sequences(engine)[b.request_id]
            p = seq.sampling.params
            ref = alone.generate([seq.token_ids[: seq.num_prompt_tokens]], p)[0]
            assert seq.output_ids == ref.output_ids and not b.streaming
        made = [b.produced_by for b in branches]
        assert [(m["params"]["temperature"], m["params"]["seed"]) for m in made] == [
            (0.5, 11),
            (1.3, 12),
        ]
        assert made[0]["branch"] == {"of": 1, "at_token": 14}
        assert made[1]["branch"] == {"again": True}
        assert branches[1].tokens[0].record is not None  # asked again: nothing given
        texts = [a.content for a in reply.samples]
    record = app.files.store.load(app.session.record.id)
    resumed = ChatSession(record, PARAMS).messages[-1]
    assert [a.content for a in resumed.samples] == texts
    assert resumed.samples[1].produced_by == made[0] and resumed.picked is None
