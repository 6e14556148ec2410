"""A request's fields checked one by one (a 400 names the first bad one) and turned into the
engine's SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pagechat.core.errors import PagechatError
from pagechat.core.params import SamplingParams
from pagechat.server.errors import APIError, bad_param
from pagechat.server.prompts import Limits
from pagechat.server.schema import ChatRequest, CompletionRequest, SamplingFields
from pagechat.server.structured import constraint_of
from pagechat.server.tools import Tools, tools_of

MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 2**63


@dataclass(frozen=True, slots=True)
class Options:
    """How one request runs beyond its prompt: the sampling settings shared by its prompts (before
    each prompt's max_tokens), how many top logprobs to return per token (None: no logprobs)."""

    params: SamplingParams
    max_tokens: int | None
    logprobs: int | None
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens, for errors
    tools: Tools | None = None  # the tools the model may call (chat)

    def for_prompt(self, prompt_len: int, limits: Limits) -> SamplingParams:
        """The params of one prompt: max_tokens given (and checked against the room left), or all
        the room left, as vLLM does."""
        room = limits.max_len - prompt_len
        if self.max_tokens is not None and self.max_tokens > room:
            name = self.max_tokens_param
            raise bad_param(
                name,
                f"the prompt has {prompt_len} tokens and {name} asks for {self.max_tokens} "
                f"more, but this server fits {limits.max_len} tokens per sequence; "
                f"lower {name} or shorten the prompt",
                "context_length_exceeded",
            )
        tokens = self.max_tokens if self.max_tokens is not None else room
        return replace(self.params, max_tokens=tokens)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise bad_param(param, message)


def _finite(req: SamplingFields, *names: str) -> None:
    for name in names:
        value = getattr(req, name)
        _require(value is None or math.isfinite(value), name, f"{name} must be a finite number")


def _check_common(req: SamplingFields, max_n: int) -> None:
    """Checks both endpoints share, in the order a reader of the request would meet them."""
    _finite(req, "temperature", "top_p", "min_p", "repetition_penalty")
    _require(
        1 <= req.n <= max_n,
        "n",
        f"n must be between 1 and {max_n} (the server's --max-seqs), got {req.n}",
    )
    t, p = req.temperature, req.top_p
    _require(t is None or t >= 0, "temperature", f"temperature must be >= 0, got {t}")
    _require(p is None or 0 < p <= 1, "top_p", f"top_p must be in (0, 1], got {p}")
    _require(req.top_k is None or req.top_k >= -1, "top_k", "top_k must be -1 (off), 0 or more")
    m, r = req.min_p, req.repetition_penalty
    _require(m is None or 0 <= m <= 1, "min_p", f"min_p must be in [0, 1], got {m}")
    _require(r is None or r > 0, "repetition_penalty", f"repetition_penalty must be > 0, got {r}")
    seed = req.seed
    _require(
        seed is None or 0 <= seed < SEED_LIMIT, "seed", f"seed must be in 0..2^63-1, got {seed}"
    )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _require(
            not value,
            name,
            f"{name} is not supported (the engine has none); leave it 0, "
            "or use repetition_penalty (vLLM's meaning)",
        )
    _require(not req.logit_bias, "logit_bias", "logit_bias is not supported")
    _require(
        req.stream or req.stream_options is None,
        "stream_options",
        "stream_options is only allowed when stream is true",
    )


def _stop(req: SamplingFields) -> tuple[str, ...]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    _require(all(stop), "stop", "stop strings must not be empty")
    return tuple(stop)


def _max_tokens(value: int | None, param: str) -> int | None:
    _require(value is None or value >= 1, param, f"{param} must be >= 1, got {value}")
    return value


def _params(req: SamplingFields, num_candidates: int, tools: Tools | None = None) -> SamplingParams:
    """The engine's params (max_tokens is set per prompt); OpenAI's default temperature is 1; a
    constraint in any peer's dialect (server/structured.py), or the one tool_choice sets."""
    constraint = constraint_of(req)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and constraint is not None:
        raise bad_param("tool_choice", "a required or named tool call takes no other constraint")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            seed=req.seed,
            stop=_stop(req),
            ignore_eos=req.ignore_eos,
            n=req.n,
            num_candidates=num_candidates,
            constraint=forced or constraint,
        ).validate()
    except PagechatError as e:  # a rule the checks above do not know yet
        raise APIError(400, str(e)) from None


def chat_options(req: ChatRequest, max_n: int, template: str) -> Options:
    """A chat request's options (template: the model's chat template, which says how it writes
    a tool call), or a 400 naming its first bad field."""
    _check_common(req, max_n)
    tools = tools_of(req.tools, req.tool_choice, template, req.parallel_tool_calls)
    k = req.top_logprobs
    _require(
        k is None or 0 <= k <= MAX_TOP_LOGPROBS,
        "top_logprobs",
        f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
    )
    _require(k is None or req.logprobs, "top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (k or 0) if req.logprobs else None
    tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    tokens = _max_tokens(tokens, param)
    return Options(_params(req, _candidates(logprobs), tools), tokens, logprobs, param, tools)


def completion_options(req: CompletionRequest, max_n: int) -> Options:
    """A completion request's options, or a 400 naming its first bad field."""
    _check_common(req, max_n)
    _require(not req.echo, "echo", "echo is not supported")
    _require(req.suffix is None, "suffix", "suffix is not supported")
    _require(
        req.best_of is None or req.best_of == req.n,
        "best_of",
        "best_of is not supported (leave it out, or equal to n)",
    )
    k = req.logprobs
    _require(
        k is None or 0 <= k <= MAX_TOP_LOGPROBS,
        "logprobs",
        f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
    )
    tokens = _max_tokens(req.max_tokens, "max_tokens")
    return Options(_params(req, _candidates(k)), tokens, k)


def _candidates(logprobs: int | None) -> int:
    """Candidates the sampler records per token: none without logprobs (they cost a top-k per
    token); at least one with them, so the chosen token's own record is there."""
    return 0 if logprobs is None else max(logprobs, 1)
