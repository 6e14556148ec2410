"""Prompts to token ids on the HTTP side, with a tokenizer of its own (the engine's thread
detokenises with the engine's; a fast tokenizer is not safe to share across threads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagechat.core.loader import load_tokenizer
from pagechat.server.errors import bad_param
from pagechat.server.schema import Message
from pagechat.server.tools import Tools, renders_tools, system_block

_ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclass(frozen=True, slots=True)
class Limits:
    """What a prompt and its reply must fit: the model's context and the KV pool."""

    max_model_len: int
    pool_tokens: int  # tokens the whole KV pool holds
    vocab_size: int

    @property
    def max_len(self) -> int:
        """Tokens one sequence may reach: prompt plus reply."""
        return min(self.max_model_len, self.pool_tokens)


class PromptEncoder:
    """Encodes chat messages (through the model's chat template) and plain prompts."""

    def __init__(self, model_dir: Path, limits: Limits) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.limits = limits

    @property
    def template(self) -> str:
        """The model's chat template ("" without one)."""
        return str(getattr(self.tokenizer, "chat_template", None) or "")

    def chat(self, messages: list[Message], tools: Tools | None = None) -> list[int]:
        """The conversation through the chat template, ready for the assistant's turn; with
        tools, shown the model by its template, or in the system message where it shows none."""
        if not self.template:
            raise bad_param(
                "messages", "the model has no chat template; use /v1/completions with a prompt"
            )
        own = renders_tools(self.template)
        turns = [_turn(i, m, own) for i, m in enumerate(messages)]
        extra = {}
        if tools is not None and own:
            extra["tools"] = list(tools.raw)
        elif tools is not None:
            turns = _with_system(turns, system_block(tools))
        try:
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as e:  # the template's own checks (e.g. roles must alternate)
            message = f"the model's chat template refused the messages: {e}"
            raise bad_param("messages", message) from None
        return self.checked(self.tokenizer(text, add_special_tokens=False).input_ids, "messages")

    def prompts(self, prompt: str | list) -> list[list[int]]:
        """A completion request's prompts: text, token ids, or a list of either."""
        if isinstance(prompt, str):
            batch: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise bad_param("prompt", "prompt is an empty list")
        return [self.checked(self._ids(p), "prompt") for p in batch]

    def _ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        bad = [t for t in prompt if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise bad_param(
                param,
                f"token id {bad[0]} is outside the vocabulary (0..{self.limits.vocab_size - 1})",
            )
        return list(prompt)

    def text(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included (what a cached block holds)."""
        self._ids(ids, "tokens")  # each in the vocabulary, or a 400 naming it
        return self.tokenizer.decode(ids)

    def checked(self, ids: list[int], param: str) -> list[int]:
        """ids, unless empty or leaving no room for one new token."""
        if not ids:
            raise bad_param(param, f"{param} is empty")
        if len(ids) >= self.limits.max_len:
            raise bad_param(
                param,
                f"the prompt has {len(ids)} tokens, but this server fits {self.limits.max_len} "
                "tokens per sequence (prompt and reply together); shorten the prompt",
                "context_length_exceeded",
            )
        return ids


def _turn(i: int, message: Message, own_tools: bool) -> dict:
    """One message as the chat template takes it: a role it knows and the text; an assistant's
    tool calls and a tool's answer as the template takes them (own_tools), else as the text a
    Hermes-style model reads."""
    if message.role not in _ROLES:
        raise bad_param(
            f"messages[{i}].role",
            f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, got {message.role!r}",
        )
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_param(
                    f"messages[{i}].content[{j}]",
                    f"only text content is supported, got a part of type {part.type!r}",
                )
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    turn = {"role": role, "content": content or ""}
    calls = [_call(i, c) for c in message.tool_calls or ()]
    if calls and own_tools:
        turn["tool_calls"] = calls
    elif calls:
        text = "\n".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in calls)
        turn["content"] = f"{turn['content']}\n{text}" if turn["content"] else text
    if role == "tool" and own_tools:
        turn["tool_call_id"] = message.tool_call_id
    elif role == "tool":
        turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
    return turn


def _call(i: int, call: dict) -> dict:
    """An assistant's tool call as templates take it: the arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_param(f"messages[{i}].tool_calls", "a tool call needs function.name")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise bad_param(
            f"messages[{i}].tool_calls", "a tool call's arguments must be JSON text"
        ) from None
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": fn["name"], "arguments": args},
    }


def _with_system(turns: list[dict], block: str) -> list[dict]:
    """The turns with block at the end of the system message (one made where there is none)."""
    if turns and turns[0]["role"] == "system":
        head = turns[0]["content"]
        return [{"role": "system", "content": f"{head}\n\n{block}" if head else block}, *turns[1:]]
    return [{"role": "system", "content": block}, *turns]
