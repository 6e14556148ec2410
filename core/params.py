"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagechat.core.errors import PagechatError

CONSTRAINTS = ("json", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a reply must match, token by token (core/grammar.py compiles it): any JSON object
    ("json"), a JSON schema (spec: the schema as JSON text), a regular expression, one of a choice
    of strings (spec: a JSON list), or a grammar (spec: Lark, or GBNF as llama.cpp writes it)."""

    kind: str
    spec: str = ""
    source: str = ""  # the file it was read from, if any (the app and the logs name it)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINTS:
            raise PagechatError(
                f"a constraint is one of {', '.join(CONSTRAINTS)}, got {self.kind!r}"
            )

    @property
    def label(self) -> str:
        """How the app and the logs name it: 'json', 'json schema', 'regex [0-9]+'..."""
        if self.kind in ("json", "json_schema", "grammar"):
            name = self.source.rsplit("/", 1)[-1]
            return self.kind.replace("_", " ") + (f" {name}" if name else "")
        short = self.spec if len(self.spec) <= 24 else self.spec[:23] + "…"
        return f"{self.kind} {short}"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_candidates: int = 8  # top-N candidates recorded per sampled token
    n: int = 1  # samples per prompt: forks sharing the prompt's KV blocks (copy-on-write)
    beam_width: int = 1  # > 1: beam search (deterministic; the sampling settings above are unused)
    length_penalty: float = 1.0  # a finished beam's score is its log-probability / length**this
    early_stopping: bool | str = False  # True, False or "never", as transformers reads them
    constraint: Constraint | None = None  # the reply must match it (grammar-constrained decoding)

    def _rules(self) -> list[tuple[str, object, str, bool]]:
        """(option name, value, rule, whether it holds) for every field, in the order checked."""
        return [
            ("temperature", self.temperature, "must be >= 0", self.temperature >= 0),
            ("top-p", self.top_p, "must be in (0, 1]", 0 < self.top_p <= 1),
            ("top-k", self.top_k, "must be >= 0 (0 = off)", self.top_k >= 0),
            ("min-p", self.min_p, "must be in [0, 1]", 0 <= self.min_p <= 1),
            (
                "repetition-penalty",
                self.repetition_penalty,
                "must be > 0",
                self.repetition_penalty > 0,
            ),
            ("max-tokens", self.max_tokens, "must be >= 1", self.max_tokens >= 1),
            ("num-candidates", self.num_candidates, "must be >= 0", self.num_candidates >= 0),
            ("n", self.n, "must be >= 1", self.n >= 1),
            (
                "seed",
                self.seed,
                "must be between 0 and 2^63 - 1",  # what torch's generators take, with seed + j
                self.seed is None or 0 <= self.seed < 2**63,
            ),
            ("beams", self.beam_width, "must be >= 1", self.beam_width >= 1),
            ("length-penalty", self.length_penalty, "must be finite", True),  # the loop checks
            (
                "early-stopping",
                self.early_stopping,
                "must be true, false or never",
                self.early_stopping in (True, False, "never"),
            ),
            (
                "beams",
                self.beam_width,
                "cannot be combined with n > 1",
                self.beam_width == 1 or self.n == 1,
            ),
        ]

    def validate(self) -> SamplingParams:
        """Raise PagechatError naming the first out-of-range field; return self when all hold."""
        for name, value, rule, ok in self._rules():
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise PagechatError(f"{name} {rule}, got {value}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
