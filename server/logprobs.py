"""Logprobs from the sampler's own records, and in the two shapes OpenAI returns them.

A token's logprob is log(Candidate.prob): the probability the sampler saw for it, after the
repetition penalty and temperature and before top-k / top-p / min-p (temperature 1 when greedy).
"""

from __future__ import annotations

import math

from pagechat.core.sampler import SampleRecord
from pagechat.server.messages import TokenLogprob, TopLogprob

FLOOR = -9999.0  # the logprob of a token whose probability underflowed to 0, as vLLM writes it


def _log(prob: float) -> float:
    return math.log(prob) if prob > 0 else FLOOR


def token_logprob(record: SampleRecord, top: int) -> TokenLogprob | None:
    """The chosen token's logprob and the `top` most likely candidates; None when the sampler
    recorded no candidates (the request asked for no logprobs)."""
    chosen = next((c for c in record.candidates if c.chosen), None)
    if chosen is None:
        return None
    best = tuple(TopLogprob(c.text, _log(c.prob)) for c in record.candidates[:top])
    return TokenLogprob(chosen.text, _log(chosen.prob), best)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": _bytes(t.token),
                "top_logprobs": [
                    {"token": c.token, "logprob": c.logprob, "bytes": _bytes(c.token)}
                    for c in t.top
                ],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> dict:
    """Completions' shape: parallel lists of tokens, their logprobs, a {token: logprob} dict of
    the top candidates per token, and each token's character offset in the reply (from offset)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{c.token: c.logprob for c in t.top} for t in tokens],
        "text_offset": offsets,
    }
