"""A Triton kernel launched again and again with arguments that specialize it the same way (one
step's attention, layer after layer: the same shapes, strides, dtypes and alignments; other
tensors and scales).

Triton's dispatch binds and specializes every argument and looks the compiled kernel up on each
launch: ~40 us of host time on an H200's host for the paged prefill kernel, more than its
compiled launcher's ~26 us (benchmarks/RESULTS.md). ``Relaunch`` goes through the dispatch for
its first launch; with ``DIRECT`` its later launches hand their arguments straight to the
compiled kernel's launcher, as the dispatch would (NVIDIA only: ROCm's Triton also specializes
on each tensor's size).
"""

from __future__ import annotations

# On: a step's later launches go straight to the compiled kernel (False: every launch through
# Triton's dispatch). Checked by test_attention_gpu.py's test_a_step_s_launches_serve_every_layer
# both ways (outputs bit for bit, in CUDA graphs too, and which launches were dispatched).
DIRECT = True
# The Triton versions whose compiled launcher takes the arguments as ``_launcher`` passes them
# (checked by that test on an H200); any other goes through the dispatch.
TESTED_TRITON = ("3.6.",)


class Relaunch:
    """Launches of ``fn`` on ``grid``; ``kwargs``: its constexprs (after every positional
    argument) and launch options. The caller guarantees that every launch's arguments
    specialize the kernel as the first's did."""

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


def _launcher(kernel, fn, grid: tuple[int, ...], num_args: int, kwargs: dict):
    """A function that launches the compiled ``kernel`` as Triton's dispatch does and returns
    True (False where a launch hook, e.g. a profiler's, wants the dispatch); None where the
    compiled kernel does not offer what it needs (Triton's interpreter, another version, ROCm)."""
    try:
        import torch
        import triton
        from triton import knobs
        from triton.runtime.driver import driver
    except ImportError:
        return None
    if kernel is None or torch.version.hip is not None:
        return None
    if not triton.__version__.startswith(TESTED_TRITON):  # (the launcher's arguments may differ)
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
    """Whether a launch hook is set (Triton 3.6's hooks are chains, empty when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))
