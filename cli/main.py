"""The `pagechat` command line: one typer command per subcommand (the options several share
are declared in options.py); the work itself is imported when a command runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from pagechat.cli.options import (
    BATCH,
    ENGINE_OPTIONS,
    KV_POOL,
    MODEL,
    SPECULATION,
    BlockSize,
    Device,
    HFModelDir,
    LmHead,
    ModelDir,
    OptionalModelDir,
    Threads,
    check_at_least_one,
    engine_options,
    positive_ints,
)
from pagechat.core.config import EngineConfig
from pagechat.core.errors import PagechatError, check_text

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Chat with a local LLM through a paged-KV engine you can watch.",
)


def early_stopping_value(text: str) -> bool | str:
    """--early-stopping as transformers reads it: True, False or "never"."""
    values = {"true": True, "false": False, "never": "never"}
    if text.lower() not in values:
        raise PagechatError(f"--early-stopping must be true, false or never, got {text!r}")
    return values[text.lower()]


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"pagechat {version('pagechat')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Chat with a local LLM through a paged-KV engine you can watch."""


@app.command("make-model")
def make_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="new directory for the checkpoint")],
    arch: Annotated[str, typer.Option(help="llama | mistral | qwen2 | qwen3")] = "llama",
    size: Annotated[
        str,
        typer.Option(
            help="tiny (runs in well under a second) | small (SmolLM2-135M shape) | "
            "0.5b (Qwen2-0.5B shape)"
        ),
    ] = "tiny",
    seed: Annotated[int, typer.Option(help="weights are identical for the same seed")] = 0,
) -> None:
    """Write a random-initialised checkpoint (transformers' own classes) with a locally trained
    tokenizer."""
    from pagechat.tools.make_model import make_model

    path = make_model(out_dir, arch, size, seed)
    typer.echo(f"wrote {arch} {size} checkpoint to {path}", err=True)


@app.command()
@engine_options(*ENGINE_OPTIONS)
def generate(
    prompt: Annotated[
        list[str],
        typer.Option("--prompt", "-p", help="prompt text; repeat to run a continuous batch"),
    ],
    model_dir: OptionalModelDir = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            help="wrap each prompt in the model's chat template "
            "(default: on for the demo model, off for a MODEL)"
        ),
    ] = None,
    system: Annotated[str | None, typer.Option(help="system message (with --chat)")] = None,
    max_tokens: Annotated[int, typer.Option(help="new tokens at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[
        float, typer.Option(help="nucleus: keep the smallest set with this probability, in (0, 1]")
    ] = 1.0,
    top_k: Annotated[int, typer.Option(help="keep the k most likely tokens (0 = off)")] = 0,
    min_p: Annotated[
        float, typer.Option(help="drop tokens below min-p x the top probability")
    ] = 0.0,
    repetition_penalty: Annotated[
        float, typer.Option(help="> 1 discourages repeating earlier tokens")
    ] = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed (same seed, same tokens)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string; repeatable")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="keep generating past end-of-sequence")] = False,
    n: Annotated[
        int,
        typer.Option(
            "--n", help="samples per prompt, decoded together from the prompt's shared blocks"
        ),
    ] = 1,
    beams: Annotated[
        int, typer.Option(help="beam search with this many beams (1 = off; the sampling is unused)")
    ] = 1,
    length_penalty: Annotated[
        float, typer.Option(help="beam score = log-probability / length ** this")
    ] = 1.0,
    early_stopping: Annotated[
        str,
        typer.Option(
            help="beam search ends: true (once B beams finished) | false (when no better beam "
            "can come, judged at the current length) | never (judged at max-tokens)"
        ),
    ] = "false",
    json_schema: Annotated[
        Path | None,
        typer.Option(help="constrain the output to this JSON schema (a .json file)"),
    ] = None,
    regex: Annotated[
        str | None, typer.Option(help="constrain the output to match this regular expression")
    ] = None,
    choice: Annotated[
        str | None, typer.Option(help="constrain the output to one of these, e.g. yes,no")
    ] = None,
    grammar: Annotated[
        Path | None,
        typer.Option(help="constrain the output to this grammar (a Lark or GBNF file)"),
    ] = None,
    *,
    config: EngineConfig,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object (results and stats) instead")
    ] = False,
) -> None:
    """Generate from one or more prompts; text streams to stdout, a stats line goes to stderr."""
    from pagechat.cli.generate import constraint_from, run_generate
    from pagechat.core.params import SamplingParams
    from pagechat.tools.demo import model_or_demo

    for i, p in enumerate(prompt, 1):
        check_text(p, f"prompt {i}")
    for s in stop or ():
        check_text(s, "--stop")
    check_text(system or "", "--system")

    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
        n=n,
        beam_width=beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping_value(early_stopping),
        num_candidates=0,  # what the app's sampling panel shows; generate prints none
        constraint=constraint_from(json_schema, regex, choice, grammar),
    ).validate()
    code = run_generate(
        model_or_demo(model_dir, config.quant),
        prompt,
        params,
        config,
        chat=model_dir is None if chat is None else chat,
        system=system,
        as_json=as_json,
    )
    raise typer.Exit(code)


