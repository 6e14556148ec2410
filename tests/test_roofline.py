"""What bounds a step (core/roofline.py): a decode step reads every weight and the KV its sequences
attend to, a step's linear FLOPs are twice its layers' weights per token plus the head per
sequence (counted here from the model's own modules and config, not from pagechat's reports); the
machine's limits are measured; the Timing panel shows the latest steps against them."""

from __future__ import annotations

import json

import pytest
import torch
from drive import tabs_app, type_prompt, wait_reply_done, wait_until
from pagechat.core.engine import Engine
from pagechat.core.events import EngineInfo
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import Roofline, StepWork, step_rates
from pagechat.tui.widgets.timing import TimingPanel
from test_server import tiny_config


def test_a_steps_work_is_its_weights_its_kv_and_its_flops(tiny_llama):
    engine = Engine(tiny_llama, tiny_config(block_size=4))
    memory = EngineInfo.of(engine).memory
    engine.requests.add(list(range(3, 20)), SamplingParams(max_tokens=3, temperature=0))
    engine.requests.add(list(range(5, 10)), SamplingParams(max_tokens=3, temperature=0))
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    cfg = json.loads((tiny_llama / "config.json").read_text())  # the checkpoint's own word
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = torch.empty((), dtype=engine.kv_dtype).element_size()  # the cache's own dtype
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * kv_bytes
    weights = sum(p.nbytes for p in {id(p): p for p in engine.model.parameters()}.values())
    linear = sum(
        m.weight.numel()
        for name, m in engine.model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    head = cfg["vocab_size"] * cfg["hidden_size"]
    decode = next(r for r in reports if r.kind == "decode" and len(r.batch) == 2)
    work = StepWork.of(decode.batch, memory)
    attended = sum(
        item.start + 1 for item in decode.batch
    )  # each attends to all before, and itself
    assert work.bytes_read == weights + kv_per_token * attended
    assert work.flops == 2 * (linear * 2 + head * 2)
    prefill = reports[0]
    assert prefill.kind == "prefill"
    tokens = sum(item.tokens for item in prefill.batch)
    assert StepWork.of(prefill.batch, memory).flops == 2 * (
        linear * tokens + head * len(prefill.batch)
    )
    read, computed = step_rates([(r.kind, r.elapsed_s, r.batch) for r in reports], memory)
    decodes = [r for r in reports if r.kind == "decode"]
    assert read == pytest.approx(
        sum(StepWork.of(r.batch, memory).bytes_read for r in decodes)
        / sum(r.elapsed_s for r in decodes)
    )
    assert computed is not None and step_rates([], memory) == (None, None)


def test_the_machines_limits_are_measured():
    roof = Roofline.measure(torch.device("cpu"), torch.float32)
    assert 1e8 < roof.bandwidth < 1e13 and 1e8 < roof.peak_flops < 1e14


@pytest.mark.anyio
async def test_the_timing_panel_says_what_bounds_the_latest_steps(model_dir, tmp_path):
    """After a reply: decode's GB/s and its share of the measured read speed, and prefill's
    GFLOP/s and its share of the peak, as step_rates gives them for the session's steps."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    app = tabs_app(model_dir, tmp_path, params)
    async with app.run_test(size=(140, 40)) as pilot:
        await type_prompt(pilot, "hello there, how are you today")
        await wait_reply_done(pilot)
        app.main.show_panel("timing")
        await wait_until(pilot, lambda: app.query_one(TimingPanel).display, 5, "the panel")
        app.inspector.refresh()
        await pilot.pause(0.1)
        info = app.loop.info
        read, computed = step_rates(app.session.work, info.memory)
        shown = str(app.query_one("#timing-roof").render())
        roof = info.roofline
        assert f"decode reads {read / 1e9:.1f} GB/s of {roof.bandwidth / 1e9:.1f}" in shown
        assert f"({100 * read / roof.bandwidth:.0f}% MBU)" in shown
        assert f"prefill {computed / 1e9:.0f} GFLOP/s of {roof.peak_flops / 1e9:.0f} peak" in shown
