"""Where one decode step's time goes, at nano-vllm benchmark scale (Qwen3-0.6B config unless
--model names another, dummy weights, 256 sequences of a given context), on the GPU:

  host   StepInput.of + the runner's input tensors
  graph  the CUDA graph replay: inputs unpacked, the model, the LM head, the fused draw
  sample the sampler outside the graph (temperature 0.6, as in the benchmark)
and the same decode step's model under torch.profiler (top kernels).

    python benchmarks/profile_step.py [--context 512] [--batch 256] [--model CONFIG]
        [--quantization fp8] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nano_engine import LLM, SamplingParams
from nano_engine.model_runner import StepInput
from nano_scheduler import Sequence

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default=str(ROOT / "benchmarks" / "configs" / "qwen3-0.6b.json"))
    parser.add_argument("--kernels", type=int, default=15, help="rows of the kernel table")
    parser.add_argument("-q", "--quantization", help="fp8: FP8 weights")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.engine
    runner, sampler = engine.runner, engine.sampler
    blocks = -(-args.context // 16)
    seqs = []
    for i in range(args.batch):
        seq = Sequence(i, [1] * args.context, SamplingParams(temperature=0.6, max_tokens=10))
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
        seq.num_computed_tokens = args.context - 1
        seqs.append(seq)

    class Decodes:  # the part of a SchedulerOutput that StepInput.of reads
        prefills, decodes = [], seqs

    step = StepInput.of(Decodes)
    graph_size = next(s for s in runner.graphs.sizes if s >= args.batch)
    graph = runner.graphs.graphs[graph_size][0]
    fused = sampler.fused_rows(seqs)
    logits, _ = runner.graphs.run(step)
    batch = sampler.prepare(seqs)
    rows = {
        "host: StepInput.of": timed(lambda: StepInput.of(Decodes)),
        "host+copy: runner.tensors (eager inputs)": timed(lambda: runner.tensors(step)),
        "graph replay (inputs, model, LM head, draw)": timed(graph.replay),
        "graphs.run (staging + replay)": timed(lambda: runner.graphs.run(step, None, fused)),
        "sampler.fused_rows": timed(lambda: sampler.fused_rows(seqs)),
        "sampler.prepare": timed(lambda: sampler.prepare(seqs)),
        "sampler (outside the graph)": timed(lambda: sampler(logits, batch)),
        "runner.execute, fused draw in the graph": timed(
            lambda: sampler.drawn(runner.execute(step, None, fused).tokens).result()
        ),
    }
    kv_bytes = args.batch * args.context * runner.layout.bytes_per_block / 16
    print(
        f"decode step, batch {args.batch}, context {args.context}: KV {kv_bytes / 1e9:.2f} GB "
        f"(at 4.3 TB/s {kv_bytes / 4.3e12 * 1e3:.2f} ms)"
    )
    for name, value in rows.items():
        print(f"  {name:42} {value:8.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.execute(step, None, fused)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.kernels))
    llm.shutdown()


if __name__ == "__main__":
    main()
