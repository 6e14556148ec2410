"""Train the demo models offline on a CPU: a BPE tokenizer, a Llama chat model and its draft, then
check them through pagechat's own engine. `train_demo(out_dir, seed)` is deterministic by seed."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from pagechat.tools.demo import corpus
from pagechat.tools.make_model import (
    ENDOFTEXT_ID,
    EOS_IDS,
    IM_END,
    builtin_corpus,
    save_checkpoint,
    train_tokenizer,
)

VOCAB = 2048
MAX_LEN = 512
ROW = 256  # packed training row length
NUMBERS = 200  # 0..199 are single tokens


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama shape; hidden and intermediate are multiples of 128 (what int4/int8 kernels take)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


@dataclass(frozen=True, slots=True)
class Recipe:
    """How one model is trained: `drills` copy drills, then one pass over `dialogues` fresh
    conversations; AdamW with one cosine LR schedule over both."""

    shape: Shape
    dialogues: int
    drills: int = 6000
    rows: int = 4  # packed rows of ROW tokens per step
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01


# lr 2e-3: at 3e-3 and above the copy drills can stall (loss stuck near uniform) and never form
# induction heads
CHAT = Recipe(Shape(256, 768, 4, 4, 2), dialogues=80000)
DRAFT = Recipe(Shape(128, 384, 3, 2, 1), dialogues=44000)


def build_tokenizer(dialogues: list[list[dict]], vocab_size: int = VOCAB):
    """Byte-level BPE on the dialogue texts and Python's own docstrings, with every number 0..199
    made one token (with and without its leading space): copying, comparing and counting numbers is
    then copying, comparing and stepping single tokens, which a tiny model learns in minutes (digit
    by digit it does not)."""
    numbers = [
        " ".join(str(i) for i in range(NUMBERS)),
        "\n".join(str(i) for i in range(NUMBERS)),
    ] * 200
    texts = [m["content"] for d in dialogues for m in d] + ["user", "assistant", "system"] * 500
    tok = train_tokenizer(texts + numbers + builtin_corpus(), vocab_size)
    tok.model_max_length = MAX_LEN
    return tok


def encode(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of one ChatML conversation, and which of them the model learns to write (assistant
    contents and their <|im_end|>). The whole text is tokenised at once, as the engine will do."""
    text, spans, pos = "", [], 0
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        text += head + m["content"] + IM_END + "\n"
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(m["content"]) + len(IM_END)))
        pos = len(text)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    learn = [any(a <= s and e <= b for a, b in spans) and e > s for s, e in enc.offset_mapping]
    return enc.input_ids, learn


def pack(
    examples: list[tuple[list[int], list[bool]]], row: int, rng: random.Random
) -> list[list[int]]:
    """Group whole conversations, in a seeded order, into rows of <= `row` tokens (first fit)."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    rows, room = [], []
    for j in order:
        n = len(examples[j][0])
        k = next(
            (i for i in range(max(0, len(rows) - 8), len(rows)) if room[i] >= n), None
        )  # a few open rows
        if k is None:
            rows.append([]), room.append(row)
            k = len(rows) - 1
        rows[k].append(j)
        room[k] -= n
    return rows


def batches(examples, rows: list[list[int]], per_step: int):
    """(ids, positions, mask, targets) per step: packed rows, each conversation attending only to
    itself from position 0, as it will at inference; targets are -100 where nothing is learned and
    on the padding."""
    width = max(sum(len(examples[j][0]) for j in r) for r in rows)
    for i in range(0, len(rows), per_step):
        group = rows[i : i + per_step]
        ids = torch.full((len(group), width), ENDOFTEXT_ID)
        pos = torch.zeros((len(group), width), dtype=torch.long)
        doc = torch.full((len(group), width), -1)
        targets = torch.full((len(group), width), -100)
        for r, conv in enumerate(group):
            at = 0
            for d, j in enumerate(conv):
                x, learn = examples[j]
                sl = slice(at, at + len(x))
                ids[r, sl], pos[r, sl], doc[r, sl] = torch.tensor(x), torch.arange(len(x)), d
                targets[r, sl] = torch.where(torch.tensor(learn), torch.tensor(x), -100)
                at += len(x)
        mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(
            width, width, dtype=torch.bool
        ).tril()
        yield ids, pos, mask[:, None], targets


def llama_config(shape: Shape, vocab_size: int) -> transformers.LlamaConfig:
    """The transformers config of a demo model (tied embeddings, ChatML eos ids)."""
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=MAX_LEN,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        pad_token_id=ENDOFTEXT_ID,
        eos_token_id=EOS_IDS,
    )


def num_params(model: torch.nn.Module) -> int:
    """Parameters counted once (a tied embedding is one matrix)."""
    return sum(p.numel() for p in model.parameters())


def train_model(
    recipe: Recipe,
    drills,
    examples,
    vocab_size: int,
    seed: int,
    log: Callable[[str], None],
    on_step=None,
):
    """Train one Llama from scratch, drills first; return it and its mean loss, last 50 steps."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(recipe.shape, vocab_size)).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay
    )
    drills, examples = drills[: recipe.drills], examples[: recipe.dialogues]
    rows = pack(drills, ROW, random.Random(seed))
    rows += [[len(drills) + j for j in r] for r in pack(examples, ROW, random.Random(seed))]
    examples = drills + examples
    total = math.ceil(len(rows) / recipe.rows)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(
            (s + 1) / recipe.warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(s / total, 1.0)))
        ),
    )
    losses, t0 = [], time.perf_counter()
    for step, (ids, pos, mask, targets) in enumerate(batches(examples, rows, recipe.rows)):
        hidden = model.model(
            input_ids=ids, position_ids=pos, attention_mask=mask
        ).last_hidden_state[:, :-1]
        learn = (
            targets[:, 1:] != -100
        )  # the head runs only where a token is learned (saves its share)
        loss = F.cross_entropy(model.lm_head(hidden[learn]), targets[:, 1:][learn])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == total - 1:
            log(
                f"  step {step + 1}/{total}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}  "
                f"{time.perf_counter() - t0:.0f}s"
            )
        if on_step is not None:
            on_step(step + 1, model)
    return model.eval(), sum(losses[-50:]) / len(losses[-50:])


