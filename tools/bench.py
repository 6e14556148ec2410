"""`pagechat bench`: single-stream, 8-request, multi-turn, bandwidth figures; optionally vs HF too.

Everything runs in one process on the same weights. Each figure is the median of `rounds`
repetitions, and with --vs-hf the two sides alternate round by round, so a machine that gets busier
or quieter during the run moves both alike: quote the ratios.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pagechat.core.engine import Engine
from pagechat.core.errors import PagechatError
from pagechat.core.memory import kv_bytes_per_token, weight_report
from pagechat.core.modelspec import dtype_name
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import read_bandwidth
from pagechat.core.sources import gguf_file
from pagechat.tools.step_profile import profile_decode

PROMPT_TOKENS, DECODE_TOKENS = 128, 64
BATCH_PROMPTS = (32, 96, 160, 224, 288, 352, 416, 512)  # 8 requests of mixed lengths
BATCH_OUTPUTS = (16, 128, 48, 96, 32, 112, 64, 80)
TURNS, TURN_USER, TURN_REPLY = 8, 24, 24
KEYS = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "batch8_tok_s", "turn_ttft_ms", "mbu")


@dataclass(slots=True)
class Workload:
    """The token ids every side runs: deterministic under the seed, never special tokens."""

    prompt: list[int]
    batch: list[list[int]]
    turns: list[list[int]]  # user text of each turn
    # reply tokens transformers' history takes after each turn (pagechat keeps its own, as long)
    replies: list[list[int]]

    @staticmethod
    def make(vocab: int, special: set[int], max_len: int, seed: int = 0) -> Workload:
        rng = random.Random(seed)
        ids = [i for i in range(min(vocab, 32000)) if i not in special]

        def draw(n: int) -> list[int]:
            return [rng.choice(ids) for _ in range(n)]

        # a model with a short context gets the same mix, scaled down to fit
        scale = min(1.0, (max_len - max(BATCH_OUTPUTS)) / max(BATCH_PROMPTS))
        return Workload(
            draw(PROMPT_TOKENS),
            [draw(int(n * scale)) for n in BATCH_PROMPTS],
            [draw(TURN_USER) for _ in range(TURNS)],
            [draw(TURN_REPLY) for _ in range(TURNS)],
        )


# no sampling candidates: the app's sampling panel records them (a top-k and a softmax over the
# vocabulary every step, about 1 ms of a 135M bf16 step on 2 threads); the engine's speed, as
# `generate` and transformers run it, is without them
GREEDY = dict(temperature=0.0, ignore_eos=True, num_candidates=0)


def pagechat_round(engine: Engine, w: Workload) -> dict:
    """One repetition of every figure through the engine, decoding plainly (spec_round measures
    speculation: on the workload's random-token prompts no draft is ever accepted, and the figures
    compare with plain transformers)."""
    engine.set_speculation(False)
    out: dict = {}
    seen: dict = {"decode_s": 0.0, "decode_n": 0}

    def count(r):
        if r.kind == "decode":
            seen["decode_s"] += r.elapsed_s
            seen["decode_n"] += r.decode_tokens

    t0 = time.perf_counter()
    [seq] = engine.generate(
        [w.prompt], SamplingParams(max_tokens=DECODE_TOKENS, **GREEDY), on_report=count
    )
    out["ttft_ms"] = 1000 * (seq.first_token_time - seq.arrival)
    out["prefill_tok_s"] = PROMPT_TOKENS / (seq.first_token_time - seq.arrival)
    out["decode_ms"] = 1000 * seen["decode_s"] / seen["decode_n"]
    out["decode_tok_s"] = seen["decode_n"] / seen["decode_s"]
    out["single_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    seqs = engine.generate(w.batch, [SamplingParams(max_tokens=n, **GREEDY) for n in BATCH_OUTPUTS])
    out["batch8_tok_s"] = sum(s.num_output_tokens for s in seqs) / (time.perf_counter() - t0)
    out["turn_ttft_ms"] = []
    history: list[int] = []
    for user in w.turns:
        history += user
        [s] = engine.generate([list(history)], SamplingParams(max_tokens=TURN_REPLY, **GREEDY))
        out["turn_ttft_ms"].append(1000 * (s.first_token_time - s.arrival))
        # the reply as a chat keeps it: its KV is in the cache, bar the last token's
        history += s.output_ids
    return out


def _greedy_decode(engine: Engine, prompt: list[int]) -> tuple:
    """The greedy reply to prompt (a Sequence) and the seconds of each of its pure decode steps."""
    decode_s: list[float] = []
    [seq] = engine.generate(
        [prompt],
        SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, num_candidates=0),
        on_report=lambda r: decode_s.append(r.elapsed_s) if r.kind == "decode" else None,
    )
    return seq, decode_s


def spec_round(engine: Engine, prompt: list[int]) -> dict:
    """Plain vs speculative decode of the same prompt, back to back in one round. Greedy up to the
    model's end of sequence (past a chat reply's end the text is what no draft predicts), so both
    decode the same tokens."""
    res = {}
    for on in (False, True):
        engine.set_speculation(on)
        seq, decode_s = _greedy_decode(engine, prompt)
        if not decode_s:
            raise PagechatError(
                "the speculation prompt's reply ended after its first token; nothing to measure"
            )
        res["spec" if on else "plain"] = {
            "decode_tok_s": (seq.num_output_tokens - 1) / sum(decode_s),
            "target_forwards_per_token": seq.target_forwards / seq.num_output_tokens,
            "acceptance_rate": seq.spec.acceptance_rate or 0.0,
        }
    return res


def hf_round(models: dict, w: Workload) -> dict:
    """The same figures by transformers' generate at each loaded dtype; caller keeps the faster."""
    out = {}
    for name, model in models.items():
        r: dict = {}
        ids = torch.tensor([w.prompt])
        t = time.perf_counter()
        _hf_generate(model, ids, 1)
        prefill = time.perf_counter() - t
        r["ttft_ms"], r["prefill_tok_s"] = 1000 * prefill, PROMPT_TOKENS / prefill
        t = time.perf_counter()
        _hf_generate(model, ids, DECODE_TOKENS)
        total = time.perf_counter() - t
        r["decode_ms"] = 1000 * (total - prefill) / (DECODE_TOKENS - 1)
        r["decode_tok_s"] = 1000 / r["decode_ms"]
        # static batch of 8: left-padded to the longest prompt, everyone runs to the longest output
        longest = max(len(p) for p in w.batch)
        batch = torch.tensor([[0] * (longest - len(p)) + p for p in w.batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in w.batch])
        t = time.perf_counter()
        _hf_generate(model, batch, max(BATCH_OUTPUTS), mask)
        r["batch8_tok_s"] = sum(BATCH_OUTPUTS) / (time.perf_counter() - t)
        r["turn_ttft_ms"] = []
        history: list[int] = []
        for user, reply in zip(w.turns, w.replies):
            history += user
            t = time.perf_counter()
            # a transformers user re-prefills the history (cost: its length)
            _hf_generate(model, torch.tensor([history]), 1)
            r["turn_ttft_ms"].append(1000 * (time.perf_counter() - t))
            history += reply
        out[name] = r
    return out


