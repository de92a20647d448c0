"""Prometheus metrics of a server, with vLLM's names, types and labels (the dashboards,
autoscalers and gateways written for vLLM read them), in a registry of its own (two servers in
one process do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nano_engine.engine import LLMEngine
from nano_engine.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

FINISH_REASONS = ("stop", "length", "abort")


class _EngineState:
    """Read at scrape time from the engine: queues, KV usage, preemptions, prefix-cache
    queries and hits (in tokens)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine, self.labels = engine, [model_name]

    def collect(self):
        stats = self.engine.scheduler.stats()
        blocks = self.engine.scheduler.block_manager
        for name, doc, value in (
            ("vllm:num_requests_running", "Sequences running in the engine.", stats.num_running),
            ("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = all).", stats.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(self.labels, value)
            yield gauge
        for name, doc, value in (
            (
                "vllm:num_preemptions",
                "Sequences preempted (recomputed later).",
                stats.num_preemptions,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                blocks.hit_tokens + blocks.miss_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                blocks.hit_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self.labels, value)
            yield counter


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine, model_name))

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model_name", *labels], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry
            )

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Tokens generated for finished requests."
        )
        requests = counter(
            "vllm:request_success",
            "Finished sequences by finish reason (abort: the client left, or shutdown).",
            "finished_reason",
        )
        self.requests = {r: requests.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens (each gap of a request counted at its mean).",
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        for name in ("prompt_tokens", "generation_tokens", "ttft", "itl", "e2e"):
            setattr(self, name, getattr(self, name).labels(model_name))

    def observe(self, output: RequestOutput) -> None:
        """A finished request (its whole output)."""
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        generated = sum(len(o.token_ids) for o in output.outputs)
        self.generation_tokens.inc(generated)
        for o in output.outputs:
            self.requests[o.finish_reason if o.finish_reason in self.requests else "abort"].inc()
        if m.get("first_token_time"):
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            per_seq = generated // max(1, len(output.outputs))
            if per_seq > 1:
                gap = (m["last_token_time"] - m["first_token_time"]) / (per_seq - 1)
                for _ in range(per_seq - 1):
                    self.itl.observe(gap)
        self.e2e.observe(m["last_token_time"] - m["arrival_time"])

    def aborted(self, sequences: int) -> None:
        """Sequences that ended unfinished (their client left, or the server shut down)."""
        if sequences:
            self.requests["abort"].inc(sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
