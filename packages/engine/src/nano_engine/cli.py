"""The nano-engine command: generate text, benchmark, check a quantization's accuracy, serve, or
profile for nano-sim.

nano-engine generate MODEL --prompt "Hello" [--max-tokens 64] [--temperature 0]
nano-engine bench MODEL --load-format dummy [--num-seqs 256] [--input-len 100 1024]
nano-engine accuracy MODEL --kv-cache-dtype fp8   (against the same engine without it)
nano-engine serve MODEL [--port 8000]
nano-engine profile MODEL --load-format dummy --out profile.json   (then: nano-sim --profile)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import threading
import time
from pathlib import Path

from nano_engine._version import __version__
from nano_engine.config import (
    EngineConfig,
)
from nano_engine.interpreter import LOG_FORMAT
from nano_engine.options import (
    ENGINE_OPTIONS,
    HelpFormatter,
    add_common_options,
    add_engine_options,
    engine_kwargs,
    grace,
    length_range,
    port,
    positive,
    sampling_options,
    seconds,
)
from nano_engine.tool_calls import FORMATS as TOOL_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nano-engine", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    add_common_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", required=True, title="commands")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        add_common_options(sub)
        return sub

    gen = command("generate", "complete prompts")
    gen.add_argument("model", help="checkpoint directory or Hugging Face hub id (ORG/NAME)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", type=Path, help="a file of prompts, one per line")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    sampling_options(gen)
    add_engine_options(gen)

    bench = command("bench", "nano-vllm's throughput benchmark")
    bench.add_argument(
        "model",
        help="checkpoint directory or Hugging Face hub id (ORG/NAME), or a config.json with "
        "--load-format dummy",
    )
    bench.add_argument("--num-seqs", type=positive, default=256, help="requests in the workload")
    length_range(bench, "--input-len", (100, 1024), "prompt lengths")
    length_range(bench, "--output-len", (100, 1024), "output lengths")
    bench.add_argument("--bench-seed", type=int, default=0, help="seed of the workload")
    bench.add_argument(
        "--repeat", type=positive, default=1, help="timed runs (the best is reported)"
    )
    bench.add_argument("--json", type=Path, help="write the results as JSON")
    bench.add_argument(
        "--step-log",
        type=Path,
        help="write every iteration of the loop (batch, host and device times) and every "
        "request of the (last) timed run as JSON lines",
    )
    add_engine_options(bench)

    acc = command(
        "accuracy",
        "how close a quantized engine (--kv-cache-dtype fp8, --quantization fp8, an FP8 "
        "checkpoint) stays to the unquantized one",
    )
    acc.add_argument(
        "model",
        help="checkpoint directory or Hugging Face hub id (ORG/NAME), or a config.json with "
        "--load-format dummy",
    )
    acc.add_argument("--prompts-file", type=Path, help="text prompts, one per line")
    acc.add_argument(
        "--num-prompts", type=positive, default=32, help="random prompts (without a file)"
    )
    length_range(acc, "--input-len", (32, 512), "random prompts' lengths")
    acc.add_argument(
        "--reference",
        help="the reference's checkpoint (default: the model itself, unquantized; an FP8 "
        "checkpoint needs its bf16 one here)",
    )
    acc.add_argument("--max-tokens", type=positive, default=64, help="greedy tokens a prompt")
    acc.add_argument("--top-k", type=positive, default=5, help="the top-k each token must be in")
    acc.add_argument("--prompt-seed", type=int, default=0, help="the random prompts' seed")
    acc.add_argument("--json", type=Path, help="write the comparison as JSON")
    add_engine_options(acc)

    srv = command("serve", "an OpenAI-compatible HTTP server")
    srv.add_argument("model", help="checkpoint directory or Hugging Face hub id (ORG/NAME)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind")
    srv.add_argument("--port", type=port, default=8000, help="port to bind, 1-65535")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument(
        "--served-model-name", help="the model's name in requests (default: MODEL as given)"
    )
    srv.add_argument(
        "--max-body-bytes", type=positive, default=1 << 20, help="larger request bodies get 413"
    )
    srv.add_argument(
        "--max-queue",
        type=positive,
        default=1024,
        help="sequences queued or running (n each) beyond which new requests get 503",
    )
    srv.add_argument(
        "--grace-period",
        type=grace,
        default=30.0,
        help="seconds in-flight requests may run on after SIGTERM (then: 503, or a last error "
        "event in a stream)",
    )
    srv.add_argument(
        "--max-request-entries",
        type=positive,
        default=1 << 20,
        help="the most prompts x n x max_tokens x (logprobs + 1) one request may ask for "
        "(400 beyond): bounds the memory one request holds",
    )
    srv.add_argument(
        "--read-timeout",
        type=seconds,
        default=30.0,
        help="seconds to receive a request's headers, and then its body (408 beyond)",
    )
    srv.add_argument(
        "--keep-alive-timeout",
        type=seconds,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    srv.add_argument(
        "--max-connections",
        type=positive,
        default=1024,
        help="open connections beyond which new ones get 503 and are closed (the soft "
        "open-file limit is raised to the hard one at start)",
    )
    srv.add_argument(
        "--cpu-workers",
        type=positive,
        default=2,
        help="threads that tokenize and build large responses off the event loop",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='read tool calls from replies when tool_choice is "auto" (or unset, with tools); '
        "needs --tool-call-parser",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_FORMATS),
        help="the format the model writes tool calls in (Qwen: hermes; Llama 3.x: llama3_json)",
    )
    srv.add_argument(
        "--chat-template",
        help="a Jinja chat template, or a file holding one, in place of the tokenizer's",
        metavar="FILE_OR_TEMPLATE",
    )
    srv.add_argument(
        "--access-log",
        action="store_true",
        help="log a line per request (client, method, path, status) to stdout; off by "
        "default, as it costs throughput under load",
    )
    srv.add_argument(
        "--step-log",
        type=Path,
        help="write every iteration of the engine's loop and every request as JSON lines "
        "(every few seconds and at shutdown)",
    )
    srv.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="run the engine in the server's process, as a thread beside the HTTP event loop "
        "(by default it runs in a process of its own: the two then never wait for each "
        "other's interpreter lock)",
    )
    add_engine_options(srv)

    prof = command(
        "profile",
        "measure the engine for nano-sim: step times over a grid of batch shapes, the "
        "loop's host time offline and through the server",
    )
    prof.add_argument(
        "model",
        help="checkpoint directory or Hugging Face hub id (ORG/NAME), or a config.json with "
        "--load-format dummy",
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
    prof.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="measure the server with the engine in its process (as serve's flag runs it)",
    )
    add_engine_options(prof)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=LOG_FORMAT)
    try:
        commands = {
            "generate": generate,
            "bench": bench,
            "accuracy": accuracy,
            "serve": serve,
            "profile": profile,
        }
        return commands[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nano-engine: error: {in_flags(str(e))}", file=sys.stderr)
        return 2


def in_flags(message: str) -> str:
    """An engine error as the command line spells it: ``max_model_len`` reads ``--max-model-len``
    and ``skip_tokenizer_init=True`` reads ``--skip-tokenizer-init``. A bare name is rewritten
    only when it has an underscore (``device`` is also an English word), never inside a path."""
    for name, option in ENGINE_OPTIONS.items():
        flag, before = option.flags[0], r"(?<![\w/.-])"
        if option.type is None:
            message = re.sub(rf"{before}{name}=True\b", flag, message)
            message = re.sub(rf"{before}{name}=False\b", "--no-" + flag[2:], message)
        message = re.sub(rf"{before}{name}=", flag + " ", message)
        if "_" in name:
            message = re.sub(rf"{before}{name}(?![\w/-]|\.\w)", flag, message)
    return message


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


def status(line: str) -> None:
    """A progress line of a long command, on stderr (stdout keeps the results)."""
    print(line, file=sys.stderr, flush=True)


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
    if args.step_log and kwargs["data_parallel_size"] > 1:
        raise ValueError("--step-log records one engine's loop: not with --data-parallel-size")
    status(f"loading {args.model} ...")
    with LLM(args.model, **kwargs) as llm:
        # Warm-up: prefill, mixed and decode steps of several sizes, so that nothing is
        # compiled (Triton, Inductor, cuBLAS heuristics) inside the timed runs.
        longest = max(8, min(300, llm.engine.max_model_len - 25))
        warm = [[rng.randint(0, 10_000) for _ in range(rng.randint(1, longest))] for _ in range(64)]
        vocab = llm.engine.model_config.vocab_size
        if vocab <= 10_000:  # (a small test model: the same draws, folded into its vocabulary)
            prompts, warm = ([[t % vocab for t in p] for p in ps] for ps in (prompts, warm))
        status(f"warming up ({len(warm)} sequences, not timed) ...")
        llm.generate(warm, SamplingParams(max_tokens=24, ignore_eos=True))
        engine = llm.engine

        def state() -> list[dict | None]:  # (each replica's; None: stopped)
            described = engine.describe()
            return described if isinstance(described, list) else [described]

        times, hits = [], []
        for run in range(args.repeat):
            status(f"timed run {run + 1} of {args.repeat}: {len(prompts)} sequences ...")
            # Every run computes its prompts afresh, as the single run of nano-vllm's benchmark
            # does: nothing found in the prefix cache from the run before.
            llm.reset_prefix_cache()
            if args.step_log:
                engine.record_steps(args.step_log)
            before = state()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
            after = state()
            hits.append(_delta(before, after, "prefix_cache_hit_tokens"))
        elapsed = min(times)
        steps = _delta(before, after, "steps")
        host, device = (_delta(before, after, k) for k in ("host_seconds", "device_seconds"))
        serving = [d for d in after if d is not None]
        first = serving[0]
        result = {
            "num_seqs": args.num_seqs,
            "input_tokens": sum(len(p) for p in prompts),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "seconds": elapsed,
            "seconds_each_run": times,
            "prefix_cache_hit_tokens_each_run": hits,
            "steps": steps,  # (of the last run, every replica's)
            "host_share": host / (host + device) if host + device else 0.0,
            "replicas": len(serving),
            "kv_blocks": first["kv_blocks"],  # (each replica's)
            "kv_tokens": first["kv_tokens"],
            "preemptions": sum(d["preemptions"] for d in serving),
            "attention_backend": first["attention_backend"],
            "cuda_graphs": first["cuda_graphs"],
            "async_scheduling": first["async_scheduling"],
            "device": ", ".join(d["device"] for d in serving),
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
    replicas = f" x {result['replicas']} replicas" if result["replicas"] > 1 else ""
    print(
        f"steps: {result['steps']}, host share of step time: {result['host_share']:.1%} (async "
        f"scheduling: {result['async_scheduling']}), KV capacity: "
        f"{result['kv_blocks']} blocks = {result['kv_tokens']:,} tokens{replicas}, preemptions: "
        f"{result['preemptions']}, attention: {result['attention_backend']}, CUDA graphs: "
        f"{result['cuda_graphs']}, prefix cache hits: {max(hits)} tokens"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _delta(before: list[dict | None], after: list[dict | None], key: str):
    """How much ``key`` grew over a run, summed over the replicas that served throughout."""
    return sum(a[key] - b[key] for a, b in zip(after, before) if a is not None and b is not None)


def accuracy(args: argparse.Namespace) -> int:
    """Greedy runs of the reference engine (the options, unquantized) and of the quantized
    one over the same prompts, compared (``nano_engine.accuracy``)."""
    from nano_engine import LLM, SamplingParams
    from nano_engine.accuracy import compare, format_agreement
    from nano_models import ModelConfig

    kwargs = engine_kwargs(args)
    reference = {
        **kwargs,
        "kv_cache_dtype": "auto",
        "quantization": None,
        "quantize_lm_head": False,
    }
    reference_model = args.reference or args.model
    if args.reference is None and reference == kwargs:
        config = EngineConfig.from_kwargs(args.model, **kwargs)
        if "quantization_config" in ModelConfig.from_pretrained(config.model).raw:
            raise ValueError(
                f"{args.model} is quantized itself: give --reference, its unquantized "
                "checkpoint (or --kv-cache-dtype fp8, to compare the cache on these weights)"
            )
        raise ValueError(
            "nothing to compare: quantize the candidate (--kv-cache-dtype fp8, --quantization "
            "fp8) or give --reference"
        )
    if args.prompts_file is not None:
        prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts_file} holds no prompt")
    else:
        if kwargs["load_format"] == "dummy" and kwargs["tokenizer"] is None:
            kwargs["skip_tokenizer_init"] = reference["skip_tokenizer_init"] = True
        _, prompts, _ = bench_workload(args.prompt_seed, args.num_prompts, args.input_len, (1, 1))
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, logprobs=args.top_k, ignore_eos=True
    )
    outputs = []
    runs = (("reference", reference_model, reference), ("candidate", args.model, kwargs))
    for name, model, options in runs:
        status(f"{name}: loading {model} ...")
        with LLM(model, **options) as llm:
            vocab = llm.engine.model_config.vocab_size
            if not isinstance(prompts[0], str):
                prompts = [[t % vocab for t in p] for p in prompts]
            outputs.append(llm.generate(prompts, params))
    agreement = compare(*outputs, k=args.top_k)
    print(format_agreement(agreement))
    if args.json:
        args.json.write_text(json.dumps(agreement.summary(), indent=2))
    return 0


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The tool call parser for tool_choice "auto", as vLLM asks for it: both flags."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def load_chat_template(value: str | None) -> str | None:
    """A chat template given on the command line: a file's contents, or the text itself (one
    with Jinja's markers; a path that does not exist is an error)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def serve(args: argparse.Namespace) -> int:
    from nano_engine.data_parallel import start_engine
    from nano_engine.server import bind
    from nano_engine.server import serve as run_server

    # The server says when it is ready (INFO) without -v; the engine's details stay behind -v.
    logging.getLogger("nano_engine.server").setLevel(logging.INFO)
    tool_parser = auto_tool_parser(args)  # (before the model loads, as every check)
    chat_template = load_chat_template(args.chat_template)
    try:
        sock = bind(args.host, args.port)  # before the model loads: a taken port fails at once
    except OSError as e:
        print(f"nano-engine: error: {e.strerror}", file=sys.stderr)
        return 1
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    if args.step_log and config.data_parallel_size > 1:
        raise ValueError(
            "--step-log records one engine's loop: it does not go with --data-parallel-size"
        )
    engine = start_engine(config, own_process=not args.disable_frontend_multiprocessing)
    if args.step_log:  # (the server's event loop runs in this thread; a fleet watches it all)
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
        access_log=args.access_log,
        sock=sock,
        chat_template=chat_template,
        tool_parser=tool_parser,
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
    if config.data_parallel_size > 1:
        raise ValueError(
            "profile measures one engine (nano-sim simulates replicas of it: nano-sim "
            "--replicas): drop --data-parallel-size"
        )
    bars = Bars()
    result = profile_engine(
        config,
        quick=args.quick,
        server=not args.no_server,
        progress=bars,
        engine_process=not args.disable_frontend_multiprocessing,
    )
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