@app.command()
def quantize(
    model_dir: HFModelDir,
    out_dir: Annotated[
        Path, typer.Argument(help="new directory for the 4-bit AutoAWQ GEMM checkpoint")
    ],
    method: Annotated[
        str, typer.Option(help="awq (activation-aware search) | rtn (round-to-nearest baseline)")
    ] = "awq",
    group_size: Annotated[int, typer.Option(help="inputs per quantisation group")] = 128,
    calib: Annotated[
        Path | None, typer.Option(help="calibration text file (default: the demo corpus)")
    ] = None,
    samples: Annotated[int, typer.Option(help="calibration windows")] = 128,
    seqlen: Annotated[int, typer.Option(help="tokens per calibration window")] = 512,
    threads: Threads = None,
) -> None:
    """Write a 4-bit AutoAWQ GEMM checkpoint (safetensors + config + tokenizer) that vLLM /
    transformers read."""
    from pagechat.cli.quant_cmds import quantize_command

    quantize_command(model_dir, out_dir, method, group_size, calib, samples, seqlen, threads)


@app.command("eval")
@engine_options(*MODEL)
def eval_cmd(
    model_dir: ModelDir,
    text: Annotated[Path, typer.Option(help="text file to score")],
    seqlen: Annotated[
        int | None, typer.Option(help="tokens per window (default: the context, at most 2048)")
    ] = None,
    *,
    config: EngineConfig,
) -> None:
    """Perplexity of a text through pagechat's engine; with a quantised LM head, also with a
    float one, and the difference."""
    from pagechat.cli.quant_cmds import eval_command

    eval_command(model_dir, text, config, seqlen)


@app.command()
def plan(
    model_dir: ModelDir,
    quant: Annotated[
        str | None,
        typer.Option(help="int8 | int8-wo | bf16-wo | awq (awq on a float model: after quantize)"),
    ] = None,
    lm_head: LmHead = "auto",
    gpu_memory: Annotated[str, typer.Option(help="memory budget, e.g. 24GiB")] = "24GiB",
    context: Annotated[
        int | None, typer.Option(help="tokens per request (default: the model's context)")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="activation / KV dtype (auto: what the engine picks on CUDA)")
    ] = "auto",
    block_size: BlockSize = 16,
    group_size: Annotated[
        int, typer.Option(help="AWQ group size when planning a quantisation")
    ] = 128,
) -> None:
    """Weights, KV bytes per token and block, and how many blocks and sequences fit a budget
    (config.json only)."""
    from pagechat.cli.quant_cmds import plan_command

    plan_command(model_dir, quant, lm_head, gpu_memory, context, dtype, block_size, group_size)