def _engine(model_dir: Path, **config):
    from pagechat.core.config import EngineConfig
    from pagechat.core.engine import Engine

    return Engine(
        model_dir, EngineConfig(device="cpu", dtype="float32", **config)
    )  # float32: the same on every CPU


def _greedy(engine, questions: list[str], max_tokens: int = 96, on_report=None):
    from pagechat.core.params import SamplingParams

    prompts = [engine.requests.encode(q, chat=True) for q in questions]
    return engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), on_report=on_report
    )


def evaluate(model_dir: str | Path, n: int = 10, quant: str | None = None) -> dict:
    """Held-out accuracy at temperature 0 through the Engine (float32): first n held-out items."""
    items = corpus.heldout(n)
    texts = [
        s.text
        for s in _greedy(_engine(Path(model_dir), quant=quant), [it.question for it in items])
    ]
    ok = [corpus.check(t, it) for t, it in zip(texts, items)]
    return {
        "correct": sum(ok),
        "total": len(items),
        "replies": [
            {"question": it.question, "reply": t, "ok": k} for it, t, k in zip(items, texts, ok)
        ],
    }


def acceptance(chat_dir: Path, draft_dir: Path, k: int = 4, n: int = 50) -> dict:
    """Greedy speculative decoding through the Engine with the draft, on n held-out questions: the
    engine's own speculation totals, and whether every reply equals plain greedy decoding's."""
    from pagechat.core.report import SpecTotals

    questions = [it.question for it in corpus.heldout(n)]
    fast = _greedy(_engine(chat_dir, draft=str(draft_dir), num_draft=k), questions)
    spec = sum((s.spec for s in fast), SpecTotals())
    plain = _greedy(_engine(chat_dir), questions)
    return {
        "k": k,
        "questions": n,
        "acceptance_rate": round(spec.acceptance_rate or 0.0, 4),
        "mean_acceptance_length": round(spec.mean_acceptance_length or 0.0, 4),
        "per_position": [round(spec.position_rate(i) or 0.0, 4) for i in range(len(spec.tried))],
        "same_as_plain": all(a.output_ids == b.output_ids for a, b in zip(fast, plain)),
    }


def train_demo(
    out_dir: str | Path,
    seed: int = 0,
    threads: int = 2,
    log: Callable[[str], None] = print,
    chat: Recipe = CHAT,
    draft: Recipe = DRAFT,
) -> dict:
    """Train tokenizer, chat model and draft into out_dir/{chat,draft}, quantise the chat model to
    out_dir/chat-awq, evaluate all through the engine, write out_dir/metrics.json. The same seed and
    thread count give the same files (the thread count fixes the reductions' order)."""
    from pagechat.quant.checkpoint import quantize_checkpoint

    # 2 threads by default: on a quiet 2-core machine a chat step takes about half the time it
    # takes with one; under other load they wait on each other and can be slower than one.
    torch.set_num_threads(threads)
    out_dir, t0 = Path(out_dir), time.perf_counter()
    n = max(chat.dialogues, draft.dialogues)
    dialogues = corpus.training_dialogues(n, seed)
    tok = build_tokenizer(dialogues)
    examples = [encode(tok, d) for d in dialogues]
    drills = [encode(tok, d) for d in corpus.copy_drills(max(chat.drills, draft.drills), seed)]
    log(
        f"corpus: {len(examples)} dialogues, {sum(len(x) for x, _ in examples)} tokens, "
        f"vocab {len(tok)}"
    )
    metrics = {"seed": seed, "threads": threads, "vocab_size": len(tok), "dialogues": len(examples)}
    for name, recipe in (("chat", chat), ("draft", draft)):
        log(f"training {name} {recipe.shape}")
        t = time.perf_counter()
        model, loss = train_model(recipe, drills, examples, len(tok), seed, log)
        path = save_checkpoint(model, tok, out_dir / name, torch.bfloat16)
        result = evaluate(path)
        metrics[name] = {
            "shape": asdict(recipe.shape),
            "params": num_params(model),
            "dialogues": recipe.dialogues,
            "final_loss": round(loss, 6),
            "heldout_correct": result["correct"],
            "heldout_total": result["total"],
            "heldout_50_correct": evaluate(path, 50)["correct"],
            "train_seconds": round(time.perf_counter() - t, 1),
        }
        if name == "chat":
            metrics[name]["heldout_replies"] = result["replies"]
        log(f"{name}: loss {loss:.4f}, held-out {result['correct']}/{result['total']}")
    quantize_checkpoint(
        out_dir / "chat", out_dir / "chat-awq", "awq", group=128, texts=corpus.calibration_texts()
    )
    metrics["variants"] = {
        label: {
            "heldout_correct": evaluate(path, quant=quant)["correct"],
            "heldout_50_correct": evaluate(path, 50, quant=quant)["correct"],
        }
        for label, path, quant in (
            ("awq", out_dir / "chat-awq", None),
            ("int8", out_dir / "chat", "int8"),
            ("int8-wo", out_dir / "chat", "int8-wo"),
        )
    }
    log(f"variants: {metrics['variants']}")
    metrics["speculation"] = acceptance(out_dir / "chat", out_dir / "draft")
    metrics["total_seconds"] = round(time.perf_counter() - t0, 1)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
