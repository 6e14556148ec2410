"""Random-initialised checkpoints of each supported architecture, made offline with transformers'
own classes: the test oracle's fixtures and the `pagechat make-model` command."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from pagechat.core.errors import PagechatError
from pagechat.core.modelspec import dtype_name
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # the trainer gives them ids 0, 1, 2
ENDOFTEXT_ID, IM_END_ID = 0, 2
EOS_IDS = [IM_END_ID, ENDOFTEXT_ID]  # a reply ends at <|im_end|>; <|endoftext|> also stops
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHS = {  # arch -> (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
SIZES = ("tiny", "small", "0.5b")
TINY_VOCAB = 1024
SMALL_TOKENIZER_VOCAB = 8192

# Pure-Python or platform-neutral modules only: their docstrings depend on the Python version alone
# (os, socket, hashlib, decimal... differ between platforms or build options, so they are left out).
_CORPUS_MODULES = (
    "abc",
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "heapq",
    "html",
    "inspect",
    "json",
    "logging",
    "math",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "tarfile",
    "textwrap",
    "threading",
    "operator",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)
_PAGECHAT_LINES = [
    "pagechat chats with a local language model through its own paged key-value cache engine.",
    "The KV cache is split into blocks of 16 tokens; a block table lists a sequence's blocks.",
    "Prefix caching shares full blocks between sequences whose prompts start with the same tokens.",
    "A block shared by two sequences is copied on write before either of them appends to it.",
    "The scheduler batches prefill chunks and decode steps together under a token budget per step.",
    "When blocks run out, the newest sequence is preempted and recomputed later.",
    "The sampler applies temperature, top-k, top-p, min-p and a repetition penalty to the logits.",
    "Speculative decoding drafts a few tokens cheaply and the target model verifies them at once.",
    "Rejected draft tokens are rolled back, freeing their KV slots.",
    "Weights can be loaded in bf16, fp16, int8 or 4-bit AWQ; the memory panel shows what fits.",
    "<|im_start|>user\nHow many KV blocks does my prompt use?<|im_end|>\n"
    "<|im_start|>assistant\nA 40-token prompt fills two blocks and part of a third.<|im_end|>\n",
]


def _member_docs(module) -> list[str]:
    """Docstrings of a module, its public classes and functions, and their public methods."""
    docs = [inspect.getdoc(module)]
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            docs.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            docs += [
                inspect.getdoc(v)
                for k, v in sorted(vars(obj).items())
                if not k.startswith("_") and inspect.isroutine(v)
            ]
    return [d for d in docs if d]


def builtin_corpus() -> list[str]:
    """Offline training text: docstrings of a fixed list of stdlib modules plus pagechat notes."""
    texts = []
    for name in _CORPUS_MODULES:
        texts += _member_docs(importlib.import_module(name))
    return texts + _PAGECHAT_LINES


def _train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the special tokens first (ids 0, 1, 2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _wrap(tok: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """The transformers tokenizer: <|im_end|> is eos so generation stops at the end of a turn."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template."""
    return _wrap(_train_bpe(texts, vocab_size))


@functools.lru_cache(maxsize=4)
def _builtin_tokenizer_json(vocab_size: int) -> str:
    """Trained once per process; kept as JSON so that each caller gets its own fresh copy."""
    return _train_bpe(builtin_corpus(), vocab_size).to_str()


def builtin_tokenizer(vocab_size: int = TINY_VOCAB) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer of the random models: trained on builtin_corpus(), cached in-process."""
    return _wrap(Tokenizer.from_str(_builtin_tokenizer_json(vocab_size)))


def _check_choice(arch: str, size: str) -> None:
    """One-line PagechatError naming the valid choices."""
    if arch not in ARCHS:
        raise PagechatError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise PagechatError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")


def _tiny_extras(arch: str) -> dict:
    """Per-arch differences, so the four tiny models together cover the engine's features."""
    if arch == "llama":  # llama3 rope scaling, untied
        return dict(
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":  # window larger than the context, as Mistral v0.1 has
        return dict(rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False)
    if arch == "qwen2":  # tied; qkv bias is built into Qwen2
        return dict(rope_theta=1000000.0, tie_word_embeddings=True)
    # qwen3: head_dim 32 differs from hidden/heads = 16; q/k norm is built into Qwen3
    return dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True)


