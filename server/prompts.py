"""Prompts to token ids on the HTTP side, with a tokenizer of its own (the engine's thread
detokenises with the engine's; a fast tokenizer is not safe to share across threads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagechat.core.loader import load_tokenizer
from pagechat.server.errors import bad_param
from pagechat.server.schema import Message

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
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat(self, messages: list[Message]) -> list[int]:
        """The conversation through the chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise bad_param(
                "messages", "the model has no chat template; use /v1/completions with a prompt"
            )
        turns = [_turn(i, m) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False
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

    def _ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        bad = [t for t in prompt if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise bad_param(
                "prompt",
                f"token id {bad[0]} is outside the vocabulary (0..{self.limits.vocab_size - 1})",
            )
        return list(prompt)

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


def _turn(i: int, message: Message) -> dict:
    """One message as the chat template takes it: a role it knows and the text."""
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
    return {"role": role, "content": content or ""}
