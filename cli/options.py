"""The command-line options several commands share, declared once: the engine's as a group a
command takes with @engine_options, which builds the EngineConfig the command is given."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pagechat.core.config import EngineConfig, parse_bytes
from pagechat.core.errors import PagechatError

Dtype = Annotated[
    str,
    typer.Option(
        help="auto | float32 | bfloat16 | float16 (auto: bf16 on a CPU with native bf16 "
        "(AVX512-BF16 or AMX), "
        "the checkpoint's dtype on CUDA, else float32, with a bf16 checkpoint's "
        "weights kept in bf16 as --quant bf16-wo)"
    ),
]
KvDtype = Annotated[
    str,
    typer.Option(
        help="the KV cache's dtype: auto | float32 | bfloat16 | float16 (auto: float16 where "
        "the model computes in float32 on a CPU, as llama.cpp keeps it; else the model's)"
    ),
]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda")]
Draft = Annotated[
    Path | None,
    typer.Option(
        help="draft model directory (same tokenizer) for speculative decoding; "
        "`demo`: the shipped demo draft"
    ),
]
MODEL_HELP = (
    "a Hugging Face model directory (safetensors), a GGUF file (or a folder holding one), or an "
    "Ollama model as ollama:NAME[:TAG]"
)
ModelDir = Annotated[Path, typer.Argument(metavar="MODEL", help=MODEL_HELP)]
OptionalModelDir = Annotated[
    Path | None,
    typer.Argument(metavar="MODEL", help=f"{MODEL_HELP}; default: the shipped demo chat model"),
]
HFModelDir = Annotated[
    Path, typer.Argument(metavar="MODEL_DIR", help="a Hugging Face model directory (safetensors)")
]
Eager = Annotated[
    bool,
    typer.Option(
        "--eager",
        help="run every op from Python; default: decode steps replay a "
        "traced graph (TorchScript; on a GPU, CUDA graphs per batch size), made while the model "
        "loads",
    ),
]
Ngram = Annotated[
    bool, typer.Option("--ngram", help="speculate by prompt lookup (n-gram match in the context)")
]
NumDraft = Annotated[int, typer.Option(help="tokens drafted per speculative step")]
Quant = Annotated[
    str | None,
    typer.Option(
        help="int8 (bitsandbytes LLM.int8) | int8-wo (torch int8 weight-only) | "
        "bf16-wo (bf16 weights, float32 prefill) | "
        "awq (AWQ checkpoints are detected without it)"
    ),
]
LmHead = Annotated[
    str,
    typer.Option(
        help="the LM head's weights: auto | int8 (a scale per row) | int4 (groups of 32, "
        "round-to-nearest) | float (the model's dtype; bf16 under a weight-only --quant of a "
        "float32 model). auto: int8 for quantised models (--quant int8 / int8-wo / awq), else "
        "float. A tied embedding reads its rows from the quantised head's table"
    ),
]
BlockSize = Annotated[int, typer.Option(help="tokens per KV block")]
KvBlocks = Annotated[int | None, typer.Option(help="KV pool size in blocks")]
KvMemory = Annotated[str | None, typer.Option(help="KV pool budget, e.g. 2GiB")]
Preempt = Annotated[
    str,
    typer.Option(
        help="when the KV pool is full: recompute (free the newest sequence's blocks, recompute "
        "them later) | swap (copy them to a host pool and back)"
    ),
]
SwapBlocks = Annotated[
    int | None, typer.Option(help="host pool size in blocks with --preempt swap (default: as KV)")
]
Threads = Annotated[
    int | None,
    typer.Option(
        help="torch CPU threads; default: OMP_NUM_THREADS if set, else one per core that other "
        "processes leave free when the engine starts (docs/benchmarks.md, Threads)"
    ),
]


MaxBatchTokens = Annotated[
    int, typer.Option(help="tokens computed per step (longer prompts are chunked)")
]
MaxSeqs = Annotated[int, typer.Option(help="sequences running at once")]
PrefixCache = Annotated[bool, typer.Option(help="reuse KV blocks of repeated prefixes")]

ENGINE_OPTIONS = {  # every engine option, in the order a command's help lists those it takes
    "draft": Draft,
    "ngram": Ngram,
    "num_draft": NumDraft,
    "quant": Quant,
    "lm_head": LmHead,
    "dtype": Dtype,
    "kv_dtype": KvDtype,
    "device": Device,
    "block_size": BlockSize,
    "kv_blocks": KvBlocks,
    "kv_memory": KvMemory,
    "preempt": Preempt,
    "swap_blocks": SwapBlocks,
    "max_batch_tokens": MaxBatchTokens,
    "max_seqs": MaxSeqs,
    "prefix_cache": PrefixCache,
    "eager": Eager,
    "threads": Threads,
}
# the group's parts: every engine command takes MODEL; those that run speculation, size their
# own KV pool or batch take those too
MODEL = ("quant", "lm_head", "dtype", "kv_dtype", "device", "threads")
SPECULATION = ("draft", "ngram", "num_draft")
KV_POOL = ("block_size", "kv_blocks", "kv_memory", "preempt", "swap_blocks")
BATCH = ("max_batch_tokens", "max_seqs")


def engine_options(*names: str) -> Callable[[Callable], Callable]:
    """Decorator: the command takes the engine options named (defaults: EngineConfig's), listed
    in ENGINE_OPTIONS' order where its keyword-only `config` parameter stands, and is called
    with their validated EngineConfig as `config`."""
    if unknown := set(names) - ENGINE_OPTIONS.keys():
        raise TypeError(f"not engine options: {sorted(unknown)}")
    defaults = EngineConfig()
    options = {
        name: (option, not defaults.graphs if name == "eager" else getattr(defaults, name))
        for name, option in ENGINE_OPTIONS.items()
        if name in names
    }
    return lambda command: option_group(command, "config", options, engine_config)


def engine_config(options: dict) -> EngineConfig:
    """The validated EngineConfig of a command's engine options: `demo` names the shipped
    draft, --kv-memory is parsed, --eager turns traced graphs off; options a command does not
    have keep EngineConfig's defaults."""
    from pagechat.tools.demo import draft_or_demo

    fields = {k: v for k, v in options.items() if k not in ("draft", "kv_memory", "eager")}
    fields["draft"] = draft_or_demo(options.get("draft"))
    if options.get("kv_memory"):
        fields["kv_memory"] = parse_bytes(options["kv_memory"])
    fields["graphs"] = not options.get("eager", False)
    return EngineConfig(**fields).validate()


def option_group(
    command: Callable, name: str, options: dict[str, tuple[Any, Any]], build: Callable[[dict], Any]
) -> Callable:
    """The command with its parameter `name` replaced, in the signature typer reads, by the
    options ({parameter: (Annotated type, default)}); called, it passes build(their values) as
    `name`."""
    signature = inspect.signature(command, eval_str=True)
    if name not in signature.parameters:
        raise TypeError(f"{command.__name__} has no parameter {name!r} for its option group")
    params = []
    for param in signature.parameters.values():
        if param.name != name:
            params.append(param)
            continue
        params += [
            inspect.Parameter(option, param.kind, default=default, annotation=annotation)
            for option, (annotation, default) in options.items()
        ]

    @functools.wraps(command)
    def with_group(**kwargs):
        values = {option: kwargs.pop(option) for option in options}
        return command(**kwargs, **{name: build(values)})

    with_group.__signature__ = signature.replace(parameters=params)
    with_group.__annotations__ = {p.name: p.annotation for p in params}  # for get_type_hints
    return with_group


def positive_ints(text: str, option: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; PagechatError naming the option otherwise."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise PagechatError(f"{option} must be integers >= 1 separated by commas, got {text!r}")
    return values


def check_at_least_one(**options: int) -> None:
    """PagechatError naming the first option below 1 (keyword names spell the options)."""
    for name, value in options.items():
        if value < 1:
            raise PagechatError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
