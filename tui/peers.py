"""What a server exposes, read and turned into the figures the peer console and the fleet view
show: one Scrape per poll (its /metrics, llama.cpp's /slots, Ollama's /api/ps), Figures from two
of them (rates and latency percentiles over the time between), and for each figure a server does
not expose, the one line that says why.

Names are the servers' own: vLLM's `vllm:` families (its v1 engine) and pagechat's `pagechat:`
ones, which mean the same; llama.cpp's `llamacpp:` families (served with --metrics) and its /slots
and /props JSON; SGLang's `sglang:` families (served with --enable-metrics); Ollama's /api/ps (it
has no /metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from pagechat.core.errors import PagechatError
from pagechat.tools.http_client import bearer, model_card, server_url
from prometheus_client.parser import text_string_to_metric_families

# the servers pagechat watches, as their /v1/models says who owns a model -> their names
KINDS = {
    "pagechat": "pagechat",
    "vllm": "vLLM",
    "llamacpp": "llama.cpp",
    "sglang": "SGLang",
    "ollama": "Ollama",
}
PREFIX = {"pagechat": "pagechat:", "vllm": "vllm:", "llamacpp": "llamacpp:", "sglang": "sglang:"}
VLLM_LIKE = ("vllm", "pagechat")  # the same families under their own prefix
# what reading a server's answer raises when it is not there or not what its kind sends
ANSWER_ERRORS = (httpx.HTTPError, ValueError, TypeError, AttributeError, KeyError)

# Figures a server cannot give, and why (shown in the panel in their place)
NOT_EXPOSED = {
    "vllm": {
        "blocks": "vLLM exposes the KV cache as one usage fraction, not which blocks each "
        "request holds or shares",
        "requests": "vLLM counts requests (running, waiting) but lists none of them",
        "sampling": "vLLM exposes no sampling candidates (a client sees its own with logprobs)",
    },
    "llamacpp": {
        "blocks": "llama.cpp keeps one contiguous context per slot, not blocks: context use is "
        "per slot (/slots)",
        "requests": "llama.cpp lists its slots (KV cache), not the requests waiting for one",
        "preemptions": "llama.cpp does not preempt: a request waits for a free slot (deferred)",
        "latency": "llama.cpp has no latency histograms: mean times per token from its counters",
        "spec_positions": "llama.cpp counts accepted drafts but not by draft position",
        "sampling": "llama.cpp exposes no sampling candidates (a client sees its own with n_probs)",
    },
    "sglang": {
        "blocks": "SGLang exposes its token pool's use as one fraction, not its radix tree",
        "requests": "SGLang counts requests (running, queued) but lists none of them",
        "sampling": "SGLang exposes no sampling candidates (a client sees its own with logprobs)",
    },
    "ollama": {
        "blocks": "Ollama has no metrics: it lists the models it holds (/api/ps), not their KV",
        "requests": "Ollama counts no requests",
        "latency": "Ollama has no latency histograms (each answer carries its own durations)",
        "spec_positions": "Ollama does no speculative decoding",
        "sampling": "Ollama exposes no sampling candidates",
    },
}
NOT_EXPOSED["pagechat"] = {  # read as a peer (the fleet view, the KV-events console)
    "blocks": "the full console (pagechat watch URL) shows which blocks each request holds",
    "requests": "the full console lists every client's requests",
    "sampling": "the full console shows each token's sampling candidates",
}


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram's cumulative buckets: (upper bound, count) ascending."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def since(self, old: Histogram | None) -> Histogram:
        """The observations made after `old` (the same buckets, counts subtracted)."""
        if old is None or [le for le, _ in old.buckets] != [le for le, _ in self.buckets]:
            return self
        if any(n < m for (_, n), (_, m) in zip(self.buckets, old.buckets)):
            return self  # counted from zero again: the server restarted
        return Histogram(tuple((le, n - m) for (le, n), (_, m) in zip(self.buckets, old.buckets)))

    @staticmethod
    def pooled(histograms: list[Histogram]) -> Histogram:
        """The histogram of every observation the given ones counted: counts added at the bounds
        all of them have (where their buckets differ, only the shared bounds are exact)."""
        present = [h for h in histograms if h.buckets]
        if not present:
            return Histogram(())
        bounds = set.intersection(*({le for le, _ in h.buckets} for h in present))
        return Histogram(
            tuple((le, sum(dict(h.buckets)[le] for h in present)) for le in sorted(bounds))
        )

    def quantile(self, q: float) -> float | None:
        """The q-quantile, linear within its bucket as Prometheus' histogram_quantile does."""
        n = self.count
        if n <= 0:
            return None
        rank, lower, below = q * n, 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if le == float("inf"):
                    return lower
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cum
        return lower


