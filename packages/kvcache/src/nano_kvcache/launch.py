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


# Relaunch's later launches straight to the compiled kernel's launcher. Off: each goes through
# Triton's dispatch (as measured in benchmarks/RESULTS.md, twenty-ninth session); the direct
# launch is checked by test_attention_gpu.py's test_a_step_s_launches_serve_every_layer but has
# not run on a GPU yet.
DIRECT = False


class Relaunch:
    """A Triton kernel launched many times with arguments that specialize it the same way (one
    step's attention, layer after layer: the same shapes, strides, dtypes and alignments; other
    tensors and scales). The first call goes through Triton's dispatch, which binds and
    specializes every argument and looks the compiled kernel up (~40 us of host time a launch
    on an H200's host, more than the kernel's own launcher); the later calls hand their
    arguments straight to that compiled kernel's launcher. The caller guarantees the same
    specialization (it compares what Triton specializes on). ``kwargs``: the kernel's
    constexprs, after every positional argument, and its launch options."""

    def __init__(self, fn, grid: tuple[int, ...], kwargs: dict) -> None:
        self.fn, self.grid, self.kwargs = fn, grid, kwargs
        self._direct = None

    def __call__(self, *args) -> None:
        direct = self._direct
        if direct is not None and direct(*args):
            return
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if direct is None and DIRECT:
            self._direct = _launcher(kernel, self.fn, self.grid, len(args), self.kwargs) or (
                lambda *_: False
            )


def _launcher(kernel, fn, grid, num_args: int, kwargs: dict):
    """A function that launches the compiled ``kernel`` as Triton's dispatch does and returns
    True (False where a launch hook, e.g. a profiler's, wants the dispatch); None where this
    Triton's compiled kernels do not offer what it needs."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver
    except ImportError:
        return None
    if kernel is None:  # (Triton's interpreter)
        return None
    if hasattr(kernel, "result"):  # (a compilation still under way)
        kernel = kernel.result()
    names = fn.arg_names[num_args:]
    if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")) or any(
        n not in kwargs for n in names
    ):
        return None
    constexprs = tuple(kwargs[n] for n in names)  # (the launcher takes and ignores them)
    g = (*grid, 1, 1)[:3]
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    stream, device = driver.active.get_current_stream, driver.active.get_current_device
    hooks = knobs.runtime

    def launch(*args) -> bool:
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            return False
        run(*g, stream(device()), function, metadata, None, None, None, *args, *constexprs)
        return True

    return launch


def _hooked(hook) -> bool:
    """Whether a launch hook is set (Triton's hooks are chains, empty when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))