@torch.inference_mode()
def _hf_generate(model, ids: torch.Tensor, new: int, mask: torch.Tensor | None = None) -> None:
    mask = torch.ones_like(ids) if mask is None else mask
    model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )


def median_of(rounds: list[dict]) -> dict:
    """Per-key median over rounds (element-wise for lists)."""
    out = {}
    for k, v in rounds[0].items():
        if isinstance(v, list):
            out[k] = [statistics.median(r[k][i] for r in rounds) for i in range(len(v))]
        elif isinstance(v, dict):
            out[k] = median_of([r[k] for r in rounds])
        else:
            out[k] = statistics.median(r[k] for r in rounds)
    return out


@dataclass(slots=True)
class BenchResult:
    """What `pagechat bench --json` prints."""

    pagechat: dict
    transformers: dict = field(default_factory=dict)
    ratios: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "pagechat": self.pagechat,
            "transformers": self.transformers,
            "ratios": self.ratios,
            "machine": self.machine,
        }


def run_bench(
    engine: Engine,
    rounds: int = 3,
    vs_hf: bool = False,
    spec_prompt: list[int] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> BenchResult:
    """Warm up, then `rounds` interleaved repetitions of every figure; medians, MBU and ratios."""
    special = set(engine.tokenizer.all_special_ids)
    # a fresh workload each round (and one for warm-up), so no round reuses an earlier round's cache
    loads = [
        Workload.make(engine.spec.vocab_size, special, engine.max_model_len, seed)
        for seed in range(rounds + 1)
    ]
    hf = _load_hf(engine, log) if vs_hf else {}
    log("warming up")
    pagechat_round(engine, loads[-1])
    if hf:
        hf_round(hf, loads[-1])
    ours, theirs, specs = [], [], []
    for i, w in enumerate(loads[:rounds]):
        log(f"round {i + 1}/{rounds}: pagechat")
        ours.append(pagechat_round(engine, w))
        if engine.proposer is not None:
            specs.append(spec_round(engine, spec_prompt or w.prompt))
        if hf:
            log(f"round {i + 1}/{rounds}: transformers")
            theirs.append(hf_round(hf, w))
    bandwidth = read_bandwidth(engine.device)
    weights = weight_report(engine.model).total
    p = median_of(ours)
    p["weight_bytes"] = weights
    p["kv_bytes_per_token"] = kv_bytes_per_token(engine.spec, engine.kv_dtype)
    p["bandwidth_gb_s"] = bandwidth / 1e9
    p["decode_floor_ms"] = 1000 * weights / bandwidth
    p["mbu"] = p["decode_floor_ms"] / p["decode_ms"]
    p["step"] = profile_decode(engine, loads[0].prompt, p["decode_ms"]).as_dict()
    p["dtype"] = dtype_name(engine.dtype)
    p["quant"] = engine.quant.label
    p["graphs"] = engine.graphs
    if specs:
        s = median_of(specs)
        p["speculation"] = {
            "proposer": engine.proposer.name,
            "num_draft": engine.num_draft,
            "prompt_tokens": len(spec_prompt or loads[0].prompt),
            **s,
            "speedup": s["spec"]["decode_tok_s"] / s["plain"]["decode_tok_s"],
        }
    result = BenchResult(p, machine=_machine(engine))
    if hf:
        per = median_of(theirs)
        for name, r in per.items():
            r["weight_bytes"] = sum(x.nbytes for x in hf[name].parameters())
            r["mbu"] = 1000 * r["weight_bytes"] / bandwidth / r["decode_ms"]
        best = _best_dtype(per, "decode_tok_s")
        t = dict(per[best], dtype=best, all_dtypes=per)
        # each figure against transformers' best dtype for it: its faster decode's dtype can
        # prefill several times slower (bf16 on a CPU without native bf16)
        t["dtypes"] = {}
        for key in KEYS:
            t["dtypes"][key] = _best_dtype(per, key)
            t[key] = per[t["dtypes"][key]][key]
        result.transformers = t
        result.ratios = {k: _ratio(p[k], t[k]) for k in KEYS}
    return result


def _best_dtype(per: dict, key: str) -> str:
    """The dtype whose figure `key` is best: the most tok/s or MBU, the least ms (a list of turns:
    by the last turn)."""
    value = {name: r[key][-1] if isinstance(r[key], list) else r[key] for name, r in per.items()}
    pick = min if key.endswith("_ms") else max
    return pick(value, key=value.get)


def _ratio(a, b):
    if isinstance(a, list):
        return [x / y for x, y in zip(a, b)]
    return a / b if b else 0.0


def _load_hf(engine: Engine, log) -> dict:
    """transformers' model on the same checkpoint, float32 and bfloat16 (which is faster varies)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = gguf_file(engine.model_dir)  # transformers dequantises a GGUF's weights as it loads
    where = {"gguf_file": gguf.name} if gguf else {}
    folder = gguf.parent if gguf else engine.model_dir
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        log(f"loading transformers at {dtype_name(dtype)}")
        out[dtype_name(dtype)] = (
            AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype=dtype, **where
            )
            .to(engine.device)
            .eval()
        )
    return out


def _machine(engine: Engine) -> dict:
    info = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(engine.device),
    }
    if engine.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(engine.device)
    return info
