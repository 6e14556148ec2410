"""Bad requests get OpenAI-shaped errors with the right status and the parameter named, never a
500 or a framework dump; the API key; the warning for an exposed server; `pagechat serve` itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import cli
from pagechat.server.serve import exposure_warning, is_loopback
from test_server import MODEL, serving, tiny_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tiny_llama):
    with serving(tiny_llama, tiny_config(kv_blocks=64, max_seqs=8)) as s:
        yield s


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", **fields}


# (path, JSON body or raw bytes, status, param named, words the message contains)
BAD = [
    (CHAT, {"model": MODEL}, 400, "messages", "Field required"),
    (CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "robot"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0]",
        "only text",
    ),
    (CHAT, chat(temperature=-1), 400, "temperature", ">= 0"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "valid number"),
    (CHAT, chat(top_p=0), 400, "top_p", "(0, 1]"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    (CHAT, chat(max_tokens=100_000), 400, "max_tokens", "lower max_tokens"),
    (CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens", ">= 1"),
    (CHAT, chat(max_completion_tokens=10**5), 400, "max_completion_tokens", "lower max_comp"),
    (CHAT, chat(n=0), 400, "n", "between 1 and 8"),
    (CHAT, chat(n=9), 400, "n", "between 1 and 8"),
    (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty", "not supported"),
    (CHAT, chat(frequency_penalty=-1), 400, "frequency_penalty", "repetition_penalty"),
    (CHAT, chat(logit_bias={"5": 10}), 400, "logit_bias", "not supported"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs: true"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", "between 0 and 20"),
    (CHAT, chat(stop=[""]), 400, "stop", "empty"),
    (CHAT, chat(stop=5), 400, "stop", "valid string"),
    (CHAT, chat(seed=-1), 400, "seed", "0..2^63-1"),
    (CHAT, chat(top_k=-5), 400, "top_k", "-1"),
    (CHAT, chat(min_p=2), 400, "min_p", "[0, 1]"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", "> 0"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function", "name the function"),
    (CHAT, chat(tools=[{"type": "code"}]), 400, "tools[0]", "'type': 'function'"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice", "needs tools"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        "not among the tools",
    ),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        400,
        "tool_choice",
        "no other constraint",
    ),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", "json_schema"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema",
        "under 'schema'",
    ),
    (
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        ),
        400,
        "response_format",
        "nonsense",
    ),
    (CHAT, chat(structured_outputs={"regex": "[0-9"}), 400, "structured_outputs.regex", "regex"),
    (CHAT, chat(structured_outputs={"choice": "yes"}), 400, "structured_outputs.choice", "list"),
    (CHAT, chat(guided_json="{oops"), 400, "guided_json", "not JSON"),
    (
        CHAT,
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}),
        400,
        "structured_outputs.regex",
        "one constraint",
    ),
    (COMPLETIONS, completion(grammar="root ::= missing"), 400, "grammar", "grammar"),
    (COMPLETIONS, completion(json_schema=[1]), 400, "json_schema", "JSON schema"),
    (CHAT, chat(model="gpt-4o"), 404, "model", "does not exist"),
    (CHAT, b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "valid dictionary"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "temperature",
        "finite",
    ),
    (COMPLETIONS, {"model": MODEL}, 400, "prompt", "Field required"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt", "empty"),
    (COMPLETIONS, completion(prompt=[10**7]), 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS, completion(prompt=[5] * 600), 400, "prompt", "shorten the prompt"),
    (COMPLETIONS, completion(logprobs=99), 400, "logprobs", "between 0 and 20"),
    (COMPLETIONS, completion(echo=True), 400, "echo", "not supported"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of", "not supported"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD)
def test_bad_requests(served, path, body, status, param, words):
    if isinstance(body, bytes):
        r = httpx.post(
            served.url + path, content=body, headers={"content-type": "application/json"}
        )
    else:
        r = httpx.post(served.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["message"] and words in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    if path == CHAT and body == chat(temperature="hot"):
        assert "Traceback" not in r.text and "detail" not in r.text


def test_null_fields_mean_their_defaults(served):
    body = chat(max_tokens=2, n=None, stream=None, logprobs=None, temperature=None, stop=None)
    r = httpx.post(served.url + CHAT, json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_routes_and_methods_the_server_lacks(served):
    r = httpx.get(served.url + "/v1/embeddings")
    assert r.status_code == 404 and "no route GET /v1/embeddings" in r.json()["error"]["message"]
    r = httpx.get(served.url + CHAT)
    assert r.status_code == 405 and "does not take GET" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_openai_client_sees_the_error(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HI, top_p=7)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)
    # A bad stream request fails before any chunk: a status, not an error inside the stream.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=10**6, stream=True)


def test_an_error_from_the_engine_ends_the_request(served, monkeypatch):
    """What the engine itself refuses (here: checks of the HTTP side switched off) is a 400 with
    the engine's message, or an error event before [DONE] once a stream has started."""
    monkeypatch.setattr(served.state.encoder, "_ids", list)
    body = completion(prompt=[10**7], max_tokens=2)
    r = httpx.post(served.url + COMPLETIONS, json=body)
    assert r.status_code == 400 and "outside the model's vocabulary" in r.json()["error"]["message"]
    r = httpx.post(served.url + COMPLETIONS, json={**body, "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    served.wait_idle()
    assert served.state.loop.num_active == 0


def test_a_step_that_fails_is_a_500_for_its_requests_and_the_server_goes_on(tiny_llama):
    """A failure inside a step fails the requests it ran (the server's fault, so a 500, which
    clients retry); the engine stays healthy and serves the next request."""
    with serving(tiny_llama, tiny_config(kv_blocks=16)) as s:
        real, calls = s.engine._forward, []

        def fails_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return real(*args)

        s.engine._forward = fails_once
        r = httpx.post(s.url + CHAT, json=chat(max_tokens=2))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["message"] == "engine step failed: RuntimeError: boom"
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.post(s.url + CHAT, json=chat(max_tokens=2)).status_code == 200
        s.wait_idle()
        assert s.state.loop.num_active == 0 and s.engine.blocks.num_free_blocks() == 16


def test_a_failing_engine_is_a_500_and_unhealthy(tiny_llama):
    with serving(tiny_llama, tiny_config(kv_blocks=16)) as s:

        def boom():
            raise RuntimeError("boom")

        s.engine.step = boom
        r = httpx.post(s.url + CHAT, json=chat(max_tokens=2))
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "the engine failed: RuntimeError: boom"
        assert r.json()["error"]["type"] == "server_error"
        assert httpx.get(s.url + "/health").status_code == 503
        assert httpx.post(s.url + CHAT, json=chat(max_tokens=2)).status_code == 503


def test_api_key(tiny_llama):
    with serving(tiny_llama, tiny_config(kv_blocks=16), api_key="sekret") as s:
        missing = httpx.post(s.url + CHAT, json=chat(max_tokens=1))
        wrong = httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer nope"})
        assert missing.status_code == wrong.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()  # the client sends the key "none"
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_a_non_loopback_host_without_a_key_warns():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert not is_loopback("myhost")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning.startswith("WARNING") and "--api-key" in warning


def test_serve_refuses_a_bad_port(capsys):
    code, _, err = cli(["serve", "--port", "70000"], capsys)
    assert code == 2 and err.strip() == "error: --port must be in 0..65535, got 70000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pagechat_serve_runs(tiny_llama):
    """The command as a user runs it: it loads the model, answers, and stops on Ctrl-C; bound to
    every interface without a key it warns."""
    port = _free_port()
    cmd = [sys.executable, "-c", "from pagechat.cli.main import main; main()", "serve"]
    cmd += [str(tiny_llama), "--port", str(port), "--host", "0.0.0.0"]
    cmd += ["--served-model-name", "mine", "--device", "cpu", "--eager"]
    env = {k: v for k, v in os.environ.items() if k != "PAGECHAT_API_KEY"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < end, "pagechat serve did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["mine"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert "WARNING: serving on 0.0.0.0 without --api-key" in err
    assert "as 'mine'" in err and proc.returncode == 0


# `pagechat serve` with an engine that loads forever in torch's C++ (a matmul loop): what a
# large model's load looks like to Ctrl+C
SLOW_LOAD = """
import sys, torch
import pagechat.server.serve as serve_mod
from pagechat.cli.main import main

def engine(*args, **kw):
    print("loading", flush=True)
    x = torch.randn(256, 256)
    while True:
        x = (x @ x).tanh()

serve_mod.Engine = engine
sys.argv = ["pagechat", "serve", *sys.argv[1:]]
main()
"""


def test_ctrl_c_during_the_load_exits_130(tiny_llama):
    """Ctrl+C while the engine loads on its thread ends the command at once with 130, as anywhere
    else; the interpreter's exit under a thread inside torch aborted it (SIGABRT) before."""
    cmd = [sys.executable, "-c", SLOW_LOAD, str(tiny_llama), "--port", str(_free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "loading\n"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "terminate" not in err and "Traceback" not in err


def test_serve_refuses_a_kv_events_endpoint_in_use(tiny_llama, capsys):
    """One line naming the endpoint (and no replay endpoint where none was asked for), exit 2."""
    import zmq

    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        code, _, err = cli(["serve", str(tiny_llama), "--kv-events", endpoint], capsys)
    finally:
        taken.close(linger=0)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --kv-events: cannot bind {endpoint}: ") and "None" not in err
