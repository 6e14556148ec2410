"""Structured outputs and tool calls through `pagechat serve`, called with the official openai
client on SmolLM2-135M-Instruct: every JSON-schema reply validates with the jsonschema package
(whole, streamed, n=4, with an n-gram proposer), `parse()` fills a pydantic model, required and
named tool calls carry arguments that satisfy the function's schema, auto returns a call the model
wrote parsed, and the other peers' dialects (vLLM's structured_outputs, llama-server's json_schema
and grammar) constrain as they do there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pydantic
import pytest
from pagechat.core.config import EngineConfig
from test_server import serving

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"type": "string", "enum": ["en", "fr", "de"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module", params=["plain", "ngram"])
def smol(request, smollm2):
    config = EngineConfig(threads=2, ngram=request.param == "ngram", num_draft=3)
    with serving(smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf", config) as s:
        yield s


def test_every_json_schema_reply_validates(smol):
    c = smol.client()
    whole = c.chat.completions.create(
        model="tiny", messages=ASK, response_format=SCHEMA_FORMAT, n=4, seed=1,
        temperature=0.8, max_tokens=120,
    )  # fmt: skip
    texts = [ch.message.content for ch in whole.choices if ch.finish_reason == "stop"]
    stream = c.chat.completions.create(
        model="tiny", messages=ASK, response_format=SCHEMA_FORMAT, n=4, seed=2,
        temperature=0.8, max_tokens=120, stream=True,
    )  # fmt: skip
    parts, reasons = {}, {}
    for chunk in stream:
        for ch in chunk.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    texts += [parts[i] for i in parts if reasons[i] == "stop"]
    assert len(texts) >= 6, [ch.finish_reason for ch in whole.choices] + list(reasons.values())
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    smol.wait_idle()


def test_parse_fills_a_pydantic_model(smol):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int

    r = smol.client().chat.completions.parse(
        model="tiny", messages=ASK, response_format=Person, temperature=0, max_tokens=80
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def _calls_validate(message, tools) -> list:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.type == "function" and call.id
    return message.tool_calls


def test_required_and_named_calls_carry_valid_arguments(smol):
    c, tools = smol.client(), [WEATHER, TIME]
    for seed in range(3):
        r = c.chat.completions.create(
            model="tiny", messages=PARIS, tools=tools, tool_choice="required",
            parallel_tool_calls=False, temperature=0.9, seed=seed, max_tokens=80,
        )  # fmt: skip
        [call] = _calls_validate(r.choices[0].message, tools)
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(
        model="tiny", messages=PARIS, tools=tools, tool_choice=named, temperature=0,
        max_tokens=80,
    )  # fmt: skip
    [call] = _calls_validate(r.choices[0].message, tools)
    assert call.function.name == "get_time"


def test_a_streamed_call_comes_as_vllm_streams_it(smol):
    """index, id, type and the name first with empty arguments, then the arguments as the model
    writes them; joined, the same JSON as the same request answered whole (vLLM's whole answer
    also re-serialises what its stream sent as written)."""
    c, named = smol.client(), {"type": "function", "function": {"name": "get_weather"}}
    args = dict(model="tiny", messages=PARIS, tools=[WEATHER], tool_choice=named, temperature=0)
    whole = c.chat.completions.create(**args, max_tokens=80)
    deltas, reasons = [], []
    for chunk in c.chat.completions.create(**args, max_tokens=80, stream=True):
        deltas += chunk.choices[0].delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    head = deltas[0]
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    joined = "".join(d.function.arguments for d in deltas)
    assert json.loads(joined) == json.loads(
        whole.choices[0].message.tool_calls[0].function.arguments
    )
    # a named function ends with stop, as OpenAI and vLLM say it (fixtures: tools_named*)
    named_end = json.loads((RECORDED / "tools_named.json").read_text())["choices"][0]
    assert reasons[-1] == named_end["finish_reason"] == "stop" and set(reasons[:-1]) == {None}


def test_auto_returns_the_call_the_model_wrote(smol):
    """A model that writes a Hermes call (here made to by a grammar) gets it back parsed, with
    the text before it as content; the tool's answer is accepted in the next turn."""
    args = {"city": "Paris", "unit": "c"}
    call = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>"
    grammar = f"start: {json.dumps('Let me check. ')} {json.dumps(call)}"
    c = smol.client()
    r = c.chat.completions.create(
        model="tiny", messages=PARIS, tools=[WEATHER], tool_choice="auto", max_tokens=60,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    message = r.choices[0].message
    [made] = _calls_validate(message, [WEATHER])
    assert message.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    follow = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": "18 C and sunny"},
    ]
    r = c.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_the_other_dialects(smol):
    c = smol.client()
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A phone number?"}], max_tokens=12,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    # llama-server's own fields on /v1/completions
    r = c.completions.create(
        model="tiny", prompt="A person: ", max_tokens=120, temperature=0,
        extra_body={"json_schema": PERSON},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = c.completions.create(
        model="tiny", prompt="Answer: ", max_tokens=8,
        extra_body={"grammar": 'root ::= "maybe" | "surely"'},
    )  # fmt: skip
    assert r.choices[0].text in ("maybe", "surely")
    keys = [{"role": "user", "content": "Give me a JSON object with keys a and b."}]
    r = c.chat.completions.create(
        model="tiny", messages=keys, max_tokens=150, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# -- against vLLM's recorded answers (tests/fixtures/vllm/structured, vLLM 0.32.0) ----------------

RECORDED = Path(__file__).parent / "fixtures" / "vllm" / "structured"


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line[6:7] == "{"]


def _shape(chunks: list[dict]) -> list[str]:
    """What each chunk of a streamed chat carries, runs of argument fragments as one."""
    out = []
    for chunk in chunks:
        if not chunk["choices"]:
            kind = "usage"
        else:
            choice = chunk["choices"][0]
            delta, calls = choice["delta"], choice["delta"].get("tool_calls") or []
            if choice["finish_reason"]:
                kind = f"finish {choice['finish_reason']}" + (" +data" if delta else "")
            elif "role" in delta:
                kind = "role"
            elif calls and calls[0].get("id"):
                kind = "head " + ",".join(sorted(k for k in calls[0] if k != "function"))
                kind += " name=" + calls[0]["function"]["name"]
            elif calls:
                kind = "arguments"
            else:
                kind = "content" if delta.get("content") else "empty"
        if not out or out[-1] != kind or kind != "arguments":
            out.append(kind)
    return out


def _our_stream(tools, text_parts: list[str], choice_reason: str = "stop") -> list[dict]:
    from pagechat.server.messages import ChoiceDelta, ChoiceUsage
    from pagechat.server.responses import ChunkWriter, Header

    writer = ChunkWriter(Header.new("chat", "tiny"), False, True, tools)
    text = writer.opening(0)
    for k, part in enumerate(text_parts):
        last = k == len(text_parts) - 1
        reason, usage = (choice_reason, ChoiceUsage(5, 0, 9)) if last else (None, None)
        text += writer.delta(ChoiceDelta(0, part, (), reason, None, usage, tokens=1)) or ""
    text += writer.usage({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})
    return _events(text)


def _recorded_call(name: str) -> tuple[list[dict], str]:
    """A recorded stream and the model text behind its call (the arguments' fragments joined)."""
    chunks = _events((RECORDED / name).read_text())
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    args = "".join(tc[0]["function"].get("arguments", "") for tc in calls if tc)
    head = {"name": "get_weather", "arguments": json.loads(args)}
    return chunks, f"<tool_call>\n{json.dumps(head)}\n</tool_call>"


@pytest.mark.parametrize(("name", "choice"), [("tools_required_stream.txt", "required")])
def test_a_streamed_call_has_vllms_shape(name, choice):
    from pagechat.server.tools import tools_of

    recorded, text = _recorded_call(name)
    tools = tools_of([WEATHER], choice, "")
    ours = _our_stream(tools, [text[i : i + 7] for i in range(0, len(text), 7)])
    assert (
        _shape(ours)
        == _shape(recorded)
        == [
            "role",
            "head id,index,type name=get_weather",
            "arguments",
            "finish tool_calls",
            "usage",
        ]
    )
    ours_args = "".join(
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for c in ours
        if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    )
    assert json.loads(ours_args) == json.loads(text.split("\n")[1])["arguments"]


def test_a_whole_call_has_vllms_fields():
    from pagechat.server.jobs import Choice
    from pagechat.server.messages import ChoiceDelta
    from pagechat.server.responses import Header, whole
    from pagechat.server.tools import tools_of

    recorded = json.loads((RECORDED / "tools_required.json").read_text())["choices"][0]
    call = recorded["message"]["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    text = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>"
    choice = Choice(0)
    choice.add(ChoiceDelta(0, text, (), "stop"))
    ours = whole(
        Header.new("chat", "tiny"), [choice], {}, False, tools_of([WEATHER], "required", "")
    )
    mine = ours["choices"][0]
    assert mine["finish_reason"] == recorded["finish_reason"] == "tool_calls"
    [made] = mine["message"]["tool_calls"]
    assert made.keys() == call.keys() and made["function"].keys() == call["function"].keys()
    assert json.loads(made["function"]["arguments"]) == json.loads(call["function"]["arguments"])
    assert not mine["message"]["content"] and not recorded["message"]["content"]
