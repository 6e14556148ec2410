"""What a KV-aware router gets from pagechat servers' KV events, measured by hand against servers
started with `--kv-events` (docs/design.md, "A fleet behind a router"):

    python -m pagechat.tools.route_probe MODEL_DIR \\
        http://127.0.0.1:8101=tcp://127.0.0.1:5601 http://127.0.0.1:8102=tcp://127.0.0.1:5611

Conversations (each under a long system prompt of its own) send their turns, each turn's prompt the
last one plus a new question, as completions of token ids. Two policies in turn, each with fresh
conversations: round robin, and by cached prefix (the server whose events hold the longest run of
the prompt's blocks, matched by their tokens, as a router must match a server whose hashes it
cannot compute; ties go round robin). For each: the prefix-cache hit rate the servers count, TTFT
p50, and what the router read: batches and bytes a second, and how long after a request ended the
blocks of its prompt were announced.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import httpx
from pagechat.core.loader import load_tokenizer
from pagechat.tools.kv_events import EventFeed
from prometheus_client.parser import text_string_to_metric_families

WORDS = (
    "ledger harbour copper lantern orchard meadow willow falcon quartz compass anchor velvet "
    "juniper saffron glacier marble pebble mosaic cobalt lagoon prairie thistle canyon ember"
).split()
ANNOUNCED_WAIT_S = 2.0  # blocks not announced by then count as never


def hit_counters(url: str) -> tuple[float, float]:
    """A pagechat server's prefix-cache hits and queries (tokens) since it started."""
    found = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for what in found:
            if family.name == f"pagechat:prefix_cache_{what}":
                found[what] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found["hits"], found["queries"]


def pick(feeds: list[EventFeed], ids: list[int], policy: str, turn: int) -> int:
    """The server for this prompt: round robin, or the one holding most of its leading blocks."""
    if policy == "prefix":
        held = [f.prefix_of(ids) for f in feeds]
        best = [i for i, n in enumerate(held) if n == max(held)]
        if max(held):
            return best[turn % len(best)]
    return turn % len(feeds)


def announced_after(feed: EventFeed, ids: list[int]) -> float | None:
    """Seconds until the server's events hold every full block of this prompt (None: not within
    ANNOUNCED_WAIT_S)."""
    done = time.perf_counter()
    while time.perf_counter() - done < ANNOUNCED_WAIT_S:
        if feed.holds(ids):
            return time.perf_counter() - done
        time.sleep(0.0005)
    return None


def run(urls: list[str], feeds: list[EventFeed], prompts: list, policy: str) -> dict:
    before = [hit_counters(u) for u in urls]
    start = [f.view() for f in feeds]
    t0 = time.monotonic()
    ttft, announced, turn = [], [], 0
    for t in range(len(prompts[0])):
        for conversation in prompts:
            ids = conversation[t]
            choice = pick(feeds, ids, policy, turn)
            turn += 1
            body = {"prompt": ids, "max_tokens": 8, "stream": True, "temperature": 0}
            sent = time.perf_counter()
            with httpx.stream(
                "POST", f"{urls[choice]}/v1/completions", json=body, timeout=120
            ) as r:
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - sent
            ttft.append(first)
            waited = announced_after(feeds[choice], ids)
            if waited is not None:
                announced.append(waited)
    seconds = time.monotonic() - t0
    after = [hit_counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queried = sum(a[1] - b[1] for a, b in zip(after, before))
    end = [f.view() for f in feeds]
    batches = sum(e.batches - b.batches for e, b in zip(end, start))
    sent_bytes = sum(e.bytes - b.bytes for e, b in zip(end, start))
    return {
        "policy": policy,
        "requests": turn,
        "prefix hit rate": hits / queried if queried else 0.0,
        "TTFT p50 ms": 1000 * statistics.median(ttft),
        "event batches/s": batches / seconds,
        "event KB/s": sent_bytes / seconds / 1024,
        "announced after end, p50 ms": 1000 * statistics.median(announced) if announced else None,
        "never announced": turn - len(announced),
    }


def conversations(tokenizer, n: int, turns: int, seed: int) -> list[list[list[int]]]:
    """n conversations, each its turns' prompts as token ids (each turn extends the last)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "System: " + " ".join(rng.choice(WORDS) for _ in range(300))
        prompts = []
        for _ in range(turns):
            text += "\nUser: " + " ".join(rng.choice(WORDS) for _ in range(20)) + "\nAssistant:"
            prompts.append(tokenizer(text).input_ids)
        out.append(prompts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="the servers' model (its tokenizer makes the prompts)")
    parser.add_argument("servers", nargs="+", help="URL=EVENTS_ENDPOINT, one per server")
    # odd: round robin then sends a conversation's turns to the servers in turn
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    pairs = [s.split("=", 1) for s in args.servers]
    urls = [u for u, _ in pairs]
    feeds = [EventFeed(ep).start() for _, ep in pairs]
    time.sleep(0.5)  # the SUB sockets join before any request
    tokenizer = load_tokenizer(Path(args.model_dir))
    try:
        seed = random.randrange(1 << 30)  # conversations no server has seen before
        for k, policy in enumerate(("round robin", "prefix")):
            prompts = conversations(tokenizer, args.conversations, args.turns, seed + k)
            print(run(urls, feeds, prompts, policy))
    finally:
        for f in feeds:
            f.stop()


if __name__ == "__main__":
    main()