@dataclass(frozen=True, slots=True)
class Scrape:
    """One poll of a server: its metric samples by name (prefix removed; labels summed away except
    where kept), histograms, and llama.cpp's slots."""

    at: float
    values: dict[str, float]
    per_label: dict[str, dict[str, float]]  # name -> {label value: value} (spec positions)
    histograms: dict[str, Histogram]
    info: dict[str, str] = field(default_factory=dict)  # the labels of vLLM's *_info gauges
    slots: tuple[dict, ...] | None = None
    slots_why: str | None = None  # why there are no slots
    resident: tuple[dict, ...] = ()  # Ollama's /api/ps models

    @classmethod
    def parse(cls, kind: str, text: str, at: float, slots=None, slots_why=None) -> Scrape:
        prefix = PREFIX.get(kind, "-")  # Ollama: nothing to parse
        values: dict[str, float] = {}
        per_label: dict[str, dict[str, float]] = {}
        histograms: dict[str, Histogram] = {}
        info: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(prefix):
                continue
            name = family.name[len(prefix) :]
            if family.type == "histogram":
                histograms[name] = _histogram(family.samples)
                continue
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                if s.name.endswith("_info"):
                    info.update(s.labels)
                key = s.name[len(prefix) :]
                values[key] = values.get(key, 0.0) + s.value
                for label in ("position", "finished_reason"):
                    if label in s.labels:
                        by = per_label.setdefault(key, {})
                        by[s.labels[label]] = by.get(s.labels[label], 0.0) + s.value
        return cls(at, values, per_label, histograms, info, slots, slots_why)


def _histogram(samples) -> Histogram:
    """The buckets summed over label sets (several engines of one server)."""
    buckets: dict[float, float] = {}
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    return Histogram(tuple(sorted(buckets.items())))


@dataclass(frozen=True, slots=True)
class SlotUse:
    """One llama.cpp slot: its context size and the tokens of the request it holds."""

    id: int
    n_ctx: int
    busy: bool
    tokens: int  # the prompt plus what it has decoded, while it runs
    cached: int  # of the prompt, tokens reused from the slot's last request


def slot_uses(slots: tuple[dict, ...]) -> tuple[SlotUse, ...]:
    out = []
    for s in slots:
        busy = bool(s.get("is_processing"))
        decoded = sum(t.get("n_decoded", 0) for t in s.get("next_token", ()) if isinstance(t, dict))
        tokens = s.get("n_prompt_tokens", 0) + decoded if busy else 0
        cached = s.get("n_prompt_tokens_cache", 0) if busy else 0
        out.append(SlotUse(s.get("id", len(out)), s.get("n_ctx", 0), busy, tokens, cached))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Resident:
    """A model Ollama holds in memory (/api/ps): its name, bytes in all and in VRAM, when Ollama
    unloads it (ISO time), and the context it was loaded with."""

    name: str
    size: int
    size_vram: int
    expires_at: str
    context: int | None


def residents(models: tuple[dict, ...]) -> tuple[Resident, ...]:
    return tuple(
        Resident(
            str(m.get("name") or m.get("model", "?")),
            int(m.get("size") or 0),
            int(m.get("size_vram") or 0),
            str(m.get("expires_at", "")),
            m.get("context_length"),
        )
        for m in models
        if isinstance(m, dict)
    )


@dataclass(frozen=True, slots=True)
class Figures:
    """What the console shows after a poll; None where the server does not say."""

    kv_usage: float | None  # 0..1 of the KV cache in use
    running: float | None
    waiting: float | None
    preemptions: float | None  # since the server started
    prefix_hit: float | None  # hit tokens over queried tokens, since the server started
    gen_tok_s: float | None  # generated tokens a second since the last poll
    prompt_tok_s: float | None
    latency: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    spec_rate: float | None = None  # accepted over drafted tokens
    spec_positions: tuple[float, ...] = ()  # acceptance at each draft position
    slots: tuple[SlotUse, ...] = ()
    resident: tuple[Resident, ...] = ()


LATENCIES = {  # vLLM's (and SGLang's) histograms -> the console's name
    "time_to_first_token_seconds": "TTFT",
    "inter_token_latency_seconds": "ITL",
    "time_per_output_token_seconds": "ITL",  # SGLang before it had inter_token_latency
    "e2e_request_latency_seconds": "E2E",
    "request_queue_time_seconds": "queue",
}
FAILED = ("abort", "error")  # vLLM's finished_reason values of requests that did not end well


def windowed(new: Scrape, old: Scrape | None, name: str) -> Histogram | None:
    """A histogram's observations since the last poll, or all of them when none came since."""
    h = new.histograms.get(name)
    if h is None:
        return None
    recent = h.since(old.histograms.get(name) if old else None)
    return recent if recent.count else h


def latencies(new: Scrape, old: Scrape | None) -> dict[str, tuple[float | None, float | None]]:
    """p50 and p90 of each latency histogram the server has, over windowed()."""
    out = {}
    for name, label in LATENCIES.items():
        h = windowed(new, old, name)
        if h is not None and label not in out:
            out[label] = (h.quantile(0.5), h.quantile(0.9))
    return out


