"""Constrained decoding: a Constraint compiled by llguidance against the model's tokenizer, and
each sequence's place in it (Matcher), whose token mask the sampler applies before its filters.

llguidance, not xgrammar: one 3 MB wheel with no dependencies (xgrammar brings triton, 1 GB), it
validates a grammar without a tokenizer (the server answers a bad schema with a 400 before any
token), and its mask costs ~11 us a token on SmolLM2's 49,152-token vocabulary, well under 1% of a
decode step (docs/benchmarks.md, "Structured outputs").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from pagechat.core.errors import PagechatError
from pagechat.core.params import Constraint

# Between JSON tokens: nothing, a space, or a newline and up to 20 spaces or tabs, as llama.cpp's
# json-schema-to-grammar bounds it; unbounded whitespace lets a small model pad forever.
JSON_SPACE = {"whitespace_pattern": "(?:\n[ \t]{0,20}| )?"}


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint, checked; a PagechatError says what is wrong."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_SPACE)
        elif kind == "json_schema":
            schema = json.dumps(_json(spec, "schema"))
            grammar = LLMatcher.grammar_from_json_schema(schema, JSON_SPACE)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark(_choice(spec))
        else:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(spec))
    except PagechatError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's converters raise plain Exception
        raise PagechatError(f"the {constraint.label} constraint: {_first(e)}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise PagechatError(f"the {constraint.label} constraint: {_first(error)}")
    return grammar


def constraint_file(path: Path, kind: str) -> Constraint:
    """A JSON-schema or grammar file as a checked constraint; one line saying what is wrong."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PagechatError(f"cannot read {path}: {e}") from None
    constraint = Constraint(kind, text, str(path))
    grammar_of(constraint)
    return constraint


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PagechatError(f"the {what} is not JSON: {e}") from None


def _choice(spec: str) -> str:
    """A Lark grammar matching exactly one of the strings of a JSON list."""
    options = _json(spec, "choice")
    if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
        raise PagechatError("a choice must be a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(o) for o in options)


def _first(error) -> str:
    return str(error).strip().splitlines()[0]


class Grammars:
    """Compiles constraints for one model: llguidance's view of its tokenizer is built once, on
    the first constrained request (about 0.4 s for a 49k vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._ll = None

    def matcher(self, constraint: Constraint) -> Matcher:
        """A new sequence's matcher; PagechatError for a constraint that does not compile."""
        from llguidance import LLMatcher

        grammar = grammar_of(constraint)
        matcher = LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise PagechatError(f"the {constraint.label} constraint: {_first(matcher.get_error())}")
        return Matcher(matcher, self.vocab_size)

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            try:
                self._ll = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids)
                )
            except Exception as e:  # noqa: BLE001 - a slow (Python) tokenizer, an odd vocabulary
                raise PagechatError(f"constraints need a fast tokenizer: {_first(e)}") from None
        return self._ll


class Matcher:
    """One sequence's place in its constraint: which tokens may come next, and the tokens taken."""

    __slots__ = ("_m", "vocab_size", "_bitmask")

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.torch as lt

        self._m, self.vocab_size = matcher, vocab_size
        self._bitmask = lt.allocate_token_bitmask(1, vocab_size)  # refilled for every mask

    def allowed(self) -> torch.Tensor:
        """The tokens that may come next, as a bool mask [vocab_size] of its own."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self._m, self._bitmask, 0)
        # bit k of byte b (little-endian int32 words) is token 8 * b + k; numpy unpacks the
        # 49,152 bits of SmolLM2's vocabulary in 11 us where torch's shifts take 79
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size]).view(torch.bool)

    def consume(self, token: int) -> bool:
        """Take a token the mask allowed; False (and the matcher unchanged) for one it did not."""
        return self._m.try_consume_tokens([token]) == 1

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    def fork(self) -> Matcher:
        """A copy for a sequence forked from this one (a sample, a beam)."""
        return Matcher(self._m.deep_copy(), self.vocab_size)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more than an end of sequence."""
        return self._m.is_stopped()

    def where(self) -> str:
        """Where the matcher stands, for the sampling panel: the text the grammar forces next."""
        forced = bytes(self._m.compute_ff_bytes()).decode("utf-8", "replace")
        return f"next: {forced!r}" if forced else ("may end" if self._m.is_accepting() else "")


def masks_along(matcher: Matcher, tokens: list[int]) -> list[tuple[torch.Tensor, str]]:
    """(mask, place) before each of tokens and after the last, as if they were taken (a draft
    being verified; the matcher is left as it was). Past the first token the grammar refuses,
    that position's mask repeats: it rejects the draft there, so later positions decide nothing."""
    masks, taken = [], 0
    for token in [*tokens, None]:
        masks.append((matcher.allowed(), matcher.where()))
        if token is None or not matcher.consume(token):
            break
        taken += 1
    matcher.rollback(taken)
    return masks + masks[-1:] * (len(tokens) + 1 - len(masks))
