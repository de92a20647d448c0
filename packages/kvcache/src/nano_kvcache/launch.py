"""Programmatic dependent launch (Hopper and later, NVIDIA), for the decode path's Triton
kernels.

A kernel launched this way may start while the kernel before it is finishing. It must wait
(``tl.extra.cuda.gdc_wait()``) before it reads anything that kernel wrote; it then lets the
next kernel start (``tl.extra.cuda.gdc_launch_dependents()``). Each kernel here waits, then
lets the next one start, so when a kernel starts, everything two kernels back is complete.
Before its wait a kernel reads only what the kernel before it cannot be writing (weights; each
kernel says what else). In a decode step of a few sequences, where each kernel lasts a few
microseconds, the launch and a kernel's first reads then overlap the end of the kernel before.
"""

from __future__ import annotations

import functools
import os

# Off: every kernel launches as any other (for measuring what it gives).
ENABLED = True


@functools.cache
def _capable(index: int | None) -> bool:
    import torch  # (this package's control plane imports without torch)

    # (not ROCm, whose capabilities read 9.x on MI300; not Triton's interpreter)
    return (
        torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(index)[0] >= 9
    )


def pdl(t) -> bool:
    """Whether kernels on tensor t's device launch with programmatic dependent launch."""
    return ENABLED and t.is_cuda and _capable(t.device.index)


def launch_options(on: bool) -> dict:
    """The Triton launch keyword for it (none when off: CPU interpreter included)."""
    return {"launch_pdl": True} if on else {}
