"""The step log's clocks: the garbage collector's time in an iteration."""

from __future__ import annotations

import gc
import time

from nano_engine.step_log import CollectorClock, Phases
from nano_scheduler.sim.profile import StepRecord


def test_an_iteration_records_the_garbage_collectors_seconds():
    collector = CollectorClock()
    collector.start()
    try:
        junk = [[i] for i in range(300_000)]  # (something for a full collection to walk)
        clock = Phases(synchronous=True, collector=collector)
        began = time.perf_counter()
        gc.collect()
        spent = time.perf_counter() - began
        record = StepRecord(t=0.0)
        clock.fill(record)
        assert 0.5 * spent <= record.gc <= spent
        # A later iteration counts only its own collections.
        later = StepRecord(t=0.0)
        Phases(synchronous=True, collector=collector).fill(later)
        assert later.gc < 0.1 * record.gc
        del junk
    finally:
        collector.stop()
    assert collector._callback not in gc.callbacks
    unrecorded = StepRecord(t=0.0)
    Phases(synchronous=True).fill(unrecorded)
    assert unrecorded.gc is None
    assert StepRecord.from_dict(record.to_dict(), "step").gc == record.gc
