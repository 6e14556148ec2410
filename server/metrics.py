"""Prometheus metrics under `pagechat:` names that mean what vLLM's `vllm:` ones do, so a vLLM
dashboard ports by renaming the prefix. Counters and gauges come from each StepReport, request
latencies from the engine loop's timings; all labelled with the served model's name."""

from __future__ import annotations

from pagechat.core.report import StepReport
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

P = "pagechat:"
disable_created_metrics()  # no *_created series, as vLLM: dashboards read the counts alone
# Finer at the short end than vLLM's: on a CPU a small model's steps take milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0)
REQUEST_BUCKETS += (30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metric families in a registry of their own."""

    def __init__(self, model_name: str, num_blocks: int) -> None:
        self.registry = CollectorRegistry()
        self.num_blocks = num_blocks
        self._label = {"model_name": model_name}
        self._queried = self._hit = 0  # the pool's cumulative prefix-cache counters, last seen
        g, c, h = self._gauge, self._counter, self._histogram
        self.running = g("num_requests_running", "Sequences in the running batch.")
        self.waiting = g("num_requests_waiting", "Sequences waiting (new or preempted).")
        self.swapped = g("num_requests_swapped", "Sequences preempted by swapping to host memory.")
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).")
        self.queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = c("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests (cached included).")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.drafts = c("spec_decode_num_drafts", "Speculative drafts verified.")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.accepted = c("spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        self.accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, per position in the draft.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.success = Counter(
            P + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between outputs.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.observe_load(0, 0, 0, 0)  # an idle server says 0, as vLLM does, not nothing

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(P + name, doc, ["model_name"], registry=self.registry)

    def _counter(self, name: str, doc: str) -> Counter:
        metric = Counter(P + name, doc, ["model_name"], registry=self.registry)
        metric.labels(**self._label)  # shown at 0 from the start
        return metric

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(P + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def text(self) -> bytes:
        """The Prometheus text exposition of every family."""
        return generate_latest(self.registry)

    # -- called from the engine's thread ---------------------------------------------------------
    def observe_load(self, running: int, waiting: int, swapped: int, used_blocks: int) -> None:
        """The gauges: after each step, and after aborts (which free blocks between steps)."""
        lab = self._label
        self.running.labels(**lab).set(running)
        self.waiting.labels(**lab).set(waiting)
        self.swapped.labels(**lab).set(swapped)
        self.kv_usage.labels(**lab).set(used_blocks / self.num_blocks if self.num_blocks else 0)

    def observe_step(self, report: StepReport) -> None:
        """The counters after one engine step."""
        lab = self._label
        snap = report.blocks
        self.queries.labels(**lab).inc(max(snap.prefix_queried_tokens - self._queried, 0))
        self.hits.labels(**lab).inc(max(snap.prefix_hit_tokens - self._hit, 0))
        self._queried, self._hit = snap.prefix_queried_tokens, snap.prefix_hit_tokens
        self.preemptions.labels(**lab).inc(len(report.preempted))
        self.generation_tokens.labels(**lab).inc(sum(len(o.token_ids) for o in report.outputs))
        for draft in report.drafts:
            if draft.drafted:
                self._observe_draft(len(draft.drafted), draft.accepted)

    def _observe_draft(self, drafted: int, accepted: int) -> None:
        self.drafts.labels(**self._label).inc()
        self.draft_tokens.labels(**self._label).inc(drafted)
        self.accepted.labels(**self._label).inc(accepted)
        for pos in range(drafted):
            self.accepted_per_pos.labels(position=str(pos), **self._label).inc(int(pos < accepted))

    def observe_scheduled(self, waited: float) -> None:
        self.queue.labels(**self._label).observe(waited)

    def observe_first_token(self, ttft: float, prompt_tokens: int) -> None:
        self.ttft.labels(**self._label).observe(ttft)
        self.prompt_tokens.labels(**self._label).inc(prompt_tokens)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(**self._label).observe(seconds)

    def observe_finished(self, reason: str, e2e: float) -> None:
        self.success.labels(finished_reason=reason, **self._label).inc()
        self.e2e.labels(**self._label).observe(e2e)