def model_config(arch: str, size: str, vocab_size: int | None = None):
    """The transformers config of one arch/size (vocab_size: tiny only, the tokenizer's size)."""
    _check_choice(arch, size)
    ids = dict(bos_token_id=None, pad_token_id=ENDOFTEXT_ID, eos_token_id=EOS_IDS)
    if size == "small":  # SmolLM2-135M shape
        shape = dict(
            vocab_size=49152,
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
        )
    elif size == "0.5b":  # Qwen2-0.5B shape
        shape = dict(
            vocab_size=151936,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=4864,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            initializer_range=0.02,
        )
    else:  # wide init (0.1) gives clear argmax gaps for greedy comparisons between implementations
        shape = dict(
            vocab_size=vocab_size or TINY_VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            initializer_range=0.1,
            **_tiny_extras(arch),
        )
    # rope_theta/rope_scaling kwargs are accepted by 4.x and converted to rope_parameters by 5.x
    cls = getattr(transformers, ARCHS[arch][0])
    return cls(architectures=[ARCHS[arch][1]], **shape, **ids)


def _init_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """pagechat's own init, the same under every transformers version: matrices N(0, std); norm
    weights N(1, std) and biases N(0, std) rather than 1 and 0, so loading them wrongly shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # fixed order; a tied weight is listed once
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std, generator=gen)


def _add_legacy_keys(config_path: Path, dtype: str) -> None:
    """Write both key spellings (4.x: torch_dtype, rope_theta, rope_scaling; 5.x: dtype,
    rope_parameters) so the checkpoint reads like a Hub one under either version."""
    cfg = json.loads(config_path.read_text())
    cfg.setdefault("torch_dtype", dtype)
    cfg.setdefault("dtype", dtype)
    rope = cfg.get("rope_parameters")
    if rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer: transformers.PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Save the tokenizer files under a class name all transformers versions know (5.x writes its
    own name)."""
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_checkpoint(model, tokenizer, out_dir: Path, dtype: torch.dtype) -> Path:
    """Write a Hub-style checkpoint: safetensors weights in `dtype`, the tokenizer, ChatML eos ids
    in generation_config.json, and both config key spellings. make-model and the demo use it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=None, pad_token_id=ENDOFTEXT_ID, eos_token_id=EOS_IDS
    )
    with _quiet_transformers():
        model.save_pretrained(out_dir, safe_serialization=True)
        save_tokenizer(tokenizer, out_dir)
    _add_legacy_keys(out_dir / "config.json", dtype_name(dtype))
    return out_dir


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars or info logs from transformers (make_model prints nothing)."""
    tf_log = transformers.utils.logging
    bars, level = tf_log.is_progress_bar_enabled(), tf_log.get_verbosity()
    tf_log.disable_progress_bar()
    tf_log.set_verbosity_error()
    try:
        yield
    finally:
        tf_log.set_verbosity(level)
        if bars:
            tf_log.enable_progress_bar()


def make_model(out_dir: Path, arch: str, size: str, seed: int = 0) -> Path:
    """Write a random-initialised `arch`/`size` checkpoint (safetensors + tokenizer) to out_dir."""
    _check_choice(arch, size)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PagechatError(
            f"{out_dir} exists and is not an empty directory; choose a new directory"
        )
    tokenizer = builtin_tokenizer(TINY_VOCAB if size == "tiny" else SMALL_TOKENIZER_VOCAB)
    config = model_config(arch, size, len(tokenizer))
    tokenizer.model_max_length = config.max_position_embeddings
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    # Built on the meta device, then given storage and our init: skips torch's and transformers'
    # default inits (most of the time for `small`). Non-persistent buffers such as rotary inv_freq
    # are left unset, which is fine because this model is only saved, never run.
    with torch.device("meta"):
        model = getattr(transformers, ARCHS[arch][1])(config)
    model = model.to_empty(device="cpu").to(dtype)
    model.tie_weights()  # to_empty gives each meta tensor its own storage, undoing the tie
    _init_weights(model, config.initializer_range, seed)
    return save_checkpoint(model, tokenizer, out_dir, dtype)
