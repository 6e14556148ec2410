"""Tool calls: the request's `tools` and `tool_choice` checked, the tools shown to the model, the
model's calls found in its text per template family, and `required` or a named function turned
into a constraint whose every output is a call with arguments that satisfy the function's schema.

Families (how a model writes a call, read from its chat template):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as Qwen2, Qwen3 and
  SmolLM2 write it (and the family of a template that does not render tools: such a model is
  shown the tools in its system message, in Qwen2.5's words);
- llama3: a bare JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`);
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagechat.core.grammar import JSON_SPACE
from pagechat.core.params import Constraint
from pagechat.server.errors import bad_param

_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    parameters: dict  # a JSON schema of the arguments object


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: OpenAI's id, the function's name and its arguments (JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools and what it lets the model do with them."""

    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | a function's name
    family: str  # "hermes" | "llama3" | "mistral"
    raw: tuple[dict, ...]  # the tools as the request gave them (for the chat template)
    parallel: bool = True  # required may make several calls (OpenAI's parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        """For required or a named function: every output is calls (a named function: one),
        with valid arguments."""
        if self.choice == "auto":
            return None
        many = self.parallel and self.choice == "required"
        funcs = [f for f in self.functions if self.choice in ("required", f.name)]
        args = "arguments" if self.family != "llama3" else "parameters"
        call = {
            "x-guidance": JSON_SPACE,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, args: f.parameters},
                    "required": ["name", args],
                    "additionalProperties": False,
                }
                for f in funcs
            ],
        }
        if self.family == "mistral":
            calls = {"type": "array", "items": call, "minItems": 1}
            if not many:
                calls["maxItems"] = 1
            grammar = f'start: "[TOOL_CALLS]" json\njson: %json {json.dumps(calls)}'
            return Constraint("grammar", grammar)
        if self.family == "llama3":
            return Constraint("json_schema", json.dumps(call))
        more = ' ("\\n" call)*' if many else ""
        grammar = (
            f"start: call{more}\n"
            f'call: "<tool_call>\\n" json "\\n</tool_call>"\njson: %json {json.dumps(call)}'
        )
        return Constraint("grammar", grammar)

    def finish(self, reason: str | None, called: bool) -> str | None:
        """The finish reason of a choice that made calls: tool_calls where the model chose to
        call (auto, required); stop where the request named the function, as OpenAI says it."""
        named = self.choice not in ("auto", "required")
        return "tool_calls" if called and reason == "stop" and not named else reason

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside any call, the calls) of a finished output."""
        return _PARSERS[self.family](text, {f.name for f in self.functions})


def tools_of(
    tools: list | None, choice: Any, template: str, parallel: bool | None = None
) -> Tools | None:
    """The request's tools, checked (a 400 names the bad field); None when the model is not to
    call any (no tools, or tool_choice none)."""
    if choice == "none" or not tools:
        if choice not in (None, "none", "auto") and not tools:
            raise bad_param("tool_choice", "tool_choice needs tools")
        return None
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise bad_param("tools", "two tools have the same name")
    choice = _choice(choice, names)
    return Tools(functions, choice, family(template), tuple(tools), parallel is not False)


