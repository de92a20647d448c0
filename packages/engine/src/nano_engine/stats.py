"""The loop's statistics: where its time goes (``StepStats``) and the periodic INFO line a
serving engine logs (``StatsLog``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from nano_scheduler import Scheduler

log = logging.getLogger("nano_engine")


class EngineStats(NamedTuple):
    """An engine's state as /metrics shows it (one per replica of a fleet)."""

    serving: bool
    running: int  # sequences
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # and found there

    @classmethod
    def of(cls, scheduler: Scheduler, serving: bool) -> EngineStats:
        stats, blocks = scheduler.stats(), scheduler.block_manager
        return cls(
            serving,
            stats.num_running,
            stats.num_waiting,
            stats.kv_usage,
            stats.num_preemptions,
            blocks.hit_tokens + blocks.miss_tokens,
            blocks.hit_tokens,
        )


@dataclass
class StepStats:
    """Where the loop's time goes: its own work (schedule, inputs, update, detokenize, publish)
    against waiting for sampled tokens. With async scheduling the two overlap the device's work,
    so the host share is how busy the loop is, not how long the device waits."""

    steps: int = 0
    host_seconds: float = 0.0
    device_seconds: float = 0.0
    tokens: int = 0

    def record(self, host: float, device: float, tokens: int) -> None:
        self.steps += 1
        self.host_seconds += host
        self.device_seconds += device
        self.tokens += tokens

    @property
    def host_share(self) -> float:
        total = self.host_seconds + self.device_seconds
        return self.host_seconds / total if total else 0.0


class StatsLog:
    """One INFO line every ``interval`` seconds while the engine works (as vLLM logs): prompt
    and generation throughput, step time and its host share, queues, KV usage, and the
    preemptions of the interval."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.preemptions = 0
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.start, self.steps, self.prompt, self.generated = now, 0, 0, 0
        self.host = self.device = 0.0

    def record(self, out, host: float, device: float, scheduler: Scheduler) -> None:
        now = time.monotonic()
        if self.steps == 0 and now - self.start > self.interval + host + device:
            self.start = now - host - device  # the first step after an idle time: start here
        self.steps += 1
        self.prompt += sum(c.num_tokens for c in out.prefills)
        self.generated += len(out.sampling_seqs)
        self.host += host
        self.device += device
        if now - self.start < self.interval:
            return
        if log.isEnabledFor(logging.INFO):
            s, seconds = scheduler.stats(), now - self.start
            log.info(
                "prompt %.0f tok/s, generation %.0f tok/s, %.1f steps/s of %.2f ms "
                "(host %.0f%%), running %d, waiting %d, KV cache %.1f%%, preemptions %d",
                self.prompt / seconds,
                self.generated / seconds,
                self.steps / seconds,
                (self.host + self.device) / self.steps * 1e3,
                100 * self.host / (self.host + self.device),
                s.num_running,
                s.num_waiting,
                100 * s.kv_usage,
                s.num_preemptions - self.preemptions,
            )
            self.preemptions = s.num_preemptions
        self._reset(now)
