"""Where a prefill or mixed step's time goes, on the GPU, eager and in piecewise CUDA graphs:
for one prompt chunk of each size, the host time to launch the forward (``runner.execute``
returning, the device idle before), the device time of the forward (CUDA events), and the same
launch while the device is still busy with a long kernel (does the host wait for the launch
queue?); then torch.profiler's CPU view of one step (top ops by self time, launches per step).

    python benchmarks/profile_eager.py [--tokens 64,512,2048,8192] [--decodes 0] [--model M]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from nano_engine import LLM
from nano_engine.model_runner import StepInput

ROOT = Path(__file__).resolve().parents[1]


def step_of(tokens: int, decodes: int, block_size: int, context: int = 512) -> StepInput:
    """One fresh prompt chunk of ``tokens`` tokens, then ``decodes`` decodes of ``context``."""
    blocks = -(-tokens // block_size)
    tables = [list(range(blocks))]
    ids, query_lens, seq_lens = [0] * tokens, [tokens], [tokens]
    per = -(-context // block_size)
    for i in range(decodes):
        tables.append(list(range(blocks + i * per, blocks + (i + 1) * per)))
        ids.append(0)
        query_lens.append(1)
        seq_lens.append(context)
    rows = [tokens - 1, *range(tokens, tokens + decodes)]
    return StepInput(ids, query_lens, seq_lens, tables, 1, rows)


def measure(runner, step: StepInput, repeat: int) -> dict[str, float]:
    launch, device, busy_launch = [], [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        t0 = time.perf_counter()
        start_ev.record()
        runner.execute(step)
        end_ev.record()
        launch.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        device.append(start_ev.elapsed_time(end_ev) / 1e3)
        torch.cuda._sleep(200_000_000)  # ~100 ms of a busy device ahead of the launch
        t0 = time.perf_counter()
        runner.execute(step)
        busy_launch.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return {
        "launch_ms": statistics.median(launch) * 1e3,
        "busy_launch_ms": statistics.median(busy_launch) * 1e3,
        "device_ms": statistics.median(device) * 1e3,
    }


def host_pieces(runner, step: StepInput, repeat: int = 200) -> None:
    """Host microseconds of the parts of a piecewise step (the device kept busy, so that no
    launch waits for it): a graph replay, an attention call, the step's input tensors."""
    pieces = runner.pieces
    t = len(step.input_ids)
    size = pieces.size_for(t)
    ctx = runner.tensors(step, None, size)[2]
    graph, (q, k, v), attn = pieces.graphs[size][1], pieces.outputs[size][1], pieces.attention[1]
    out = pieces.attn_out[:t]
    parts = {
        "one piece's graph.replay()": graph.replay,
        "one attention call (sliced q, k, v)": lambda: attn(q[:t], k[:t], v[:t], ctx, out=out),
        "runner.tensors (the step's inputs)": lambda: runner.tensors(step, None, size),
        "the whole runner.execute": lambda: runner.execute(step),
    }
    print(f"host us per call, {t} tokens in the graphs of {size}:")
    for name, fn in parts.items():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat if "whole" not in name else 10):
            torch.cuda._sleep(20_000_000)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        print(f"  {name:40} {statistics.median(times) * 1e6:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "benchmarks/configs/qwen3-0.6b.json"))
    parser.add_argument("--tokens", default="64,512,2048,8192")
    parser.add_argument("--decodes", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8704)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(int(t) for t in args.tokens.split(",")) + args.decodes,
    )
    runner = llm.engine.runner
    pieces = runner.pieces
    print(f"one fresh chunk + {args.decodes} decodes; median of {args.repeat}")
    print(f"{'tokens':>7} {'forward':>9} {'launch ms':>10} {'launch, busy ms':>16}", end="")
    print(f" {'device ms':>10}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        step = step_of(tokens, args.decodes, runner.block_size)
        for name, graphs in (("eager", None), ("piecewise", pieces)):
            runner.pieces = graphs
            r = measure(runner, step, args.repeat)
            print(
                f"{tokens:>7} {name:>9} {r['launch_ms']:>10.2f} {r['busy_launch_ms']:>16.2f} "
                f"{r['device_ms']:>10.2f}"
            )
    step = step_of(args.profile_tokens, args.decodes, runner.block_size)
    if pieces is not None:
        host_pieces(runner, step)
    runner.execute(step)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            runner.execute(step)
        torch.cuda.synchronize()
    print(f"torch.profiler, 3 steps of {args.profile_tokens} tokens:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    llm.shutdown()


if __name__ == "__main__":
    main()