def _rate(new: Scrape, old: Scrape | None, name: str) -> float | None:
    if old is None or name not in new.values or new.at <= old.at:
        return None
    return max(0.0, new.values[name] - old.values.get(name, 0.0)) / (new.at - old.at)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(kind: str, new: Scrape, old: Scrape | None) -> Figures:
    """The console's figures from this poll and the one before (rates need both)."""
    v = new.values
    if kind == "ollama":
        return Figures(None, None, None, None, None, None, None, resident=residents(new.resident))
    if kind == "sglang":
        return Figures(
            v.get("token_usage"),
            v.get("num_running_reqs"),
            v.get("num_queue_reqs"),
            v.get("num_retractions_total"),  # SGLang's word for preemption
            v.get("cache_hit_rate"),
            _rate(new, old, "generation_tokens_total"),
            _rate(new, old, "prompt_tokens_total"),
            latencies(new, old),
            v.get("spec_accept_rate"),
        )
    if kind in VLLM_LIKE:
        drafts = v.get("spec_decode_num_drafts_total")
        per_pos = new.per_label.get("spec_decode_num_accepted_tokens_per_pos_total", {})
        positions = tuple(per_pos[k] / drafts for k in sorted(per_pos, key=int)) if drafts else ()
        return Figures(
            v.get("kv_cache_usage_perc"),
            v.get("num_requests_running"),
            v.get("num_requests_waiting"),
            v.get("num_preemptions_total"),
            _ratio(v.get("prefix_cache_hits_total"), v.get("prefix_cache_queries_total")),
            _rate(new, old, "generation_tokens_total"),
            _rate(new, old, "prompt_tokens_total"),
            latencies(new, old),
            _ratio(
                v.get("spec_decode_num_accepted_tokens_total"),
                v.get("spec_decode_num_draft_tokens_total"),
            ),
            positions,
        )
    slots = slot_uses(new.slots) if new.slots is not None else ()
    cached, computed = v.get("prompt_tokens_cached_total"), v.get("prompt_tokens_total")
    per_token = {
        "prompt token": _ratio(v.get("prompt_seconds_total"), computed),
        "decode token": _ratio(
            v.get("tokens_predicted_seconds_total"), v.get("tokens_predicted_total")
        ),
    }
    ctx = sum(s.n_ctx for s in slots)
    return Figures(
        sum(s.tokens for s in slots) / ctx if ctx else None,
        v.get("requests_processing"),
        v.get("requests_deferred"),
        None,
        _ratio(cached, (cached or 0) + (computed or 0)),
        _rate(new, old, "tokens_predicted_total"),
        _rate(new, old, "prompt_tokens_total"),
        {name: (mean, None) for name, mean in per_token.items()},
        _ratio(
            v.get("spec_decode_num_accepted_tokens_total"),
            v.get("spec_decode_num_draft_tokens_total"),
        ),
        (),
        slots,
    )


def scrape(http: httpx.Client, kind: str) -> Scrape:
    """Poll the server once (raises httpx.HTTPError when it does not answer)."""
    at = time.monotonic()
    if kind == "ollama":
        models = http.get("/api/ps").raise_for_status().json().get("models") or ()
        return Scrape(at, {}, {}, {}, resident=tuple(models))
    text = http.get("/metrics").raise_for_status().text
    slots, why = None, None
    if kind == "llamacpp":
        r = http.get("/slots")
        if r.status_code == 200:
            slots = tuple(r.json())
        else:
            why = f"/slots answered {r.status_code} (llama-server lists slots unless --no-slots)"
    return Scrape.parse(kind, text, at, slots, why)


def detect(url: str, api_key: str | None = None) -> tuple[str, str]:
    """(kind, model) of the server at url: Ollama answers /api/version (its /v1/models names no
    engine), the others' /v1/models says who owns the model (pagechat, vllm, llamacpp, sglang)."""
    url = server_url(url)
    try:
        r = httpx.get(f"{url}/api/version", headers=bearer(api_key), timeout=5.0)
        if r.status_code == 200 and set(r.json()) == {"version"}:
            models = httpx.get(f"{url}/api/ps", timeout=5.0).json().get("models") or ()
            return "ollama", ", ".join(m.get("name", "?") for m in models) or "no model loaded"
    except ANSWER_ERRORS:
        pass  # not Ollama: model_card says what else it is, or why it cannot tell
    card = model_card(url, api_key)
    kind = card.get("owned_by", "")
    if not isinstance(kind, str) or kind not in KINDS:
        raise PagechatError(
            f"{url} serves {card.get('id')!r} owned by {kind!r}; pagechat watches pagechat, vLLM, "
            "llama.cpp, SGLang and Ollama servers"
        )
    return kind, str(card.get("id"))
