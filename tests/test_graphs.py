"""Step graphs (core/graphs.py): the traced steps compute exactly what the eager engine computes
(bit for bit where every row's logits are wanted), and they run.

Each scenario takes a different trace key or shape: one sequence decoding (no mask), a batch of
three of different lengths (a padding mask), n-gram speculation (verification steps of several
tokens per sequence), and a sliding window shorter than the context (a window mask), which
transformers checks as well.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import cli
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams
from transformers import AutoModelForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [
    "Hi",
    "Blocks hold keys and values.",
    "A longer prompt about the prefix cache and its blocks, block by block.",
]


def traced_run(path, prompts, params=GREEDY, **cfg):
    """(output ids, logits of every forward, trace keys made, how many forwards ran as graphs)."""
    engine = Engine(path, EngineConfig(device="cpu", dtype="float32", **cfg))
    logits, graph_calls = [], []
    run, graphs = engine.runner.run, engine.runner.graphs
    engine.runner.run = lambda items, rows: logits.append(run(items, rows).clone()) or logits[-1]
    if graphs is not None:
        graph_run = graphs.run
        graphs.run = lambda *a: graph_calls.append(1) or graph_run(*a)
    outs = [s.output_ids for s in engine.generate(prompts, params)]
    return outs, logits, set(graphs.traces) if graphs else set(), len(graph_calls)


@pytest.mark.parametrize(
    "prompts, cfg, key, eager_steps",
    [
        # keys: (every sequence computes one token, the masked windows...)
        (
            PROMPTS[:1],
            {},
            (True,),
            0,
        ),  # one sequence: its 2-token prompt wants 1 of 2 rows' logits, then decodes unmasked
        (
            PROMPTS,
            {},
            (True, None),
            1,
        ),  # three of different lengths: their prefill pads (eager), then a padding mask
        (
            ["one two three one two three one two three one two"],
            {"ngram": True},
            (False, None),
            0,
        ),  # verify steps: causal; the prompt (under MAX_GRAPH_TOKENS tokens) the same trace
    ],
)
def test_graphs_equal_eager(tiny_llama, prompts, cfg, key, eager_steps):
    outs, logits, keys, calls = traced_run(tiny_llama, prompts, **cfg)
    eager_outs, eager_logits, eager_keys, eager_calls = traced_run(
        tiny_llama, prompts, graphs=False, **cfg
    )
    assert (
        key in keys and calls == len(logits) - eager_steps
    )  # a prefill of more than MAX_GRAPH_TOKENS tokens or of padded rows is eager
    assert eager_keys == set() and eager_calls == 0
    assert outs == eager_outs
    assert len(logits) == len(eager_logits)
    prefill, *steps = zip(logits, eager_logits)
    # the prompt's forward: a graph computes every row's logits and keeps the last, eager only the
    # last (a head matmul of another height: equal to rounding)
    assert torch.allclose(*prefill, rtol=0, atol=1e-5)
    for got, want in steps:
        assert torch.equal(got, want)  # the same kernels in the same order: bit for bit


def test_sliding_window_graph_matches_transformers(tiny_models, tmp_path):
    path = tmp_path / "mistral-window8"
    shutil.copytree(tiny_models["mistral"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"sliding_window": 8}))
    hf = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    ).eval()
    engine = Engine(path, EngineConfig(device="cpu", dtype="float32"))
    ids = engine.tokenizer(PROMPTS[2]).input_ids
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids) :].tolist()
    outs, _, keys, calls = traced_run(path, [ids])
    # unmasked: made at load, used for contexts within 8; then one sequence yet masked (a shorter
    # window)
    assert keys == {(True,), (True, 8)} and calls == GREEDY.max_tokens - 1
    assert outs == [want]


def test_bitsandbytes_int8_runs_eagerly(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(device="cpu", dtype="float32", quant="int8"))
    assert engine.runner.graphs is None
    [seq] = engine.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(seq.output_ids) == 3


@pytest.mark.parametrize("flags, graphs", [([], True), (["--eager"], False)])
def test_eager_flag(tiny_llama, capsys, flags, graphs):
    code, out, err = cli(
        [
            "generate",
            str(tiny_llama),
            "-p",
            "Hi",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
            *flags,
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["stats"]["graphs"] is graphs and len(data["results"][0]["token_ids"]) == 4