@app.command("bench-quant")
def bench_quant(
    model_dir: HFModelDir,
    awq_dir: Annotated[
        Path | None, typer.Option(help="its AWQ checkpoint (default: a temporary RTN one)")
    ] = None,
    modes: Annotated[
        str, typer.Option(help="comma-separated: fp32,bf16,int8,int8-wo,bf16-wo,awq")
    ] = "fp32,bf16,int8,int8-wo,bf16-wo,awq",
    tokens: Annotated[int, typer.Option(help="new tokens per round")] = 64,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length")] = 32,
    batch: Annotated[int, typer.Option(help="sequences decoding together")] = 1,
    rounds: Annotated[int, typer.Option(help="interleaved rounds (the median counts)")] = 3,
    device: Device = "auto",
    threads: Threads = None,
) -> None:
    """Decode tok/s and weight memory of fp / int8 / AWQ side by side, on one model in one run."""
    from pagechat.cli.quant_cmds import bench_quant_command

    bench_quant_command(
        model_dir, awq_dir, modes, tokens, prompt_tokens, batch, rounds, device, threads
    )


@app.command()
@engine_options(*MODEL, *SPECULATION, *KV_POOL, "eager")
def run(
    model_dir: OptionalModelDir = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="continue a saved chat (id from `pagechat history`), on its own model unless "
            "MODEL names another"
        ),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option(help="with --resume: refuse a MODEL other than the chat's own model"),
    ] = False,
    save: Annotated[
        Path | None,
        typer.Option(help="also write the chat as JSON to this path after every turn"),
    ] = None,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (default 0.7)")] = None,
    top_p: Annotated[float | None, typer.Option(help="nucleus, in (0, 1] (default 0.95)")] = None,
    top_k: Annotated[
        int | None, typer.Option(help="keep the k most likely tokens (0 = off)")
    ] = None,
    min_p: Annotated[
        float | None, typer.Option(help="drop tokens below min-p x the top probability")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="new tokens per reply at most (default 512)")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="sampling seed (same seed, same reply)")] = None,
    ignore_eos: Annotated[
        bool | None,
        typer.Option("--ignore-eos", help="keep generating past end-of-sequence (benchmarks)"),
    ] = None,
    layout: Annotated[
        str, typer.Option(help="auto | tabs | grid (auto: every panel at once from 150x40)")
    ] = "auto",
    when_full: Annotated[
        str,
        typer.Option(
            help="drop | refuse: when the next turn would not fit the context, leave out the "
            "oldest turns (the system prompt stays), or refuse the turn (start a new chat)"
        ),
    ] = "drop",
    *,
    config: EngineConfig,
) -> None:
    """Chat with a local model in the terminal app, with live KV-block, timing, sampling and
    memory panels."""
    from pagechat.cli.launch import run_app

    overrides = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    raise typer.Exit(
        run_app(
            model_dir,
            config,
            overrides,
            resume=resume,
            save=save,
            system=system,
            layout=layout,
            strict=strict,
            when_full=when_full,
        )
    )


@app.command()
def history(
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON array instead of a table")
    ] = False,
) -> None:
    """List saved chats (newest first); resume one with `pagechat run MODEL --resume ID`."""
    from pagechat.tui.history import print_history

    raise typer.Exit(print_history(as_json=as_json))


@app.command()
def models(
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of a table")
    ] = False,
) -> None:
    """List the models pagechat can open: GGUF files and Hugging Face directories here, the
    Hugging Face cache and Ollama's store; arch, size, precision and whether each fits."""
    from pagechat.cli.models_cmd import print_models

    raise typer.Exit(print_models(as_json=as_json))


