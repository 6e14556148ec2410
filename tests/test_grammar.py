"""Constrained decoding: the oracles are the jsonschema package (every finished output of a corpus
of schemas validates), transformers (its warpers on masked logits; its greedy generate with
prefix_allowed_tokens_fn stepping a matcher of its own) and llguidance's own matcher replayed
over the output; and the constraint holds through samples, beams, speculation and preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from pagechat.core.config import EngineConfig
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.grammar import grammar_of
from pagechat.core.params import Constraint, SamplingParams
from pagechat.core.sampler import Sampler, SampleRow, processed_logits
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

F32 = EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", threads=2)

# Schemas of the kinds the issue names, written from JSON Schema's own examples, not tuned to a
# model: nested objects, arrays with minItems, enums, anyOf, bounded numbers, patterns, closed
# objects.
CORPUS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 40},
                    "city": {"type": "string", "maxLength": 20},
                },
                "required": ["street", "city"],
                "additionalProperties": False,
            }
        },
        "required": ["address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}
        },
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0.5, "maximum": 99}},
        "required": ["price"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "done": {"type": "boolean"}},
            "required": ["id", "done"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


def schema(s: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


# -- compiling -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json"),
        schema(CORPUS[0]),
        Constraint("regex", "[0-9]{3}-[0-9]{4}"),
        Constraint("choice", '["yes", "no"]'),
        Constraint("grammar", 'root ::= "a" ("b" | "c")+'),  # GBNF, as llama.cpp writes it
        Constraint("grammar", 'start: "a" ("b" | "c")+'),  # Lark
    ],
)
def test_every_kind_compiles(constraint):
    assert grammar_of(constraint)


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (Constraint("json_schema", "{not json"), "not JSON"),
        (Constraint("regex", "[0-9"), "regex"),
        (Constraint("choice", "[]"), "non-empty list of strings"),
        (Constraint("choice", '["a", 1]'), "non-empty list of strings"),
        (Constraint("grammar", "root ::= missing"), "grammar"),
    ],
)
def test_a_bad_constraint_is_one_line_naming_it(constraint, says):
    with pytest.raises(PagechatError) as err:
        grammar_of(constraint)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_bad_constraint_costs_no_step(tiny_llama):
    engine = Engine(tiny_llama, F32)
    with pytest.raises(PagechatError, match="nonsense"):
        engine.requests.add([1, 2, 3], SamplingParams(constraint=schema({"type": "nonsense"})))
    assert not engine.requests and not engine.has_unfinished()


# -- the sampler ---------------------------------------------------------------------------------


def test_filters_on_masked_logits_equal_transformers_warpers():
    """The grammar's mask comes before temperature and the filters: what remains is exactly
    transformers' warpers applied to the logits with the forbidden tokens at -inf."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g) * 3
    allowed = torch.rand(3, 300, generator=g) < 0.3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    rows = [SampleRow(i, params, [], None, allowed[i]) for i in range(3)]
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    )
    want = warpers(None, logits.masked_fill(~allowed, float("-inf")))
    assert torch.equal(processed_logits(logits, rows), want)


def test_the_sampling_record_names_the_grammar_cut_and_counts_what_it_allowed():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    allowed = torch.tensor([False, True, False, True, True, False])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2)):
        row = SampleRow(0, replace_candidates(params), [], None, allowed, "next: '{'")
        [token], [record] = Sampler(str).sample(logits, [row])
        by_id = {c.token_id: c for c in record.candidates}
        assert token in (1, 3) and record.allowed == 3 and record.where == "next: '{'"
        assert [by_id[i].cut_by for i in (0, 2, 5)] == ["grammar"] * 3
        assert by_id[0].logit == 5.0 and by_id[0].prob > by_id[1].prob  # the model's own figures
        assert not by_id[0].kept and by_id[token].chosen


def replace_candidates(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, num_candidates=6)


# -- the engine ----------------------------------------------------------------------------------


def _replayed(engine: Engine, constraint: Constraint, tokens: list[int]) -> bool:
    """llguidance's own verdict on an output: a fresh matcher takes every token."""
    m = engine.requests.grammars.matcher(constraint)
    eos = engine.requests.eos_ids
    return all(m.consume(t) for t in tokens if t not in eos)


