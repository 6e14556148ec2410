"""One HTTP request on the handler's side: its prompts submitted to the engine loop, the deltas
that come back, and its abort when the client goes away. Nothing of it outlives the handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagechat.server.engine_loop import ServerLoop
from pagechat.server.errors import APIError
from pagechat.server.messages import ChoiceDelta, ChoiceUsage, Submission, TokenLogprob
from pagechat.server.prompts import Limits
from pagechat.server.sampling import Options


@dataclass(slots=True)
class Choice:
    """One choice's whole output, gathered from its deltas."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: ChoiceUsage | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: ChoiceDelta) -> None:
        self.parts.append(delta.text)
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage


def usage_of(usages: list[ChoiceUsage]) -> dict:
    """OpenAI's usage object summed over choices, with the prefix cache's share of the prompt."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)},
    }


class Job:
    """The submissions of one request (a prompt each, n choices each) and their deltas."""

    def __init__(
        self,
        loop: ServerLoop,
        prompts: list[list[int]],
        options: Options,
        limits: Limits,
        ref: tuple[str, str] = ("api chat", ""),
    ) -> None:
        """ref: the API the request came through and its response's id, as watchers see them."""
        if not loop.alive:
            raise APIError(503, f"the engine is not running: {loop.error or 'stopped'}")
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        n = options.params.n
        params = [options.for_prompt(len(ids), limits) for ids in prompts]  # may refuse: 400
        self._subs = [
            Submission(ids, p, options.logprobs, i * n, self._queue, label=ref[0], ref=ref[1])
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        self.num_choices = n * len(prompts)
        self._open = self.num_choices  # choices not finished yet
        self._closed = False
        self.usages: list[ChoiceUsage] = []

    def start(self) -> None:
        for sub in self._subs:
            self._loop.submit(sub)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Each batch of deltas as the engine's steps produce them, until every choice ended; an
        error of any choice ends the request as an APIError."""
        while self._open:
            batch = await self._queue.get()
            for delta in batch:
                if delta.error:
                    raise self._failure(delta)
                if delta.finished:
                    self._open -= 1
                    self.usages.append(delta.usage or ChoiceUsage(0, 0, 0))
            yield batch

    def _failure(self, delta: ChoiceDelta) -> APIError:
        if self._loop.error:
            return APIError(500, f"the engine failed: {self._loop.error}")
        return APIError(500 if delta.fault else 400, delta.error)

    async def collect(self) -> list[Choice]:
        """Every choice's whole output."""
        choices = [Choice(i) for i in range(self.num_choices)]
        async for batch in self.deltas():
            for delta in batch:
                choices[delta.index].add(delta)
        return choices

    def close(self) -> None:
        """Abort whatever has not finished (a client gone, an error): the engine frees its
        blocks at its next look at the inbox, before its next step."""
        if self._open and not self._closed:
            for sub in self._subs:  # the engine's loop skips those already finished
                self._loop.cancel(sub)
        self._closed = True
