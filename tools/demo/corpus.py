"""The demo models' training text, made offline from templates under a seed, and its held-out split.

Every item is one user question and one short assistant answer whose correctness can be checked with
a substring (`expect`). Held-out questions come from the same templates, but their keys are
reserved, so the training generator never emits them. Two strengths of reservation:
- comparisons and repeats reserve the content: the pair of numbers (in any order and phrasing) and
  the sentence never appear, so the model must compare numbers and copy words it never saw together;
- sums, products, counts, "what comes after" and facts reserve the exact question: the same numbers
  or concept appear in other phrasings. A model of a few million parameters trained for minutes
  memorises these tables rather than learning arithmetic (reserving whole operand pairs leaves it
  guessing at unseen sums), so what is tested there is that it understands a phrasing it never saw
  with those numbers.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

HELDOUT_SEED = 20240  # the held-out split is fixed: it does not move with the training seed
HELDOUT_MIX = (
    "add",
    "add",
    "mul",
    "cmp",
    "cmp",
    "count",
    "next",
    "repeat",
    "fact",
    "fact",
)  # one round of 10
HELDOUT_ROUNDS = 5  # reserved pool: 50 questions; the first round is the official 10

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are the pagechat demo model. Answer briefly.",
    "You are a small model running inside pagechat.",
    "Answer the question in one sentence.",
)

# concept -> (answer, expected substring of a correct reply)
FACTS: dict[str, tuple[str, str]] = {
    "a KV block": (
        "A KV block holds the keys and values of 16 tokens for every layer of the model.",
        "keys and values of 16 tokens",
    ),
    "the block size": (
        "The block size is how many tokens one KV block holds; pagechat uses 16 by default.",
        "16 by default",
    ),
    "the KV cache": (
        "The KV cache keeps the keys and values of earlier tokens, so a new token attends to them "
        "without recomputing them.",
        "without recomputing",
    ),
    "a block table": (
        "A block table lists the KV blocks of one sequence in order, so attention can find its "
        "tokens in the pool.",
        "lists the KV blocks",
    ),
    "prefill": (
        "Prefill runs the whole prompt through the model in one pass and writes its keys and "
        "values into the KV cache.",
        "whole prompt",
    ),
    "chunked prefill": (
        "Chunked prefill splits a long prompt into pieces, so decode steps of other sequences keep "
        "running in between.",
        "splits a long prompt",
    ),
    "decode": (
        "Decode makes one new token per step for each running sequence, reading the KV cache of "
        "the tokens before it.",
        "one new token per step",
    ),
    "sampling": (
        "Sampling picks the next token at random from the model's probabilities, shaped by "
        "temperature, top-k and top-p.",
        "at random from the model's probabilities",
    ),
    "greedy decoding": (
        "Greedy decoding always takes the most likely token; it is what temperature 0 means.",
        "most likely token",
    ),
    "temperature": (
        "Temperature divides the logits before the softmax: 0 is greedy, higher values make the "
        "text more varied.",
        "divides the logits",
    ),
    "top-p": (
        "Top-p keeps the smallest set of tokens whose probabilities add up to p, and samples from "
        "that set.",
        "smallest set of tokens",
    ),
    "top-k": (
        "Top-k keeps only the k most likely tokens and samples from them.",
        "k most likely tokens",
    ),
    "min-p": (
        "Min-p drops every token whose probability is below min-p times the probability of the "
        "best token.",
        "times the probability of the best token",
    ),
    "the repetition penalty": (
        "The repetition penalty lowers the scores of tokens that already appeared, so the text "
        "repeats less.",
        "already appeared",
    ),
    "the prefix cache": (
        "The prefix cache shares full KV blocks between prompts that start with the same tokens, "
        "so they are computed once.",
        "start with the same tokens",
    ),
    "copy-on-write": (
        "Copy-on-write gives a sequence its own copy of a shared block just before it writes to "
        "that block.",
        "its own copy",
    ),
    "speculative decoding": (
        "Speculative decoding lets a small draft model propose a few tokens, and the target model "
        "checks them all in one pass.",
        "draft model propose",
    ),
    "the draft model": (
        "The draft model is a small model with the same vocabulary that guesses the next few "
        "tokens for the big model.",
        "guesses the next few tokens",
    ),
    "the acceptance rate": (
        "The acceptance rate is the share of draft tokens that the target model accepts.",
        "share of draft tokens",
    ),
    "preemption": (
        "Preemption frees the blocks of the newest sequence when the pool runs out, and recomputes "
        "that sequence later.",
        "newest sequence",
    ),
    "the scheduler": (
        "The scheduler chooses which sequences run in each step, under a budget of tokens per "
        "step.",
        "budget of tokens",
    ),
    "continuous batching": (
        "Continuous batching adds new requests to the running batch at every step instead of "
        "waiting for the batch to end.",
        "at every step",
    ),
    "TTFT": (
        "TTFT is the time to first token: how long a request waits before its first new token "
        "appears.",
        "time to first token",
    ),
    "AWQ": (
        "AWQ stores weights in 4 bits, scaled so that the weights that matter most keep their "
        "precision.",
        "4 bits",
    ),
    "int8 weights": (
        "Int8 weights use one byte per weight, half the memory of bf16.",
        "one byte per weight",
    ),
    "the memory panel": (
        "The memory panel shows how much memory the weights and the KV cache take, and whether a "
        "model fits.",
        "whether a model fits",
    ),
    "a token": (
        "A token is a piece of text, often a word or part of a word, that the model reads and "
        "writes.",
        "piece of text",
    ),
    "the chat template": (
        "The chat template turns the messages of a conversation into the text the model was "
        "trained on.",
        "messages of a conversation",
    ),
}
FACT_TEMPLATES = (
    "What is {c}?",
    "Explain {c}.",
    "What does {c} mean?",
    "Tell me about {c}.",
    "Can you explain {c}?",
    "What is {c} in pagechat?",
    "Describe {c} briefly.",
)

SMALL_TALK = (
    (
        ("Hello!", "Hi!", "Hi there.", "Hey!", "Good morning!", "Hello, who is this?"),
        "Hello! I am the pagechat demo model. Ask me a sum, a comparison, or something about the "
        "engine.",
    ),
    (
        ("How are you?", "How are you doing?", "How is it going?"),
        "I am fine, thank you. My KV blocks are free and ready.",
    ),
    (
        ("Who are you?", "What are you?", "What is your name?"),
        "I am the pagechat demo model, a small Llama model trained on this machine in a few "
        "minutes.",
    ),
    (
        ("What can you do?", "What do you know?", "How can you help me?"),
        "I can add, subtract and multiply small numbers, compare numbers, count, repeat a "
        "sentence, and explain how "
        "pagechat works.",
    ),
    (("Thanks!", "Thank you.", "Thank you very much!", "Great, thanks."), "You are welcome!"),
    (("Bye!", "Goodbye.", "See you later."), "Goodbye! Your KV blocks will be freed."),
    (
        ("What is pagechat?", "Tell me about pagechat.", "What does pagechat do?"),
        "pagechat runs a language model on your own machine with a paged KV cache, and shows what "
        "the engine does.",
    ),
    (
        ("Are you a large model?", "Is this a big model?", "How big are you?"),
        "No, I am tiny: a few million parameters, small enough to train on a laptop CPU.",
    ),
)

WORDS = (
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sun",
    "moon",
    "river",
    "tree",
    "house",
    "road",
    "book",
    "lamp",
    "cup",
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "new",
    "quiet",
    "fast",
    "slow",
    "warm",
    "cold",
    "bright",
    "runs",
    "sleeps",
    "sings",
    "reads",
    "waits",
    "jumps",
    "shines",
    "falls",
    "grows",
    "opens",
    "turns",
    "over",
    "under",
    "near",
    "with",
    "into",
    "from",
    "today",
    "again",
    "now",
    "here",
    "there",
    "always",
    "model",
    "token",
    "block",
    "cache",
    "prompt",
    "engine",
    "step",
    "batch",
    "queue",
    "page",
    "memory",
    "apple",
    "stone",
    "cloud",
    "wind",
    "rain",
    "snow",
    "field",
    "hill",
    "boat",
    "train",
    "song",
)
REPEAT_TEMPLATES = (
    "Repeat after me: {s}",
    "Say this back to me: {s}",
    "Please repeat: {s}",
    "Echo this sentence: {s}",
)
ADD_TEMPLATES = (
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "How much is {a} plus {b}?",
    "Compute {a} + {b}.",
    "What do you get when you add {a} and {b}?",
)
SUB_TEMPLATES = (
    "What is {a} minus {b}?",
    "What is {a} - {b}?",
    "Subtract {b} from {a}.",
    "How much is {a} minus {b}?",
    "Compute {a} - {b}.",
    "What is left when you take {b} from {a}?",
)
MUL_TEMPLATES = (
    "What is {a} times {b}?",
    "What is {a} x {b}?",
    "Multiply {a} by {b}.",
    "How much is {a} times {b}?",
)
SMALL = 10  # sums and differences use operands 0..SMALL; products 1..12
AFTER_TEMPLATES = (
    "What comes after {n}?",
    "Which number follows {n}?",
    "What is the next number after {n}?",
)
BEFORE_TEMPLATES = (
    "What comes before {n}?",
    "Which number is just before {n}?",
    "What is the number before {n}?",
)
COUNT_TEMPLATES = (
    "Count from {a} to {b}.",
    "List the numbers from {a} to {b}.",
    "Please count from {a} to {b}.",
)


@dataclass(frozen=True, slots=True)
class Item:
    """A question and its answer: `key` reserves it for held-out use, `expect` checks a reply."""

    kind: str
    key: tuple
    question: str
    answer: str
    expect: str


# Answers start with a word: every number or word copied into them then carries a leading space,
# the same token as in the question (a reply that starts with "33" would need "33" learned apart
# from " 33").
def _add(rng: random.Random, hard: bool) -> Item:
    a, b = rng.randint(2 if hard else 0, SMALL), rng.randint(2 if hard else 0, SMALL)
    q = rng.choice(ADD_TEMPLATES).format(a=a, b=b)
    return Item("add", ("add", q), q, f"The sum of {a} and {b} is {a + b}.", f"is {a + b}.")


def _sub(rng: random.Random, hard: bool) -> Item:
    a, b = sorted((rng.randint(0, SMALL), rng.randint(0, SMALL)), reverse=True)
    q = rng.choice(SUB_TEMPLATES).format(a=a, b=b)
    return Item(
        "sub", ("sub", q), q, f"The difference between {a} and {b} is {a - b}.", f"is {a - b}."
    )


def _mul(rng: random.Random, hard: bool) -> Item:
    a, b = rng.randint(2 if hard else 1, 12), rng.randint(2 if hard else 1, 12)
    q = rng.choice(MUL_TEMPLATES).format(a=a, b=b)
    return Item("mul", ("mul", q), q, f"The product of {a} and {b} is {a * b}.", f"is {a * b}.")


def _cmp(rng: random.Random, hard: bool) -> Item:
    a, b = rng.sample(range(10 if hard else 0, 100), 2)
    hi, lo = max(a, b), min(a, b)
    form = rng.randrange(4)
    if form < 3:
        q = (
            f"Which is larger, {a} or {b}?",
            f"Which number is bigger: {a} or {b}?",
            f"Which is smaller, {a} or {b}?",
        )[form]
        ans = f"The smaller number is {lo}." if form == 2 else f"The larger number is {hi}."
        exp = ans
    else:
        yes = a > b
        q = f"Is {a} larger than {b}?"
        ans = f"Yes, {a} is larger than {b}." if yes else f"No, {a} is smaller than {b}."
        exp = ans[:-1]
    return Item("cmp", ("cmp", lo, hi), q, ans, exp)


def _count(rng: random.Random, hard: bool) -> Item:
    a = rng.randint(0, 94)
    b = a + rng.randint(2, 5)
    seq = ", ".join(str(n) for n in range(a, b + 1)) + "."
    q = rng.choice(COUNT_TEMPLATES).format(a=a, b=b)
    return Item("count", ("count", q), q, f"Here they are: {seq}", seq)


def _next(rng: random.Random, hard: bool) -> Item:
    n = rng.randint(10, 98) if hard else rng.randint(1, 198)
    if rng.random() < 0.5:
        q = rng.choice(AFTER_TEMPLATES).format(n=n)
        return Item("next", ("next", q), q, f"After {n} comes {n + 1}.", f"comes {n + 1}.")
    q = rng.choice(BEFORE_TEMPLATES).format(n=n)
    return Item("next", ("next", q), q, f"Before {n} comes {n - 1}.", f"comes {n - 1}.")


def _sentence(rng: random.Random, hard: bool) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 8) if hard else rng.randint(3, 16))]
    return (
        " ".join(words) + "."
    )  # lower case: a capitalised first word would be a rare token to copy


def _repeat(rng: random.Random, hard: bool) -> Item:
    s = _sentence(rng, hard)
    return Item(
        "repeat", ("repeat", s), rng.choice(REPEAT_TEMPLATES).format(s=s), f"You said: {s}", s
    )


def _fact(rng: random.Random, hard: bool) -> Item:
    t, c = rng.randrange(len(FACT_TEMPLATES)), rng.choice(sorted(FACTS))
    q = FACT_TEMPLATES[t].format(c=c)
    q = q[0].upper() + q[1:]
    answer, expect = FACTS[c]
    return Item("fact", ("fact", t, c), q, answer, expect)


def _talk(rng: random.Random, hard: bool) -> Item:
    questions, answer = rng.choice(SMALL_TALK)
    q = rng.choice(questions)
    return Item("talk", ("talk", q), q, answer, answer)


MAKERS: dict[str, Callable[[random.Random, bool], Item]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "cmp": _cmp,
    "count": _count,
    "next": _next,
    "repeat": _repeat,
    "fact": _fact,
    "talk": _talk,
}
# Copying is what a tiny model learns last (it needs induction heads), and sums, comparisons and
# counts all copy numbers from the question: long repeat-after-me sentences are a dense copy signal.
WEIGHTS = {
    "add": 13,
    "sub": 5,
    "mul": 8,
    "cmp": 16,
    "count": 10,
    "next": 9,
    "repeat": 20,
    "fact": 8,
    "talk": 4,
}


def heldout_pool() -> list[Item]:
    """All reserved questions (HELDOUT_ROUNDS rounds of HELDOUT_MIX), whatever the training seed."""
    rng, items, keys = random.Random(HELDOUT_SEED), [], set()
    for kind in HELDOUT_MIX * HELDOUT_ROUNDS:
        item = MAKERS[kind](rng, True)
        while item.key in keys:
            item = MAKERS[kind](rng, True)
        keys.add(item.key)
        items.append(item)
    return items


def heldout(n: int = 10) -> list[Item]:
    """The first n held-out questions; n=10 is the official set (one round of each kind)."""
    return heldout_pool()[:n]


def sample_items(rng: random.Random, reserved: set[tuple]) -> Item:
    """One training item of a kind drawn by WEIGHTS, never one whose key is reserved."""
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    item = MAKERS[kind](rng, False)
    while item.key in reserved:
        item = MAKERS[kind](rng, False)
    return item


def dialogue(rng: random.Random, reserved: set[tuple]) -> list[dict]:
    """One conversation: an optional system prompt and 1-3 user/assistant exchanges."""
    messages = (
        [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.15 else []
    )
    turns = rng.choices((1, 2, 3), weights=(70, 20, 10))[0]
    for _ in range(turns):
        item = sample_items(rng, reserved)
        messages += [
            {"role": "user", "content": item.question},
            {"role": "assistant", "content": item.answer},
        ]
    return messages


def training_dialogues(n: int, seed: int = 0) -> list[list[dict]]:
    """n training conversations, the same for the same seed; none contains a held-out question."""
    rng = random.Random(seed)
    reserved = {item.key for item in heldout_pool()}
    return [dialogue(rng, reserved) for _ in range(n)]


def copy_drills(n: int, seed: int = 0) -> list[list[dict]]:
    """n repeat-after-me conversations with long sentences (8-24 words): a dense copy signal that
    the training starts with, so that induction heads form before the mixed corpus needs them."""
    rng = random.Random(f"drills-{seed}")
    reserved = {item.key for item in heldout_pool()}
    out = []
    while len(out) < n:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) + "."
        if ("repeat", s) not in reserved:
            q = rng.choice(REPEAT_TEMPLATES).format(s=s)
            out.append(
                [{"role": "user", "content": q}, {"role": "assistant", "content": f"You said: {s}"}]
            )
    return out


def render(messages: list[dict]) -> str:
    """A conversation as ChatML text, exactly as the chat template writes it."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def check(reply: str, item: Item) -> bool:
    """True when the reply contains the item's expected answer."""
    return item.expect in reply


CALIB_SEED = 1234  # calibration dialogues; evaluation text uses other seeds


def calibration_texts() -> Iterator[str]:
    """Endless offline calibration text for AWQ: the corpus's dialogues in ChatML, 200 per seed."""
    for seed in itertools.count(CALIB_SEED):
        yield "".join(render(d) for d in training_dialogues(200, seed=seed))
