"""What a simulation measured: per-request latencies, throughput, and the batch over time."""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nano_scheduler.sequence import Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """One request's life in seconds on one clock: sent (``arrival``), first scheduled, its
    first token and its end received. A client's records have no ``first_scheduled`` (None).
    Where known (the simulator's; a replay joined with the server's step log): when the engine
    had it (``accepted``: its loop takes it in at its next iteration) and when its loop
    published its first token (``first_published``): the way in and out, apart from the
    engine's own time. (nano-sim's engine has a request once its front has handled it, and
    publishes at the end of its loop's publish phase; the engine's step log stamps a request
    when its process makes it, and each output as it is published.)"""

    request: int  # index in the workload
    arrival: float
    first_scheduled: float | None
    first_token: float
    finish: float
    prompt_len: int
    output_len: int
    preemptions: int = 0
    finish_reason: str = "length"
    accepted: float | None = None
    first_published: float | None = None

    @classmethod
    def of(cls, seq: Sequence) -> RequestRecord:
        return cls(
            seq.seq_id,
            seq.arrival_time,
            seq.first_scheduled_time if seq.first_scheduled_time is not None else seq.finish_time,
            seq.first_token_time if seq.first_token_time is not None else seq.finish_time,
            seq.finish_time,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_preemptions,
            seq.finish_reason.value,
        )

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ingress(self) -> float | None:
        """From sent to the engine's having it."""
        return None if self.accepted is None else self.accepted - self.arrival

    @property
    def egress(self) -> float | None:
        """From the first token's publication to its receipt."""
        return None if self.first_published is None else self.first_token - self.first_published

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        if self.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "queueing": self.queueing,
            "ingress": self.ingress,
            "egress": self.egress,
        }


@dataclass
class Timeline:
    """One row per step: end time, sequences, batched tokens, KV usage, running, waiting."""

    time: array = field(default_factory=lambda: array("d"))
    batch_size: array = field(default_factory=lambda: array("l"))
    num_tokens: array = field(default_factory=lambda: array("l"))
    kv_usage: array = field(default_factory=lambda: array("d"))
    running: array = field(default_factory=lambda: array("l"))
    waiting: array = field(default_factory=lambda: array("l"))

    def record(
        self,
        time: float,
        batch_size: int,
        num_tokens: int,
        kv_usage: float,
        running: int,
        waiting: int,
    ) -> None:
        self.time.append(time)
        self.batch_size.append(batch_size)
        self.num_tokens.append(num_tokens)
        self.kv_usage.append(kv_usage)
        self.running.append(running)
        self.waiting.append(waiting)

    def record_run(
        self,
        times: list[float],
        kv_usage: list[float],
        batch_size: int,
        num_tokens: int,
        running: int,
        waiting: int,
    ) -> None:
        """Rows of steps alike but for their end times and KV usage (a run of decodes)."""
        n = len(times)
        self.time.extend(times)
        self.batch_size.extend([batch_size] * n)
        self.num_tokens.extend([num_tokens] * n)
        self.kv_usage.extend(kv_usage)
        self.running.extend([running] * n)
        self.waiting.extend([waiting] * n)

    def sampled(self, max_points: int = 2000) -> dict[str, list]:
        stride = max(1, math.ceil(len(self.time) / max_points))
        return {
            name: list(getattr(self, name)[::stride])
            for name in ("time", "batch_size", "num_tokens", "kv_usage", "running", "waiting")
        }


def percentiles(values, ps=PERCENTILES) -> dict[str, float]:
    """Linear-interpolated percentiles (NaN for no values)."""
    data = sorted(values)
    out = {}
    for p in ps:
        if not data:
            out[f"p{p}"] = math.nan
            continue
        rank = (len(data) - 1) * p / 100
        lo = math.floor(rank)
        hi = min(lo + 1, len(data) - 1)
        out[f"p{p}"] = data[lo] + (data[hi] - data[lo]) * (rank - lo)
    out["mean"] = sum(data) / len(data) if data else math.nan
    return out


def summarize(records: list[RequestRecord], itl) -> dict:
    """Throughput and latency percentiles of finished requests (``itl``: the gaps between a
    request's consecutive outputs, over all requests). The duration runs from the first
    arrival to the last finish. The same keys for the simulator and for a client's replay."""
    duration = max(r.finish for r in records) - min(r.arrival for r in records) if records else 0.0
    prompt = sum(r.prompt_len for r in records)
    output = sum(r.output_len for r in records)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    return {
        "requests": len(records),
        "duration_s": duration,
        "input_tokens": prompt,
        "output_tokens": output,
        "input_tok_per_s": rate(prompt),
        "output_tok_per_s": rate(output),
        "total_tok_per_s": rate(prompt + output),
        "ttft_s": percentiles(r.ttft for r in records),
        "tpot_s": percentiles(t for r in records if (t := r.tpot) is not None),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(r.e2e for r in records),
        "queueing_s": percentiles(q for r in records if (q := r.queueing) is not None),
        "ingress_s": percentiles(x for r in records if (x := r.ingress) is not None),
        "egress_s": percentiles(x for r in records if (x := r.egress) is not None),
    }


