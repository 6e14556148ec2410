"""Response bodies in OpenAI's shapes: whole completions, streamed chunks, and the SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pagechat.server.jobs import Choice
from pagechat.server.logprobs import chat_logprobs, completion_logprobs
from pagechat.server.messages import ChoiceDelta
from pagechat.server.tools import CallStream, Tools

DONE = "data: [DONE]\n\n"


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass(frozen=True, slots=True)
class Header:
    """The fields every body of one response repeats."""

    kind: str  # "chat" | "completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, kind: str, model: str, request_id: str | None = None) -> Header:
        """request_id: the client's own id for the request (its X-Request-Id header), which the
        response's id then carries, as vLLM does; a fresh one when None."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{request_id or uuid.uuid4().hex}")

    def body(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _logprobs(kind: str, choice_logprobs: list, wanted: bool, offset: int = 0) -> dict | None:
    if not wanted:
        return None
    if kind == "chat":
        return chat_logprobs(choice_logprobs)
    return completion_logprobs(choice_logprobs, offset)


def whole(
    header: Header, choices: list[Choice], usage: dict, logprobs: bool, tools: Tools | None = None
) -> dict:
    """A non-streamed response: every choice's text (or its tool calls), logprobs and finish
    reason, and usage."""
    out = []
    for c in choices:
        lp = _logprobs(header.kind, c.logprobs, logprobs)
        reason = c.finish_reason
        if header.kind == "chat":
            message = {"role": "assistant", "content": c.text}
            rest, calls = tools.calls(c.text) if tools is not None else (c.text, [])
            if calls:
                message = {"role": "assistant", "content": rest or None}
                message["tool_calls"] = [call.as_dict() for call in calls]
                reason = tools.finish(reason, True)
            out.append({"index": c.index, "message": message, "logprobs": lp})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": lp})
        out[-1]["finish_reason"] = reason
    return {**header.body(chunk=False), "choices": out, "usage": usage}


class ChunkWriter:
    """The chunks of one streamed response; remembers per choice only what the format needs
    (completions' character offsets)."""

    def __init__(
        self, header: Header, logprobs: bool, include_usage: bool, tools: Tools | None = None
    ) -> None:
        self.header, self.logprobs, self.include_usage = header, logprobs, include_usage
        self.tools = tools
        self._offsets: dict[int, int] = {}
        self._calls: dict[int, CallStream] = {}  # per choice, with tools

    def _chunk(self, choice: dict) -> str:
        body = {**self.header.body(chunk=True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self, index: int) -> str:
        """Chat's first chunk of a choice: the assistant's role, no text yet."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._chunk(choice)

    def delta(self, d: ChoiceDelta) -> str | None:
        """A delta's chunk; None when it carries nothing. A token whose text is held back (part of
        a character, or of a stop string) still gets its chunk with empty text, as vLLM sends it:
        clients count and time tokens by chunks."""
        if not (d.text or d.logprobs or d.finished or d.tokens):
            return None
        offset = self._offsets.get(d.index, 0)
        self._offsets[d.index] = offset + sum(len(t.token) for t in d.logprobs)
        lp = _logprobs(self.header.kind, list(d.logprobs), self.logprobs, offset)
        if self.tools is not None:
            return self._tool_chunks(d, lp)
        if self.header.kind == "chat":
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {}}
        else:
            choice = {"index": d.index, "text": d.text}
        return self._chunk({**choice, "logprobs": lp, "finish_reason": d.finish_reason})

    def _tool_chunks(self, d: ChoiceDelta, lp: dict | None) -> str:
        """A chat delta where the model may call tools: its content and the calls it completes
        (server/tools.py's CallStream), the logprobs on the first chunk, the finish in an empty
        delta of its own after them, as vLLM streams it."""
        stream = self._calls.setdefault(d.index, CallStream(self.tools))
        deltas = stream.feed(d.text, d.finished)
        if not deltas and not d.finished:
            return ""  # held back (a call being decided): vLLM sends nothing for these tokens
        if d.finished:
            deltas.append({})
        reason = self.tools.finish(d.finish_reason, bool(stream.calls))
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {"index": d.index, "delta": delta, "logprobs": lp if k == 0 else None}
            chunks.append(self._chunk({**choice, "finish_reason": reason if last else None}))
        return "".join(chunks)

    def usage(self, usage: dict) -> str:
        """The last chunk with stream_options.include_usage: no choices, the whole usage."""
        return sse({**self.header.body(chunk=True), "choices": [], "usage": usage})