@app.command()
@engine_options(*MODEL, *SPECULATION, "eager")
def bench(
    model_dir: OptionalModelDir = None,
    vs_hf: Annotated[
        bool, typer.Option("--vs-hf", help="also run transformers' generate on the same weights")
    ] = False,
    rounds: Annotated[int, typer.Option(help="repetitions; the table shows medians")] = 3,
    *,
    config: EngineConfig,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of the table")
    ] = False,
    spec_prompt: Annotated[
        str | None,
        typer.Option(
            help="prompt of the speculation round (chat template applied "
            "when the model has one); default: repeat a passage"
        ),
    ] = None,
) -> None:
    """Measure TTFT, prefill, decode, 8 concurrent requests, multi-turn TTFT and MBU (optionally
    vs transformers)."""
    from pagechat.cli.bench_cmd import bench_command
    from pagechat.tools.demo import model_or_demo

    if rounds < 1:
        raise PagechatError(f"--rounds must be >= 1, got {rounds}")
    if spec_prompt is not None and not (config.draft or config.ngram):
        raise PagechatError(
            "--spec-prompt needs --draft DIR or --ngram (it is the speculation round's prompt)"
        )
    if spec_prompt is not None and not spec_prompt.strip():
        raise PagechatError("--spec-prompt is empty")
    bench_command(
        model_or_demo(model_dir, config.quant), config, rounds, vs_hf, as_json, spec_prompt
    )


@app.command("bench-grammar")
@engine_options(*MODEL)
def bench_grammar(
    model_dir: OptionalModelDir = None,
    streams: Annotated[str, typer.Option(help="comma-separated stream counts")] = "1,16",
    rounds: Annotated[int, typer.Option(help="repetitions per side (the median counts)")] = 3,
    max_tokens: Annotated[int, typer.Option(help="tokens each stream generates at most")] = 96,
    *,
    config: EngineConfig,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of the table")
    ] = False,
) -> None:
    """What a JSON-schema constraint costs: decode tok/s without and with one, at each stream
    count, the two sides interleaved, and the grammar masks' time a step."""
    import json

    from pagechat.core.engine import Engine
    from pagechat.tools.bench_grammar import grammar_cost
    from pagechat.tools.demo import model_or_demo

    counts = positive_ints(streams, "--streams")
    check_at_least_one(rounds=rounds, max_tokens=max_tokens)
    engine = Engine(model_or_demo(model_dir, config.quant), config)
    rows = grammar_cost(engine, counts, rounds, max_tokens)
    if as_json:
        typer.echo(json.dumps({"precision": engine.precision, "rows": rows}))
        return
    typer.echo(f"{'streams':>7} {'tok/s':>8} {'schema':>8} {'ratio':>6} {'mask ms/step':>12}")
    for r in rows:
        typer.echo(
            f"{r['streams']:>7} {r['tok_s']:>8.1f} {r['tok_s_constrained']:>8.1f} "
            f"{r['ratio']:>6.3f} {r['mask_ms_per_step']:>12.3f}"
        )


@app.command("bench-kv")
@engine_options(*MODEL)
def bench_kv(
    model_dir: OptionalModelDir = None,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length of the sharing runs")] = 1024,
    new_tokens: Annotated[int, typer.Option(help="tokens each answer generates")] = 32,
    samples: Annotated[int, typer.Option(help="n of the samples run")] = 8,
    beams: Annotated[int, typer.Option(help="width of the beam-search run")] = 4,
    contexts: Annotated[
        str, typer.Option(help="comma-separated sequence lengths of the preemption-cost runs")
    ] = "256,512,1024",
    rounds: Annotated[int, typer.Option(help="repetitions per length (the median counts)")] = 3,
    churn: Annotated[
        int, typer.Option(help="also serve this many short requests, releasing each, and print RSS")
    ] = 0,
    *,
    config: EngineConfig,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of the tables")
    ] = False,
) -> None:
    """What block sharing saves (n samples and beams vs separate requests, peak KV blocks) and
    what preemption costs (swap to host memory and back vs recompute, per context length)."""
    from pagechat.cli.bench_kv_cmd import bench_kv_command
    from pagechat.tools.demo import model_or_demo

    lengths = positive_ints(contexts, "--contexts")
    check_at_least_one(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        samples=samples,
        beams=beams,
        rounds=rounds,
    )
    if churn < 0:
        raise PagechatError(f"--churn must be >= 0, got {churn}")
    bench_kv_command(
        model_or_demo(model_dir, config.quant),
        config,
        prompt_tokens,
        new_tokens,
        (samples, beams),
        lengths,
        rounds,
        churn,
        as_json,
    )


