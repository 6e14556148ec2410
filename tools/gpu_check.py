"""Every GPU check of pagechat in one call, for a lent GPU (CI has none):

    python -m pagechat.tools.gpu_check OUT_DIR [--quick] [--device cuda]

1. the card's ceilings: read bandwidth and bf16 matmul peak as the Timing panel measures them
   (core/roofline.py), and a device-to-device copy beside them;
2. paged decode attention (core/paged_triton.py) against the float64 definition (the gathered
   path on upcast inputs) on random pools, GQA groups, head sizes, windows, 16-bit caches and
   contexts up to 4,096 tokens; its K/V writes; its time against the gathered path's; the fused
   small ops (core/fused_triton.py) against torch's on the same GPU, in float32, bf16 and fp16;
3. the engine on random models of the 135M and 0.5B shapes: greedy tokens and logits in float32
   against transformers on the same GPU, eager and with CUDA graphs;
4. decode speed in bf16 at 1 to 64 sequences, eager against CUDA graphs, with Triton's fused
   small ops (core/fused_triton.py) and with torch's, and its memory-bandwidth use (decode's
   bytes a token x tok/s over the measured bandwidth, as the Timing panel shows it); the captured
   step's GPU time alone beside the whole step's;
5. the Memory panel's CUDA readings (core/memory.py) against torch.cuda.memory_stats, and the
   weights and KV pool against what torch has allocated.

Writes OUT_DIR/gpu_check.json and prints a table; exits 1 when a correctness check fails.
--device cpu with --quick runs the same code on a CPU (the kernels under TRITON_INTERPRET=1), to
try the script before a lease.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from pagechat.core import fused_triton, ops, paged_triton
from pagechat.core.attention import build_metadata, paged_attention
from pagechat.core.config import EngineConfig
from pagechat.core.cuda_graphs import CudaGraphs
from pagechat.core.engine import Engine
from pagechat.core.events import EngineInfo
from pagechat.core.memory import read_memory
from pagechat.core.model import RMSNorm, rotate
from pagechat.core.params import SamplingParams
from pagechat.core.roofline import Roofline, gpu_seconds, median_seconds, step_rates, sync
from pagechat.tools.make_model import make_model

# (query heads, KV heads, head size, block size, cache dtype, window): SmolLM2's grouping, Llama
# 3 8B's, one KV head, a head size that is no power of two, a sliding window
KERNEL_CASES = (
    (9, 3, 64, 16, torch.bfloat16, None),
    (32, 8, 128, 16, torch.bfloat16, None),
    (8, 1, 80, 32, torch.float16, None),
    (14, 2, 64, 16, torch.bfloat16, 1000),
    (4, 4, 64, 16, torch.float32, None),
)
BATCHES = (1, 8, 32, 64)
MODELS = Path(tempfile.gettempdir()) / "pagechat-gpu-check"  # not in OUT_DIR: 1.3 GB


def ceilings(device: torch.device) -> dict:
    roof = Roofline.measure(device, torch.bfloat16)
    src = torch.randn(2**28 if device.type == "cuda" else 2**22, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / median_seconds(device, lambda: dst.copy_(src), 20)
    return {"read_GBs": roof.bandwidth / 1e9, "bf16_TFLOPs": roof.peak_flops / 1e12,
            "copy_GBs": copy / 1e9}  # fmt: skip


def kernel_check(device: torch.device, case: tuple, contexts: list[int]) -> dict:
    """One case over a batch of the given contexts: relative error against float64, whether the
    K/V writes landed (and nothing else moved), and both paths' time."""
    heads, kv_heads, d, bs, cache_dtype, window = case
    rng = random.Random(heads * d)
    num_blocks = 2 * sum(c // bs + 1 for c in contexts)
    free = rng.sample(range(num_blocks), num_blocks)
    tables = [[free.pop() for _ in range(c // bs + 1)] for c in contexts]
    k_cache = torch.randn(num_blocks * bs, kv_heads, d, device=device).to(cache_dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, d, device=device).to(cache_dtype)
    b = len(contexts)
    q = torch.randn(b, heads, d, device=device).to(cache_dtype)
    k = torch.randn(b, kv_heads, d, device=device).to(cache_dtype)
    v = torch.randn(b, kv_heads, d, device=device).to(cache_dtype)
    ones = [1] * b
    paged = build_metadata(contexts, ones, tables, bs, device, paged=True)
    gathered = build_metadata(contexts, ones, tables, bs, device)
    want = paged_attention(
        q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), gathered, window,
    )  # fmt: skip
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[paged.slot_mapping], want_v[paged.slot_mapping] = k, v
    got = paged_attention(q, k, v, k_cache, v_cache, paged, window)
    err = ((got.double() - want).norm() / want.norm()).item()
    out = {
        "case": f"{heads}/{kv_heads}x{d} bs{bs} {str(cache_dtype)[6:]} window {window}",
        "batch": b,
        "longest": max(contexts) + 1,
        "rel_err": err,
        "writes_ok": torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v),
        "finite": bool(got.isfinite().all()),
    }
    if device.type == "cuda":
        out["paged_us"] = 1e6 * median_seconds(
            device, lambda: paged_attention(q, k, v, k_cache, v_cache, paged, window), 20
        )
        out["gathered_us"] = 1e6 * median_seconds(
            device, lambda: paged_attention(q, k, v, k_cache, v_cache, gathered, window), 20
        )
    # bf16 and fp16 queries round their outputs; float32 sums in another order
    out["ok"] = (
        out["writes_ok"]
        and out["finite"]
        and err < (1e-5 if cache_dtype == torch.float32 else 1e-2)
    )
    return out


def _agree(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(the largest difference, the share of elements apart by more than the dtype's rounding)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[want.dtype]
    off = ~torch.isclose(got.float(), want.float(), rtol=tol, atol=tol)
    return (got.float() - want.float()).abs().max().item(), off.float().mean().item()


def small_ops_check(device: torch.device, dtype: torch.dtype, hidden: int, d: int) -> dict:
    """core/fused_triton.py's ops against the torch ops they replace, on 7 rows."""
    g = torch.Generator(device=device).manual_seed(hidden)
    x = (torch.randn(7, hidden, device=device, generator=g) * 3).to(dtype)
    res = torch.randn(7, hidden, device=device, generator=g).to(dtype)
    w = (torch.rand(hidden, device=device, generator=g) + 0.5).to(dtype)
    fused, plain = RMSNorm(w, 1e-5, fused_triton), RMSNorm(w, 1e-5)
    qkv = torch.randn(7, 20 * d, device=device, generator=g).to(dtype)
    qk = qkv[:, : 16 * d].view(7, 16, d)  # 12 query heads and 4 KV heads of a fused qkv
    ang = torch.randn(7, 1, d // 2, device=device, generator=g)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    gate_up = (torch.randn(7, 2 * 4 * hidden, device=device, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    (y, total), (y_ref, total_ref) = fused(x, res), plain(x, res)
    pairs = {
        "rms_norm": (fused(x), plain(x)),
        "add_rms_norm": (y, y_ref),
        "residual": (total, total_ref),
        "rope": (fused_triton.rope(qk, cos, sin), rotate(qk, cos, sin)),
        "silu_mul": (fused_triton.silu_mul(gate_up), torch.nn.functional.silu(gate) * up),
    }
    out = {"small_ops": f"{str(dtype)[6:]} hidden {hidden} head {d}"}
    worst = 0.0
    for name, (got, want) in pairs.items():
        out[f"{name}_max_err"], off = _agree(got, want)
        worst = max(worst, off)
    out["off_share"] = worst  # 16-bit: a rare last-bit tie rounds the other way
    out["ok"] = worst <= (0.0 if dtype == torch.float32 else 1e-3)
    return out


def kernel_checks(device: torch.device, quick: bool) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for case in KERNEL_CASES[:2] if quick else KERNEL_CASES:
        longest = 300 if quick else 4096
        mixed = [0, 1, 15, 16, rng.randint(17, longest), longest - 1]
        rows.append(kernel_check(device, case, mixed))
        if not quick:
            for b, ctx in ((1, 4096), (64, 1024)):
                rows.append(kernel_check(device, case, [ctx - 1] * b))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for hidden, d in ((576, 64), (4096, 128)):
            rows.append(small_ops_check(device, dtype, hidden, d))
    return rows


def _prompts(engine: Engine, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(engine.tokenizer.all_special_ids)
    ids = [i for i in range(min(engine.spec.vocab_size, 32000)) if i not in special]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(count)]


def oracle_check(model_dir: Path, device: torch.device, quick: bool) -> list[dict]:
    """float32 greedy tokens and every step's logits, eager and with graphs, against
    transformers' greedy generation on the same device."""
    from transformers import AutoModelForCausalLM

    new = 8 if quick else 32
    rows = []
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    for graphs in (False, True):
        cfg = EngineConfig(
            device=device.type, dtype="float32", kv_dtype="float32", graphs=graphs, kv_blocks=512
        )
        engine = Engine(model_dir, cfg)
        prompts = _prompts(engine, 4, 24, 1)
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        got = [s.output_ids for s in engine.generate(prompts, params)]
        equal, worst = 0, 0.0
        for prompt, tokens in zip(prompts, got):
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                  output_logits=True, return_dict_in_generate=True)  # fmt: skip
            want = out.sequences[0, len(prompt) :].tolist()
            equal += want == tokens
            # the engine's logits for the same continuation: one scoring pass over it
            mine = engine.runner.score(prompt + want)[len(prompt) - 1 : -1]
            theirs = torch.cat(out.logits).float()
            worst = max(worst, (mine - theirs).abs().max().item())
        rows.append({"model": model_dir.name, "graphs": engine.graphs, "prompts": len(prompts),
                     "tokens_equal": equal, "logits_max_abs_err": worst,
                     "ok": equal == len(prompts) and worst < 1e-3})  # fmt: skip
        del engine
    return rows


def _speed_engine(model_dir: Path, device: torch.device, graphs: bool, small: bool) -> Engine:
    """A bf16 engine; small False: its norms, rotary and SiLU as torch's ops."""
    chosen = ops.small_ops
    if not small:
        ops.small_ops = lambda device, dtype: None
    try:
        cfg = EngineConfig(device=device.type, dtype="bfloat16", graphs=graphs, kv_blocks=2048)
        return Engine(model_dir, cfg)
    finally:
        ops.small_ops = chosen


def speed_check(model_dir: Path, device: torch.device, quick: bool) -> list[dict]:
    """bf16 decode tok/s at each batch and its MBU, four ways interleaved batch by batch: eager
    with the decode rows gathered (the GPU's path before the paged kernel), eager through the
    paged kernel, CUDA graphs (which need it) with torch's small ops, and with Triton's."""
    engines = {
        "eager": _speed_engine(model_dir, device, False, True),
        "graphs_torch_ops": _speed_engine(model_dir, device, True, False),
        "graphs": _speed_engine(model_dir, device, True, True),
    }
    infos = {name: EngineInfo.of(e) for name, e in engines.items()}
    rows = []
    for b in BATCHES[:2] if quick else BATCHES:
        for mode in ("gathered", "paged", "graphs_torch_ops", "graphs"):
            name = mode if mode.startswith("graphs") else "eager"
            engine = engines[name]
            if name == "eager":
                engine.runner.paged = mode == "paged" and device.type == "cuda"
            reports = []
            # no candidates recorded, as `bench` and `generate` decode (the app's panel asks for
            # 8 a token: their records are host work that grows with the batch)
            params = SamplingParams(
                temperature=0.0, max_tokens=16 if quick else 128, ignore_eos=True, num_candidates=0
            )
            engine.generate(_prompts(engine, b, 64, b), params, on_report=reports.append)
            decode = [r for r in reports if r.kind == "decode"]
            seconds = sum(r.elapsed_s for r in decode)
            read, _ = step_rates(
                [(r.kind, r.elapsed_s, r.batch) for r in decode], infos[name].memory
            )
            rows.append({
                "model": model_dir.name, "batch": b, "mode": mode,
                "graphs": type(engine.runner.graphs).__name__,
                "decode_tok_s": sum(r.decode_tokens for r in decode) / seconds,
                "step_ms": 1e3 * seconds / len(decode),
                "mbu": read / infos[name].roofline.bandwidth,
                "replay_ms": _replay_ms(engine.runner.graphs, b),
            })  # fmt: skip
    rows.append(memory_check(engines["graphs"], infos["graphs"]))
    return rows


def _replay_ms(graphs, batch: int) -> float | None:
    """GPU ms of the batch's captured decode step replayed alone (the step's tokens, positions and
    contexts as its last run left them; every slot -1, so nothing is written): how much of a step
    is the GPU's. None where no CUDA graph ran."""
    if not isinstance(graphs, CudaGraphs):
        return None
    graphs.slots.fill_(-1)
    size = next(s for s in graphs.sizes if s >= batch)
    return 1e3 * gpu_seconds(graphs.graphs[size].replay, 20)


def memory_check(engine: Engine, info: EngineInfo) -> dict:
    """What the Memory panel reads against the allocator's own statistics, read together."""
    sync(engine.device)
    readings = read_memory(engine.device)
    if engine.device.type != "cuda":
        return {"memory": "cpu", "rss": readings.rss, "ok": readings.rss is not None}
    stats = torch.cuda.memory_stats(engine.device)
    held = info.memory.weights.total + info.memory.pool_bytes
    return {
        "memory": "cuda",
        "allocated": readings.allocated,
        "stats_allocated": stats["allocated_bytes.all.current"],
        "reserved": readings.reserved,
        "stats_reserved": torch.cuda.memory_reserved(engine.device),
        "fragmented": readings.fragmented,
        "stats_inactive_split": stats["inactive_split_bytes.all.current"],
        "weights_and_kv": held,
        "ok": readings.allocated == torch.cuda.memory_allocated(engine.device)
        and readings.reserved == torch.cuda.memory_reserved(engine.device)
        and readings.fragmented == stats["inactive_split_bytes.all.current"]
        and held <= readings.allocated <= readings.reserved,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes: a trial of the script")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"torch": torch.__version__, "triton": paged_triton.available()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        _part(result, "ceilings", lambda: [ceilings(device)])
    _part(result, "kernel", lambda: kernel_checks(device, args.quick))
    for size in ["tiny"] if args.quick else ["small", "0.5b"]:
        arch = "qwen2" if size == "0.5b" else "llama"
        model_dir = MODELS / f"{arch}-{size}"
        if not (model_dir / "config.json").exists():  # made by an earlier run
            make_model(model_dir, arch, size, seed=1)
        _part(result, "oracle", lambda m=model_dir: oracle_check(m, device, args.quick))
        _part(result, "speed", lambda m=model_dir: speed_check(m, device, args.quick))
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    for part in ("ceilings", "kernel", "oracle", "speed"):
        for row in result.get(part, []):
            print(part, " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()))  # fmt: skip
    parts = ("kernel", "oracle", "speed")
    failed = [r for p in parts for r in result.get(p, []) if not r.get("ok", True)]
    return 1 if failed else 0


def _part(result: dict, name: str, rows) -> None:
    """Add a part's rows; a part that raises is one failed row, and the other parts still run
    (a lease is too short to rerun for each)."""
    try:
        added = rows()
    except Exception as e:  # noqa: BLE001 - recorded, and the exit status says it failed
        traceback.print_exc()
        added = [{"error": f"{type(e).__name__}: {e}"[:500], "ok": False}]
    result.setdefault(name, []).extend(added)


if __name__ == "__main__":
    sys.exit(main())