@dataclass
class SimResult:
    requests: list[RequestRecord]
    rejected: list[tuple[int, str]]
    itl: array
    timeline: Timeline
    num_steps: int
    num_preemptions: int
    prefix_hit_rate: float
    replicas: list[SimResult] | None = None  # a fleet's: each replica's own
    routed: list[int] | None = None  # a fleet's: the requests routed to each replica

    @property
    def duration(self) -> float:
        """From the first arrival to the last finish."""
        if not self.requests:
            return 0.0
        return max(r.finish for r in self.requests) - min(r.arrival for r in self.requests)

    def summary(self) -> dict:
        fleet = {} if self.routed is None else {"replicas": len(self.routed), "routed": self.routed}
        return {
            **summarize(self.requests, self.itl),
            **fleet,
            "rejected": len(self.rejected),
            "steps": self.num_steps,
            "preemptions": self.num_preemptions,
            "prefix_hit_rate": self.prefix_hit_rate,
            "kv_usage": {
                "mean": _mean(self.timeline.kv_usage),
                "max": max(self.timeline.kv_usage, default=0.0),
            },
            "batch_size": {
                "mean": _mean(self.timeline.batch_size),
                "max": max(self.timeline.batch_size, default=0),
            },
        }

    def to_json(self, path: str | Path) -> None:
        data = {
            "summary": self.summary(),
            "timeline": self.timeline.sampled(),
            "rejected": [{"request": i, "error": e} for i, e in self.rejected],
            "requests": [r.to_dict() for r in sorted(self.requests, key=lambda r: r.request)],
        }
        Path(path).write_text(json.dumps(nan_to_none(data), indent=2))  # (NaN is not JSON: null)

    def plot(self, path: str | Path) -> None:
        """Latency CDFs (TTFT, ITL, end to end) and KV usage and batch size over time."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise RuntimeError("plots need matplotlib: pip install nano-scheduler[plot]") from e
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        cdfs = (
            ("TTFT", [r.ttft for r in self.requests]),
            ("inter-token latency", self.itl),
            ("end-to-end latency", [r.e2e for r in self.requests]),
        )
        for ax, (name, values) in zip(axes.flat, cdfs):
            data = sorted(values)
            ax.plot(data, [(i + 1) / len(data) for i in range(len(data))])
            ax.set(title=f"{name} CDF", xlabel="seconds", ylabel="fraction")
            ax.grid(alpha=0.3)
        ax = axes.flat[3]
        tl = self.timeline.sampled()
        ax.plot(tl["time"], tl["kv_usage"], color="tab:blue", label="KV usage")
        ax.set(title="KV usage and batch size", xlabel="seconds", ylabel="KV usage")
        twin = ax.twinx()
        twin.plot(tl["time"], tl["batch_size"], color="tab:orange", alpha=0.7, label="batch size")
        twin.set_ylabel("batch size (sequences per step)")
        # (each axis's label in its line's colour: a legend covered the labels or the lines)
        ax.yaxis.label.set_color("tab:blue")
        twin.yaxis.label.set_color("tab:orange")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _mean(values) -> float:
    return sum(values) / len(values) if len(values) else 0.0


def format_summary(summary: dict) -> str:
    """A human-readable table of ``summarize`` (and of ``SimResult.summary()``'s extras)."""
    counts = [f"{summary['requests']} finished"]
    counts += [f"{summary[k]} {k}" for k in ("rejected", "failed") if k in summary]
    steps = f" in {summary['steps']} steps" if "steps" in summary else ""
    lines = [
        f"requests            {', '.join(counts)}",
        f"duration            {summary['duration_s']:.3f} s{steps}",
        f"throughput          {summary['input_tok_per_s']:,.0f} input tok/s, "
        f"{summary['output_tok_per_s']:,.0f} output tok/s, "
        f"{summary['total_tok_per_s']:,.0f} total tok/s",
        f"{'':20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, name in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("itl_s", "ITL"),
        ("e2e_s", "end to end"),
        ("queueing_s", "queueing"),
    ):
        row = summary[key]
        if all(math.isnan(row[k]) for k in ("mean", "p50", "p90", "p99")):
            continue
        lines.append(
            f"{name + ' (ms)':20}"
            + "".join(f"{row[k] * 1e3:10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    if "routed" in summary:
        lines.append(
            f"replicas            {summary['replicas']}, requests routed to each: "
            + ", ".join(str(n) for n in summary["routed"])
        )
    if "preemptions" in summary:
        lines.append(
            f"preemptions         {summary['preemptions']}; prefix-cache hit rate "
            f"{summary['prefix_hit_rate']:.1%}; KV usage mean {summary['kv_usage']['mean']:.1%}, "
            f"max {summary['kv_usage']['max']:.1%}; batch size mean "
            f"{summary['batch_size']['mean']:.1f}, max {summary['batch_size']['max']}"
        )
    return "\n".join(lines)


def nan_to_none(value):
    """A copy of a JSON-able value with NaN as None (NaN is not JSON)."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_to_none(v) for v in value]
    return value