@app.command("bench-serve")
def bench_serve(
    url: Annotated[str, typer.Argument(help="base URL of an OpenAI-compatible server")],
    model: Annotated[
        str | None, typer.Option(help="model name to request (default: the first /v1/models lists)")
    ] = None,
    concurrency: Annotated[
        str, typer.Option(help="comma-separated levels; each sends every request")
    ] = "1,4,16",
    requests: Annotated[int, typer.Option(help="requests per level")] = 64,
    rate: Annotated[
        float, typer.Option(help="arrivals per second, Poisson (inf: all at once)")
    ] = float("inf"),
    prompt_words: Annotated[int, typer.Option(help="words per (random, distinct) prompt")] = 128,
    output_tokens: Annotated[
        int, typer.Option(help="tokens per reply (ignore_eos: each reply is this long)")
    ] = 64,
    seed: Annotated[int, typer.Option(help="seed of the prompts and arrival times")] = 0,
    api_key: Annotated[str | None, typer.Option(help="sent as a Bearer token")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of the table")
    ] = False,
    watched: Annotated[
        bool,
        typer.Option(
            "--watched",
            help="each level twice: then again with a watcher reading /pagechat/events (a "
            "pagechat server), to see what watching costs",
        ),
    ] = False,
) -> None:
    """Load any OpenAI-compatible server (pagechat serve, vLLM, llama-server) with streamed
    completions: TTFT, ITL, TPOT and end-to-end latency percentiles and throughput per
    concurrency level."""
    from pagechat.cli.bench_serve_cmd import bench_serve_command
    from pagechat.tools.bench_serve import LoadSpec

    check_at_least_one(requests=requests, prompt_words=prompt_words, output_tokens=output_tokens)
    if not rate > 0:
        raise PagechatError(f"--rate must be > 0 (inf: all at once), got {rate}")
    if not url.startswith(("http://", "https://")):
        raise PagechatError(f"URL must start with http:// or https://, got {url!r}")
    spec = LoadSpec(url, model or "", requests, rate, prompt_words, output_tokens, seed, api_key)
    raise typer.Exit(
        bench_serve_command(spec, positive_ints(concurrency, "--concurrency"), as_json, watched)
    )


@app.command("train-demo")
def train_demo_cmd(
    out_dir: Annotated[
        Path,
        typer.Argument(
            help="new directory for the chat, chat-awq and draft models and metrics.json"
        ),
    ],
    seed: Annotated[
        int, typer.Option(help="corpus and weights are identical for the same seed and threads")
    ] = 0,
    threads: Annotated[int, typer.Option(help="torch threads (the result depends on it)")] = 2,
) -> None:
    """Train the demo chat model and its draft from an offline generated corpus (about 25
    minutes on 2 CPU cores), quantise the chat model to AWQ, and check all of them through the
    engine."""
    from pagechat.tools.demo.train import train_demo

    if threads < 1:
        raise PagechatError(f"--threads must be >= 1, got {threads}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise PagechatError(
            f"{out_dir} is not empty; train-demo writes into a new or empty directory"
        )
    metrics = train_demo(out_dir, seed=seed, threads=threads, log=lambda s: typer.echo(s, err=True))
    chat, spec = metrics["chat"], metrics["speculation"]
    typer.echo(
        f"wrote the demo models to {out_dir}: chat held-out {chat['heldout_correct']}/"
        f"{chat['heldout_total']}, draft acceptance {spec['acceptance_rate']}",
        err=True,
    )