def test_greedy_constrained_equals_transformers_with_the_same_mask(tiny_llama):
    """transformers' generate with prefix_allowed_tokens_fn (a matcher of its own stepped over
    what it generated) picks the same tokens as the engine under the same regex."""
    engine = Engine(tiny_llama, F32)
    constraint = Constraint("regex", "[a-z]+( [a-z]+){2,5}")
    ids = engine.tokenizer("one two three").input_ids
    [seq] = engine.generate(
        [ids], SamplingParams(temperature=0, max_tokens=24, constraint=constraint)
    )

    def allowed_after(batch_id, input_ids):
        m = engine.requests.grammars.matcher(constraint)
        assert all(m.consume(t) for t in input_ids[len(ids) :].tolist())
        return m.allowed().nonzero().flatten().tolist()

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    out = hf.generate(
        torch.tensor([ids]),
        do_sample=False,
        max_new_tokens=len(seq.output_ids),
        prefix_allowed_tokens_fn=allowed_after,
        pad_token_id=0,
    )
    assert seq.output_ids == out[0, len(ids) :].tolist()
    assert re.fullmatch(constraint.spec, seq.text) or seq.finish_reason == "length"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"ngram": True, "num_draft": 3},
        {"draft": "itself", "num_draft": 3},  # the model drafts for itself: a draft-model run
        {"kv_blocks": 6, "preempt": "swap"},
        {"kv_blocks": 6, "max_batch_tokens": 8},
    ],
    ids=["plain", "ngram", "draft", "swap", "tight-chunked"],
)
def test_the_constraint_holds_through_samples_speculation_and_preemption(tiny_llama, extra):
    """Greedy outputs equal a roomy plain engine's; every sample's tokens replay through a fresh
    matcher; the tight pools preempt."""
    from dataclasses import replace

    if extra.get("draft"):
        extra = {**extra, "draft": str(tiny_llama)}
    config = replace(F32, **extra)
    constraint = Constraint("regex", "(ab|cd)+ [0-9]{2,4}")
    greedy = SamplingParams(temperature=0, max_tokens=14, constraint=constraint)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=14, constraint=constraint)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * k for k in (2, 4, 6)]
    want = Engine(tiny_llama, F32).generate(prompts, greedy)
    engine = Engine(tiny_llama, config)
    got = engine.generate(prompts, greedy)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    samples = engine.generate(prompts, sampled)
    assert len(samples) == 9 and all(_replayed(engine, constraint, s.output_ids) for s in samples)
    assert all(re.fullmatch(constraint.spec, s.text) for s in samples if s.finish_reason == "stop")
    if config.kv_blocks:
        assert any(s.num_preemptions for s in samples + got)


def test_beams_keep_to_the_grammar(tiny_llama):
    engine = Engine(tiny_llama, F32)
    constraint = Constraint("choice", '["alpha beta", "gamma", "delta epsilon zeta"]')
    params = SamplingParams(beam_width=3, max_tokens=12, constraint=constraint)
    [seq] = engine.generate([[5, 6, 7]], params)
    assert seq.text in json.loads(constraint.spec)
    assert all(b.text in json.loads(constraint.spec) for b in seq.beams if b.token_ids)


def test_max_tokens_cuts_a_value_short(tiny_llama):
    engine = Engine(tiny_llama, F32)
    [seq] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, constraint=schema(CORPUS[1]))
    )
    assert seq.finish_reason == "length" and seq.text.startswith("{")


def test_a_corpus_of_schemas_on_the_real_model(smollm2):
    """SmolLM2-135M-Instruct, four seeded samples a schema: every output that ends validates."""
    engine = Engine(smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf", F32)
    prompts, params = [], []
    for k, s in enumerate(CORPUS):
        ask = f"Answer with JSON matching this schema: {json.dumps(s)}"
        prompts.append(engine.requests.encode(ask, chat=True))
        params.append(
            SamplingParams(temperature=0.8, seed=k, n=4, max_tokens=160, constraint=schema(s))
        )
    seqs = engine.generate(prompts, params)
    ended = 0
    for k, s in enumerate(CORPUS):
        for seq in seqs[4 * k : 4 * k + 4]:
            assert _replayed(engine, schema(s), seq.output_ids)
            if seq.finish_reason == "stop":
                jsonschema.validate(json.loads(seq.text), s)
                ended += 1
    assert ended >= 3 * len(seqs) // 4, [s.finish_reason for s in seqs]


def test_the_step_counts_the_masks_time(tiny_llama):
    engine = Engine(tiny_llama, F32)
    reports = []
    constrained = SamplingParams(max_tokens=6, constraint=Constraint("regex", "[a-z ]+"))
    engine.generate([[5, 6, 7]], constrained, reports.append)
    assert all(r.grammar_s > 0 for r in reports if r.samples)
    assert all(0 < r.grammar_s < r.elapsed_s for r in reports if r.samples)
    plain = []
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6), plain.append)
    assert all(r.grammar_s == 0 for r in plain)