def family(template: str) -> str:
    """How a model whose chat template is this writes a call."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def renders_tools(template: str) -> bool:
    """Whether the chat template shows the model its tools itself."""
    return "tools" in template


def system_block(tools: Tools) -> str:
    """The tools as a template that does not render them is shown them, in the system message."""
    return _SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools.raw))


def _function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_param(where, f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_param(f"{where}.function", f"{where}.function must name the function")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_param(f"{where}.function.parameters", "parameters must be a JSON schema")
    return Function(fn["name"], params)


def _choice(choice: Any, names: list[str]) -> str:
    if choice in (None, "auto", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name in names:
            return name
        raise bad_param("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    raise bad_param(
        "tool_choice",
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}",
    )


def _call(obj: Any, names: set[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _hermes(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    calls = []
    for body in _HERMES.findall(text):
        call = _call(_loads(body), names, "arguments")
        if call is not None:
            calls.append(call)
    # what is left, less a call cut short at the end (max_tokens)
    rest = _HERMES.sub("", text).split(_OPEN)[0].strip() if calls else text
    return rest, calls


def _llama3(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    call = _call(_loads(body), names, "parameters")
    return ("", [call]) if call else (text, [])


def _mistral(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    head, _, body = text.partition("[TOOL_CALLS]")
    found = _loads(body.strip() if body else text.strip())  # the marker may be a special token
    calls = (
        [c for o in found if (c := _call(o, names, "arguments"))] if isinstance(found, list) else []
    )
    return (head.strip() if body else "", calls) if calls else (text, [])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_PARSERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_STARTS = ("{", "[", "[TOOL_CALLS]", "<|python_tag|>")  # how a llama3 or mistral call begins


class CallStream:
    """One streamed choice's text as chat deltas, as vLLM streams them: content as it comes; a
    call's id, type and name once its name is known, then its arguments as the model writes them
    (held back only where they may be the call's own end); text that may begin a call is held
    back until it is decided."""

    def __init__(self, tools: Tools) -> None:
        self.tools, self.buf, self.calls = tools, "", 0
        self._whole: bool | None = None  # llama3 / mistral: the output is a call (or is not)
        self._args_at: int | None = None  # hermes: where the open call's arguments begin in buf
        self._sent = 0  # of those, the characters streamed

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas `text` completes; final: the choice ended, nothing is held back."""
        self.buf += text
        if self.tools.family == "hermes":
            return self._hermes(final)
        if self._whole is None and (self.buf.strip() or final):
            self._whole = self.buf.lstrip().startswith(_STARTS)
        if self._whole is None or self._whole and not final:
            return []
        text, self.buf = self.buf, ""
        rest, calls = self.tools.calls(text) if self._whole else (text, [])
        return self._content(rest if calls else text) + self._deltas(calls)

    def _hermes(self, final: bool) -> list[dict]:
        out = []
        while True:
            start = self.buf.find(_OPEN)
            if start < 0:
                return out + self._plain(final)
            out += self._content(self.buf[:start].rstrip())
            self.buf = self.buf[start:]
            end = self.buf.find(_CLOSE)
            if end < 0 and not final:
                return out + self._open_call()
            whole = self.buf if end < 0 else self.buf[: end + len(_CLOSE)]
            out += self._close_call(whole)
            after = self.buf[len(whole) :]
            self.buf = after.lstrip() if self.calls else after

    def _plain(self, final: bool) -> list[dict]:
        """Text outside calls: all of it but what may begin one (whitespace between calls: none)."""
        hold = 0 if final else _held(self.buf, _OPEN)
        cut = len(self.buf) - hold
        if self.calls and not self.buf[:cut].strip():
            self.buf = "" if final else self.buf
            return []
        text, self.buf = self.buf[:cut], self.buf[cut:]
        return self._content(text)

    def _open_call(self) -> list[dict]:
        """A call being written: its head once the name is known, then its arguments so far,
        less a closing brace that may be the call's own."""
        out = []
        if self._args_at is None:
            head = _HEAD.match(self.buf, len(_OPEN))
            names = {f.name for f in self.tools.functions}
            # known once the arguments' first character is in (the spaces before it are not theirs)
            if head is None or head.end() == len(self.buf) or head.group(1) not in names:
                return []
            self._args_at, self._sent = head.end(), 0
            out.append({"tool_calls": [self._head(ToolCall(head.group(1), ""))]})
        args = self.buf[self._args_at :]
        safe = args[: args.rfind("}")] if "}" in args else args
        return out + self._args(safe.rstrip())

    def _close_call(self, whole: str) -> list[dict]:
        """A call's text is whole: the rest of its streamed arguments, or the call at once."""
        _, calls = self.tools.calls(whole)
        if self._args_at is None:
            return self._deltas(calls) if calls else self._content(whole)
        args = whole[self._args_at :].removesuffix(_CLOSE).rstrip().removesuffix("}").rstrip()
        out = self._args(args)
        self._args_at = None
        self.calls += 1
        return out

    def _args(self, text: str) -> list[dict]:
        fresh, self._sent = text[self._sent :], max(self._sent, len(text))
        return (
            [{"tool_calls": [{"index": self.calls, "function": {"arguments": fresh}}]}]
            if fresh
            else []
        )

    def _head(self, call: ToolCall) -> dict:
        return {
            "index": self.calls,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }

    def _content(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        """Whole calls at once: each one's head, then its arguments."""
        out = []
        for call in calls:
            args = {"index": self.calls, "function": {"arguments": call.arguments}}
            out += [{"tool_calls": [self._head(call)]}, {"tool_calls": [args]}]
            self.calls += 1
        return out


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')


def _held(buf: str, marker: str) -> int:
    """How much of buf's end to hold back: what may begin marker."""
    return next((k for k in range(len(marker) - 1, 0, -1) if buf.endswith(marker[:k])), 0)
