"""How a serving process sets up the interpreter: the server's, and an engine's own process
behind it."""

from __future__ import annotations

import gc
import sys

# The step loop releases the interpreter lock around every torch call and must win it back
# from whichever thread took it meanwhile; CPython hands it over after the switch interval
# (5 ms by default), which would then stall the loop for a whole interval.
SWITCH_INTERVAL = 0.0005
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # (the command line's, every process)
FULL_COLLECTION_THRESHOLD = 1000  # middle-generation collections before a full one (default 10)


def tune_for_serving() -> None:
    """A short switch interval, and full collections far apart: a full run of the cyclic
    collector walks every live object (~100 per open request) and stalls every thread; at the
    default thresholds one ran every ~3 s under load, 20-140 ms each on an H200 host (the ITL
    p99). Young collections stay as they are; a full one now waits for 100 times as many of
    them (minutes under load; cycles are rare here)."""
    sys.setswitchinterval(SWITCH_INTERVAL)
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_THRESHOLD)
