"""Where a decode step's time goes: weight matmuls, attention, the other ops, and Python.

torch.profiler records a few greedy decode steps; every op's own time (its children's excluded)
goes to a category by its own name and its enclosing ops' names: attention (the paged KV write
and gather, and scaled-dot-product attention with the products inside it, but not an embedding's
lookup; pagechat's fused decode attention, its rotary embedding included where one op does both),
else a weight matmul (dense, int8, int4 or pagechat's own kernels, the LM head included), else
other (norms, rotary, activations, casts, sampling, the step graph's own interpreter; pagechat's
fused small ops). Python is the rest of the step: the step's wall time measured without the
profiler, less the ops' time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagechat.core.engine import Engine
from pagechat.core.params import SamplingParams

MATMUL = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "pagechat::int8_linear",
    "pagechat::int4_linear",
    "pagechat::float_linear",
}
ATTENTION = {
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::index_copy_",
    "aten::index_select",
    "pagechat::decode_attention",
    "pagechat::qkv_decode_attention",  # its rotary embedding included
}
NOT_ATTENTION = {"aten::embedding"}  # an embedding's lookup is an index_select too
STEPS = 16  # decode steps profiled


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Milliseconds of one decode step by kind."""

    matmul_ms: float
    attention_ms: float
    other_ms: float
    python_ms: float

    def as_dict(self) -> dict[str, float]:
        return {
            "matmul_ms": self.matmul_ms,
            "attention_ms": self.attention_ms,
            "other_ms": self.other_ms,
            "python_ms": self.python_ms,
        }


def kind_of(event) -> str:
    """An op's category, from its own name and its enclosing ops' (a matmul inside attention is
    attention; anything inside an embedding is other)."""
    chain = []
    e = event
    while e is not None:
        chain.append(e.name)
        e = e.cpu_parent
    if any(name in NOT_ATTENTION for name in chain):
        return "other"
    if any(name in ATTENTION for name in chain):
        return "attention"
    if any(name in MATMUL for name in chain):
        return "matmul"
    return "other"


def profile_decode(engine: Engine, prompt: list[int], step_ms: float) -> StepBreakdown:
    """The breakdown of `step_ms` (a decode step's wall time measured without the profiler) from
    STEPS profiled decode steps of a greedy reply to `prompt`."""
    params = SamplingParams(
        max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True, num_candidates=0
    )  # as the bench's own rounds
    rid = engine.requests.add(prompt, params)
    engine.step()  # the prompt and the first token, outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps = 0
        while engine.has_unfinished():
            steps += engine.step().kind == "decode"
    engine.requests.release(rid)
    totals = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.events():
        totals[kind_of(e)] += e.self_cpu_time_total / 1000  # µs -> ms
    per = {k: v / max(steps, 1) for k, v in totals.items()}
    return StepBreakdown(
        per["matmul"], per["attention"], per["other"], max(0.0, step_ms - sum(per.values()))
    )