@app.command()
@engine_options(*MODEL, *SPECULATION, *KV_POOL, *BATCH, "eager")
def serve(
    model_dir: OptionalModelDir = None,
    host: Annotated[
        str, typer.Option(help="address to listen on (0.0.0.0: every interface; needs a key)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="PAGECHAT_API_KEY",
            help="key clients must send (Authorization: Bearer KEY) to call /v1",
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="the model's name in the API (default: the directory's)")
    ] = None,
    kv_events: Annotated[
        str | None,
        typer.Option(
            help="publish the prefix cache's block events as vLLM does (ZMQ PUB, msgpack) on "
            "this endpoint, e.g. tcp://127.0.0.1:5557"
        ),
    ] = None,
    kv_events_replay: Annotated[
        str | None,
        typer.Option(help="answer requests for missed event batches on this ZMQ endpoint"),
    ] = None,
    kv_events_topic: Annotated[str, typer.Option(help="the events' ZMQ topic")] = "",
    *,
    config: EngineConfig,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="open the console on the server in this terminal (the server's log goes to a "
            "file); quitting it stops the server",
        ),
    ] = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat, completions, streaming), with
    Prometheus metrics at /metrics and the engine's records at /pagechat/events."""
    from pagechat.server.serve import ServerSettings
    from pagechat.server.serve import serve as serve_model
    from pagechat.tools.demo import model_or_demo

    if not 0 <= port <= 65535:
        raise PagechatError(f"--port must be in 0..65535, got {port}")
    if watch:
        from pagechat.cli.watch import serve_and_watch

        args = sys.argv[sys.argv.index("serve") + 1 :]
        raise typer.Exit(
            serve_and_watch([a for a in args if a != "--watch"], host, port, api_key or None)
        )
    if kv_events_replay and not kv_events:
        raise PagechatError("--kv-events-replay needs --kv-events")
    settings = ServerSettings(
        host,
        port,
        api_key or None,
        served_model_name,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        kv_events_topic=kv_events_topic,
    )
    serve_model(model_or_demo(model_dir, config.quant), config, settings)


@app.command()
def watch(
    urls: Annotated[
        list[str],
        typer.Argument(
            help="the server, e.g. http://127.0.0.1:8000; several: the fleet view, a row each",
            metavar="URL",
            show_default=False,
        ),
    ],
    api_key: Annotated[
        str | None,
        typer.Option(envvar="PAGECHAT_API_KEY", help="the server's key, if it has one"),
    ] = None,
    layout: Annotated[
        str, typer.Option(help="auto | tabs | grid (a pagechat server's console)")
    ] = "auto",
    kv_events: Annotated[
        str | None,
        typer.Option(
            help="draw the server's prefix cache from its KV events (vLLM's --kv-events-config, "
            "pagechat serve --kv-events), e.g. tcp://127.0.0.1:5557"
        ),
    ] = None,
    kv_events_replay: Annotated[
        str | None,
        typer.Option(help="the server's replay endpoint, to ask for event batches it missed"),
    ] = None,
    kv_events_topic: Annotated[str, typer.Option(help="the events' ZMQ topic")] = "",
) -> None:
    """Watch running servers live: a pagechat server in the full app (every client's requests in
    the panels, a chat through its API); a vLLM, llama.cpp, SGLang or Ollama server as gauges of
    what it exposes; with --kv-events, its prefix cache's blocks; several URLs as one fleet."""
    from pagechat.cli.watch import Events, watch_fleet
    from pagechat.cli.watch import watch as watch_server

    events = Events.of(kv_events, kv_events_replay, kv_events_topic)
    if len(urls) > 1:
        if events is not None:
            raise PagechatError("--kv-events reads one server's events: give one URL with it")
        raise typer.Exit(watch_fleet(urls, api_key or None))
    raise typer.Exit(watch_server(urls[0], api_key or None, layout, events))


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except PagechatError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a path the user named cannot be read or written
        print(
            f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr
        )
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
