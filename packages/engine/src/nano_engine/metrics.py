"""Prometheus metrics of a server, in a registry of its own (two servers in one process do not
share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nano_engine.engine import LLMEngine
from nano_engine.outputs import RequestOutput

_LATENCY_BUCKETS = (
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


class _EngineState:
    """Read at scrape time from the engine: queues, KV usage, prefix-cache hits, preemptions."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.scheduler.stats()
        for name, doc, value in (
            ("nano_requests_running", "Sequences running in the engine.", stats.num_running),
            ("nano_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("nano_kv_cache_usage", "Fraction of KV blocks in use.", stats.kv_usage),
            (
                "nano_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache.",
                stats.prefix_hit_rate,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "nano_preemptions",
            "Sequences preempted (recomputed later).",
            value=stats.num_preemptions,
        )


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        self.prompt_tokens = Counter(
            "nano_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "nano_generation_tokens",
            "Tokens generated for finished requests.",
            registry=self.registry,
        )
        self.requests = Counter(
            "nano_requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "nano_time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "nano_inter_token_latency_seconds",
            "Mean time between output tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "nano_e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, output: RequestOutput) -> None:
        """A finished request (its whole output)."""
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        generated = sum(len(o.token_ids) for o in output.outputs)
        self.generation_tokens.inc(generated)
        for o in output.outputs:
            self.requests.labels(o.finish_reason or "abort").inc()
        if m.get("first_token_time"):
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            per_seq = generated / max(1, len(output.outputs))
            if per_seq > 1:
                self.itl.observe((m["last_token_time"] - m["first_token_time"]) / (per_seq - 1))
        self.e2e.observe(m["last_token_time"] - m["arrival_time"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
