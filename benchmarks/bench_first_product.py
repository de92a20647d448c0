"""A cuBLAS product's first call at a new shape: how long it holds the calling thread, on an idle
device and behind queued work, and whether a warm-up on another thread spares it (why the model
runner takes its LM head's product at every row count before serving).

    python benchmarks/bench_first_product.py [--hidden 1024] [--vocab 151936] [--rows 128]

Prints, for each phase, the calls whose host time passed 1 ms (rows, ms) and how many.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="the LM head's input width")
    p.add_argument("--vocab", type=int, default=151_936, help="its output width")
    p.add_argument("--rows", type=int, default=128, help="row counts a phase tries")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev, n = torch.device("cuda"), args.rows
    weight = torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(3 * n, args.hidden, device=dev, dtype=torch.bfloat16)
    square = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    F.linear(hidden[:1], weight), square @ square
    torch.cuda.synchronize()

    def phase(label: str, rows: range, queued: bool) -> None:
        slow = []
        for m in rows:
            if queued:  # ~25 ms of device work ahead of the product
                for _ in range(20):
                    square @ square
            start = time.perf_counter()
            F.linear(hidden[:m], weight)
            held = time.perf_counter() - start
            torch.cuda.synchronize()
            if held > 1e-3:
                slow.append((m, round(1e3 * held, 2)))
        print(f"{label}: {len(slow)} of {len(rows)} calls over 1 ms (rows, ms): {slow[:12]}")

    worker = threading.Thread(target=phase, args=("another thread, idle", range(1, n + 1), False))
    worker.start()
    worker.join()
    phase("this thread, the same rows, queued work", range(1, n + 1), True)
    phase("this thread, new rows, queued work", range(n + 1, 2 * n + 1), True)
    phase("this thread, new rows, idle", range(2 * n + 1, 3 * n + 1), False)


if __name__ == "__main__":
    main()
