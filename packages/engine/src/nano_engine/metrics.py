"""Prometheus metrics of a server, with vLLM's names, types and labels (the dashboards,
autoscalers and gateways written for vLLM read them), in a registry of its own (two servers in
one process do not share counters)."""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

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


class _Engine(NamedTuple):
    """One engine's labelled series of the server's own metrics."""

    prompt_tokens: Counter
    generation_tokens: Counter
    requests: dict
    ttft: Histogram
    e2e: Histogram


class _EngineState:
    """Read at scrape time, per engine (each replica of a fleet): queues, KV usage,
    preemptions, prefix-cache queries and hits (in tokens), whether it serves; and the
    requests a fleet sent again after their replica stopped."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    # (name, type, help, the EngineStats field) of each engine's series
    SERIES = (
        ("vllm:num_requests_running", "gauge", "Sequences running in the engine.", "running"),
        ("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", "waiting"),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV blocks in use (1 = all).",
            "kv_usage",
        ),
        (
            "vllm:num_preemptions",
            "counter",
            "Sequences preempted (recomputed later).",
            "preemptions",
        ),
        (
            "vllm:prefix_cache_queries",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            "prefix_queries",
        ),
        (
            "vllm:prefix_cache_hits",
            "counter",
            "Prompt tokens found in the prefix cache.",
            "prefix_hits",
        ),
        (
            "nano_engine:engine_serving",
            "gauge",
            "Whether the engine (a data-parallel replica) serves: 1, or 0 once it stopped.",
            "serving",
        ),
    )

    def collect(self):
        replicas = self.engine.replica_stats()
        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        for name, kind, doc, field in self.SERIES:
            metric = kinds[kind](name, doc, labels=["model_name", "engine"])
            for i, stats in enumerate(replicas):
                metric.add_metric([self.model_name, str(i)], float(getattr(stats, field)))
            yield metric
        retries = CounterMetricFamily(
            "nano_engine:request_retries",
            "Requests sent to another replica after theirs stopped before streaming anything.",
            labels=["model_name"],
        )
        retries.add_metric([self.model_name], getattr(self.engine, "retries", 0))
        yield retries


class _Gaps:
    """vLLM's inter-token latency histogram, per engine. A request's gaps are all counted at
    its mean gap, so they are added at once (prometheus_client's Histogram takes one
    observation a call: a lock and a bucket search for every token of every request, on the
    server's event loop). Used from the event loop only."""

    NAME = "vllm:inter_token_latency_seconds"
    DOC = "Time between output tokens (each gap of a request counted at its mean)."

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._series: dict[int, tuple[list[int], list[float]]] = {}  # engine: (counts, [sum])
        self._bounds = [floatToGoString(b) for b in _LATENCY_BUCKETS] + ["+Inf"]

    def add(self, engine: int, gap: float = 0.0, count: int = 0) -> None:
        """``count`` gaps of ``gap`` seconds (none: the engine's series, at 0)."""
        counts, total = self._series.setdefault(engine, ([0] * len(self._bounds), [0.0]))
        if count:
            counts[bisect.bisect_left(_LATENCY_BUCKETS, gap)] += count
            total[0] += gap * count

    def collect(self):
        metric = HistogramMetricFamily(self.NAME, self.DOC, labels=["model_name", "engine"])
        for engine, (counts, total) in sorted(self._series.items()):
            cumulative = itertools.accumulate(counts)
            metric.add_metric(
                [self.model_name, str(engine)], list(zip(self._bounds, cumulative)), total[0]
            )
        yield metric


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine, model_name))
        self.model_name = model_name

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model_name", "engine", *labels], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name,
                doc,
                ["model_name", "engine"],
                buckets=_LATENCY_BUCKETS,
                registry=self.registry,
            )

        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter(
            "vllm:generation_tokens", "Tokens generated for finished requests."
        )
        self._requests = counter(
            "vllm:request_success",
            "Finished sequences by finish reason (abort: the client left, or shutdown).",
            "finished_reason",
        )
        self._ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self._gaps = _Gaps(model_name)
        self.registry.register(self._gaps)
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        self._engines: dict[int, _Engine] = {}
        for i in range(len(engine.replica_stats())):
            self.engine(i)  # (every engine's series from the start, at 0)

    def engine(self, index: int) -> _Engine:
        """The labelled children of engine ``index``'s series."""
        if index not in self._engines:
            labels = (self.model_name, str(index))
            self._engines[index] = _Engine(
                self._prompt_tokens.labels(*labels),
                self._generation_tokens.labels(*labels),
                {r: self._requests.labels(*labels, r) for r in FINISH_REASONS},
                self._ttft.labels(*labels),
                self._e2e.labels(*labels),
            )
            self._gaps.add(index)
        return self._engines[index]

    def observe(self, output: RequestOutput, engine: int = 0) -> None:
        """A finished request (its whole output), served by engine (replica) ``engine``."""
        e = self.engine(engine)
        m = output.metrics
        e.prompt_tokens.inc(len(output.prompt_token_ids))
        generated = sum(len(o.token_ids) for o in output.outputs)
        e.generation_tokens.inc(generated)
        for o in output.outputs:
            e.requests[o.finish_reason if o.finish_reason in e.requests else "abort"].inc()
        if m.get("first_token_time"):
            e.ttft.observe(m["first_token_time"] - m["arrival_time"])
            per_seq = generated // max(1, len(output.outputs))
            if per_seq > 1:
                gap = (m["last_token_time"] - m["first_token_time"]) / (per_seq - 1)
                self._gaps.add(engine, gap, per_seq - 1)
        e.e2e.observe(m["last_token_time"] - m["arrival_time"])

    def aborted(self, sequences: int, engine: int = 0) -> None:
        """Sequences that ended unfinished (their client left, or the server shut down)."""
        if sequences:
            self.engine(engine).requests["abort"].inc(sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
