"""llguidance against xgrammar on this CPU (docs/benchmarks.md, "Structured outputs"): the time to
build each library's view of a tokenizer, to compile a JSON schema into a matcher, and to compute
the token mask at each step of a fixed answer. Run by hand, once per library, each where it is
installed (xgrammar is not a dependency: it brings triton):

    python -m pagechat.tools.grammar_libs llguidance HF_DIR
    XGR_VENV/bin/python -m pagechat.tools.grammar_libs xgrammar HF_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
            "minItems": 1,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace the first programmer", "age": 36, "tags": ["a", "ccc", "bb"]}'


def _llguidance(tok, ids: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def run() -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compiled = time.perf_counter() - t0
        mask, times = lt.allocate_token_bitmask(1, lltok.vocab_size), []
        for token in ids:
            t1 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t1)
            assert m.consume_token(token), m.get_error()
        return compiled, times

    return run


def _xgrammar(tok, ids: list[int]):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=2)

    def run() -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
        compiled = time.perf_counter() - t0
        mask, times = xgr.allocate_token_bitmask(1, info.vocab_size), []
        for token in ids:
            t1 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t1)
            assert m.accept_token(token)
        return compiled, times

    return run


def main(which: str, model_dir: str, runs: int = 5) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(ANSWER, add_special_tokens=False).input_ids
    t0 = time.perf_counter()
    run = (_llguidance if which == "llguidance" else _xgrammar)(tok, ids)
    view = time.perf_counter() - t0
    results = [run() for _ in range(runs)]
    masks = sorted(x for _, times in results[1:] for x in times)
    compiled = statistics.median(c for c, _ in results)
    print(
        f"{which}: tokenizer view {1000 * view:.0f} ms; compile + matcher {1000 * compiled:.2f} ms"
        f" (first {1000 * results[0][0]:.1f}); mask a token median "
        f"{1e6 * statistics.median(masks):.0f} us, p90 {1e6 * masks[int(0.9 * len(masks))]:.0f}"
        f" us, max {1e6 * masks[-1]:.0f} us over {len(ids)} tokens"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
