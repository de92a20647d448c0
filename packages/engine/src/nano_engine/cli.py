"""The nano-engine command: generate text, benchmark, serve, or profile for nano-sim.

nano-engine generate MODEL --prompt "Hello" [--max-tokens 64] [--temperature 0]
nano-engine bench MODEL --load-format dummy [--num-seqs 256] [--input-len 100 1024]
nano-engine serve MODEL [--port 8000]
nano-engine profile MODEL --load-format dummy --out profile.json   (then: nano-sim --profile)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
import typing
from dataclasses import MISSING, fields
from pathlib import Path

from nano_engine.config import EngineConfig


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One --option per EngineConfig field (model is positional)."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        hint = hints[f.name]
        if hint is bool or bool in typing.get_args(hint):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = next(
                (t for t in (int, float, str) if t in typing.get_args(hint) or t is hint), str
            )
            group.add_argument(flag, type=kind, default=default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model"}


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line options that give ``config`` (its model aside): the inverse of
    ``add_engine_options``, for an engine started in another process."""
    flags = []
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "model" or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sample-seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=None)
    group.add_argument("--ignore-eos", action="store_true")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="nano-engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts")
    gen.add_argument("model", help="checkpoint directory")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", type=Path, help="one prompt per line")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    sampling_options(gen)
    add_engine_options(gen)

    bench = commands.add_parser("bench", help="nano-vllm's throughput benchmark")
    bench.add_argument(
        "model", help="checkpoint directory, or a config.json with --load-format dummy"
    )
    bench.add_argument("--num-seqs", type=int, default=256)
    bench.add_argument(
        "--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX")
    )
    bench.add_argument(
        "--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX")
    )
    bench.add_argument("--bench-seed", type=int, default=0, help="seed of the workload")
    bench.add_argument(
        "--repeat", type=_positive, default=1, help="timed runs (the best is reported)"
    )
    bench.add_argument("--json", type=Path, help="write the results as JSON")
    bench.add_argument(
        "--step-log",
        type=Path,
        help="write every iteration of the loop (batch, host and device times) and every "
        "request of the (last) timed run as JSON lines",
    )
    add_engine_options(bench)

    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    srv.add_argument("model", help="checkpoint directory")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    srv.add_argument("--port", type=_port, default=8000, help="1-65535")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", help="the model's name in requests (default: MODEL)")
    srv.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413"
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="sequences queued or running (n each) beyond which new requests get 503",
    )
    srv.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run on after SIGTERM (then: 503, or a last error "
        "event in a stream)",
    )
    srv.add_argument(
        "--max-request-entries",
        type=_positive,
        default=1 << 20,
        help="the most prompts x n x max_tokens x (logprobs + 1) one request may ask for "
        "(400 beyond): bounds the memory one request holds",
    )
    srv.add_argument(
        "--read-timeout",
        type=_seconds,
        default=30.0,
        help="seconds to receive a request's headers, and then its body (408 beyond)",
    )
    srv.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    srv.add_argument(
        "--max-connections",
        type=_positive,
        default=1024,
        help="open connections beyond which new ones get 503 and are closed (the soft "
        "open-file limit is raised to the hard one at start)",
    )
    srv.add_argument(
        "--cpu-workers",
        type=_positive,
        default=2,
        help="threads that tokenize and build large responses off the event loop",
    )
    srv.add_argument(
        "--step-log",
        type=Path,
        help="write every iteration of the engine's loop and every request as JSON lines "
        "(every few seconds and at shutdown)",
    )
    add_engine_options(srv)

    prof = commands.add_parser(
        "profile",
        help="measure the engine for nano-sim: step times over a grid of batch shapes, the "
        "loop's host time offline and through the server",
    )
    prof.add_argument(
        "model", help="checkpoint directory, or a config.json with --load-format dummy"
    )
    prof.add_argument("--out", type=Path, required=True, help="the profile (JSON) to write")
    prof.add_argument(
        "--quick", action="store_true", help="a small grid and short workloads (CPU, tests)"
    )
    prof.add_argument(
        "--no-server",
        action="store_true",
        help="skip the measurements through the HTTP server (no nano-engine[serve])",
    )
    add_engine_options(prof)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        commands = {"generate": generate, "bench": bench, "serve": serve, "profile": profile}
        return commands[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nano-engine: error: {e}", file=sys.stderr)
        return 2


def generate(args: argparse.Namespace) -> int:
    from nano_engine import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give --prompt or --prompts-file")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"--- prompt: {prompt!r}")
        print(out.outputs[0].text)
    return 0


def bench_workload(
    seed: int, num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int]
) -> tuple[random.Random, list[list[int]], list[int]]:
    """nano-vllm's bench.py workload (the same draws from the same generator): random prompt
    ids and output lengths, uniform in the given ranges. Returns the generator for more draws."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 10_000) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)
    ]
    return rng, prompts, [rng.randint(*output_len) for _ in range(num_seqs)]


def bench(args: argparse.Namespace) -> int:
    from nano_engine import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    if kwargs["load_format"] == "dummy" and kwargs["tokenizer"] is None:
        kwargs["skip_tokenizer_init"] = True
    rng, prompts, max_tokens = bench_workload(
        args.bench_seed, args.num_seqs, args.input_len, args.output_len
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    with LLM(args.model, **kwargs) as llm:
        # Warm-up: prefill, mixed and decode steps of several sizes, so that nothing is
        # compiled (Triton, Inductor, cuBLAS heuristics) inside the timed runs.
        longest = max(8, min(300, llm.engine.max_model_len - 25))
        warm = [[rng.randint(0, 10_000) for _ in range(rng.randint(1, longest))] for _ in range(64)]
        vocab = llm.engine.model_config.vocab_size
        if vocab <= 10_000:  # (a small test model: the same draws, folded into its vocabulary)
            prompts, warm = ([[t % vocab for t in p] for p in ps] for ps in (prompts, warm))
        llm.generate(warm, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
        engine = llm.engine
        times, hits = [], []
        blocks = engine.scheduler.block_manager
        for _ in range(args.repeat):
            # Every run computes its prompts afresh, as the single run of nano-vllm's benchmark
            # does: nothing found in the prefix cache from the run before.
            llm.reset_prefix_cache()
            engine.stats.__init__()
            if args.step_log:
                engine.record_steps(args.step_log)
            start, hit = time.perf_counter(), blocks.hit_tokens
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            hits.append(blocks.hit_tokens - hit)
        elapsed = min(times)
        stats = engine.stats
        result = {
            "num_seqs": args.num_seqs,
            "input_tokens": sum(len(p) for p in prompts),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "seconds": elapsed,
            "seconds_each_run": times,
            "prefix_cache_hit_tokens_each_run": hits,
            "steps": stats.steps,
            "host_share": stats.host_share,
            "kv_blocks": engine.runner.num_blocks,
            "kv_tokens": engine.runner.num_blocks * engine.config.kvcache_block_size,
            "preemptions": engine.scheduler.num_preemptions,
            "attention_backend": engine.runner.backend.name,
            "cuda_graphs": engine.runner.graphs is not None,
            "async_scheduling": engine.async_scheduling,
            "device": str(engine.runner.device),
        }
        engine.stop_recording()
    result["output_tok_per_s"] = result["output_tokens"] / elapsed
    result["total_tok_per_s"] = (result["output_tokens"] + result["input_tokens"]) / elapsed
    print(
        f"Total: {result['output_tokens']} output tokens ({result['input_tokens']} input), "
        f"Time: {elapsed:.2f}s, Throughput: {result['output_tok_per_s']:,.2f} output tok/s, "
        f"{result['total_tok_per_s']:,.2f} total tok/s"
    )
    if len(times) > 1:
        print("runs: " + ", ".join(f"{t:.2f}s" for t in times))
    print(
        f"steps: {stats.steps}, host share of step time: {stats.host_share:.1%} (async "
        f"scheduling: {result['async_scheduling']}), KV capacity: "
        f"{result['kv_blocks']} blocks = {result['kv_tokens']:,} tokens, preemptions: "
        f"{result['preemptions']}, attention: {result['attention_backend']}, CUDA graphs: "
        f"{result['cuda_graphs']}, prefix cache hits: {max(hits)} tokens"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def serve(args: argparse.Namespace) -> int:
    from nano_engine.config import EngineConfig
    from nano_engine.engine import LLMEngine
    from nano_engine.server import serve as run_server

    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **engine_kwargs(args)))
    if args.step_log:  # (the server's event loop runs in this thread)
        engine.record_steps(args.step_log, watch=threading.main_thread())
    return run_server(
        engine,
        args.served_model_name or args.model,
        args.host,
        args.port,
        args.api_key,
        args.max_body_bytes,
        args.max_queue,
        args.grace_period,
        max_request_entries=args.max_request_entries,
        read_timeout=args.read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        cpu_workers=args.cpu_workers,
    )


def profile(args: argparse.Namespace) -> int:
    from nano_engine.profiler import profile_engine, report

    kwargs = engine_kwargs(args)
    if kwargs["load_format"] == "dummy" and kwargs["tokenizer"] is None:
        kwargs["skip_tokenizer_init"] = True
    if not args.no_server:
        try:
            import fastapi  # noqa: F401
            import httpx  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"profiling through the server needs nano-engine[serve] ({e.name} is missing); "
                "install it, or pass --no-server"
            ) from None
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    bars = Bars()
    result = profile_engine(config, quick=args.quick, server=not args.no_server, progress=bars)
    bars.close()
    result.save(args.out)
    print(report(result))
    print(f"profile written to {args.out}: nano-sim --profile {args.out} ...")
    return 0


class Bars:
    """One progress bar per phase of a long command."""

    def __init__(self) -> None:
        self.phase, self.bar = None, None

    def __call__(self, phase: str, done: int, total: int) -> None:
        from tqdm.auto import tqdm

        if phase != self.phase:
            self.close()
            self.phase, self.bar = phase, tqdm(total=total, desc=phase, dynamic_ncols=True)
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.phase, self.bar = None, None


if __name__ == "__main__":
    sys.exit(main())
