"""CPU time of the block manager's bookkeeping.

1. One decode step of 256 running sequences: append a token, can_append, may_append for each
   (a new block every block_size steps, a commit when a block fills). Target <= 100 us.
2. can_allocate + allocate of 256 prompts of 1,000 tokens (no shared prefix, then one shared
   by all).

    python benchmarks/bench_block_manager.py [--seqs 256] [--prompt 1000] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from nano_kvcache import BlockManager


class Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.block_table: list[int] = []
        self.num_cached_tokens = 0


def decode_step_us(num_seqs: int, prompt: int, block_size: int, steps: int) -> list[float]:
    rng = random.Random(0)
    bm = BlockManager(
        num_blocks=num_seqs * (prompt + steps) // block_size + num_seqs, block_size=block_size
    )
    seqs = [
        Seq([rng.randrange(32000) for _ in range(rng.randint(100, prompt))])
        for _ in range(num_seqs)
    ]
    for seq in seqs:
        bm.allocate(seq)
        bm.commit(seq, len(seq.token_ids))
    times = []
    can_append, may_append = bm.can_append, bm.may_append
    for step in range(steps):
        start = time.perf_counter()
        for seq in seqs:
            seq.token_ids.append(step)
            if can_append(seq):
                may_append(seq)
        times.append((time.perf_counter() - start) * 1e6)
    return times


def allocate_ms(num_seqs: int, prompt: int, block_size: int, shared: bool) -> float:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=num_seqs * prompt // block_size + num_seqs, block_size=block_size)
    common = [rng.randrange(32000) for _ in range(prompt - 100)]
    seqs = [
        Seq(
            (common if shared else [])
            + [rng.randrange(32000) for _ in range(100 if shared else prompt)]
        )
        for _ in range(num_seqs)
    ]
    start = time.perf_counter()
    for seq in seqs:
        if bm.can_allocate(seq):
            bm.allocate(seq)
            bm.commit(seq, len(seq.token_ids))
    elapsed = (time.perf_counter() - start) * 1e3
    assert all(seq.block_table for seq in seqs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    times = decode_step_us(args.seqs, args.prompt, args.block_size, args.steps)
    cold = min(allocate_ms(args.seqs, args.prompt, args.block_size, False) for _ in range(3))
    warm = min(allocate_ms(args.seqs, args.prompt, args.block_size, True) for _ in range(3))
    print(f"block manager, {args.seqs} sequences, block size {args.block_size}")
    print(
        f"  decode step bookkeeping: median {statistics.median(times):7.1f} us, "
        f"p90 {statistics.quantiles(times, n=10)[-1]:7.1f} us  (target <= 100 us)"
    )
    print(
        f"  allocate {args.seqs} x {args.prompt}-token prompts: {cold:7.1f} ms cold, "
        f"{warm:7.1f} ms with a shared {args.prompt - 100}-token prefix"
    )


if __name__ == "__main__":
    main()
