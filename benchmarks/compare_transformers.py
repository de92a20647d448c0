"""nano-engine against transformers' own continuous batching, on nano-vllm's benchmark.

For each model config (dummy / random weights): `nano-engine bench` (its best of --repeat
timed runs after a warm-up), then transformers' ContinuousBatchingManager (`paged|sdpa`, block
sharing off, eos ignored, temperature 0.6 with top_k=0 and top_p=1, each request's own
max_new_tokens) on the very same prompts and output lengths, after a warm-up of its own. Each
engine runs in its own process, so each has the whole GPU. Prints a table; --json writes it.

    python benchmarks/compare_transformers.py benchmarks/configs/qwen3-0.6b.json \\
        benchmarks/configs/qwen3-8b.json --json compare.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_ours(args: argparse.Namespace, config: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ours.json"
        command = [
            sys.executable,
            "-m",
            "nano_engine.cli",
            "bench",
            str(config),
            "--load-format=dummy",
            f"--num-seqs={args.num_seqs}",
            "--input-len",
            *map(str, args.input_len),
            "--output-len",
            *map(str, args.output_len),
            f"--max-model-len={args.max_model_len}",
            f"--repeat={args.repeat}",
            f"--json={out}",
            f"--device={args.device}",
        ]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def run_transformers(args: argparse.Namespace, config: Path) -> dict:
    """In a child process of this script (``--transformers-only``), for a GPU of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "transformers.json"
        command = [sys.executable, __file__, str(config), "--transformers-only", f"--json={out}"]
        command += [f"--num-seqs={args.num_seqs}", f"--attn={args.attn}", f"--device={args.device}"]
        command += ["--input-len", *map(str, args.input_len)]
        command += ["--output-len", *map(str, args.output_len)]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def transformers_bench(args: argparse.Namespace, config_path: Path) -> dict:
    import dataclasses

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from nano_engine.cli import bench_workload

    rng, prompts, max_tokens = bench_workload(
        args.bench_seed, args.num_seqs, tuple(args.input_len), tuple(args.output_len)
    )
    config = AutoConfig.for_model(**json.loads(config_path.read_text()))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=args.attn
        )
    model.eval()
    generation = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(max_tokens),
        eos_token_id=-1,  # never stops early: every request produces its max_new_tokens
        pad_token_id=0,
    )
    wanted = {"allow_block_sharing": False}
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    batching = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    manager = model.init_continuous_batching(
        generation_config=generation, continuous_batching_config=batching
    )
    manager.start()
    try:

        def run(inputs: list[list[int]], lengths: list[int]) -> tuple[float, int]:
            start = time.perf_counter()
            ids = [
                manager.add_request(p, request_id=f"r{i}-{start}", max_new_tokens=n)
                for i, (p, n) in enumerate(zip(inputs, lengths))
            ]
            tokens, pending = 0, set(ids)
            while pending:
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("transformers' manager stopped before finishing")
                if result.request_id in pending and result.is_finished():
                    pending.discard(result.request_id)
                    tokens += len(result.generated_tokens)
            return time.perf_counter() - start, tokens

        warm = [[rng.randint(0, 10_000) for _ in range(rng.randint(1, 300))] for _ in range(64)]
        run(warm, [24] * len(warm))
        seconds, tokens = run(prompts, max_tokens)
    finally:
        manager.stop(block=True)
    if tokens != sum(max_tokens):
        raise RuntimeError(f"transformers generated {tokens} tokens, {sum(max_tokens)} asked for")
    return {
        "engine": f"transformers {transformers.__version__} ({args.attn})",
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", type=Path, help="model config.json files")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2, help="nano-engine's timed runs")
    parser.add_argument("--attn", default="paged|sdpa", help="transformers' attention")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--transformers-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_only:
        result = transformers_bench(args, args.configs[0])
        args.json.write_text(json.dumps(result))
        return
    rows = []
    for config in args.configs:
        ours = run_ours(args, config)
        theirs = run_transformers(args, config)
        rows.append(
            {
                "model": config.stem,
                "nano_engine": ours,
                "transformers": theirs,
                "ratio": ours["output_tok_per_s"] / theirs["output_tok_per_s"],
            }
        )
    print(f"\n{'model':14}{'engine':38}{'seconds':>9}{'output tok/s':>14}{'ratio':>8}")
    for row in rows:
        ours, theirs = row["nano_engine"], row["transformers"]
        print(
            f"{row['model']:14}{'nano-engine':38}{ours['seconds']:9.2f}"
            f"{ours['output_tok_per_s']:14,.0f}{row['ratio']:7.1f}x"
        )
        print(
            f"{'':14}{theirs['engine']:38}{theirs['seconds']:9.2f}"
            f"{theirs['output_tok_per_s']:14,.0f}{1:7.1f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
