"""Time GPU work as a decode step runs it: captured once in a CUDA graph, then replayed (the
benchmarks' shared helper; run them from the repository root or anywhere: their directory is
on the import path)."""

from __future__ import annotations

import torch
from triton.testing import do_bench


def replayed_us(fn, warmup: int = 20, rep: int = 100) -> float:
    """Median microseconds of ``fn`` replayed in a CUDA graph (run once before the capture, so
    kernels are compiled and the allocator warm)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3
