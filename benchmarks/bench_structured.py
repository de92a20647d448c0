"""JSON-schema-constrained decoding against the same run unconstrained: output tok/s of N
concurrent requests (Qwen3-0.6B config, dummy weights), and the schema's compile time (first
use and cached). Two schemas of the same form: ``typical`` (enums, bounded numbers and arrays,
strings without a length bound: what OpenAI's strict mode and most pydantic models send) and
``bounded`` (every string with a maxLength: xgrammar checks most of the vocabulary's tokens
against the count left at each step inside such a string, 1-25 ms per sequence on one core).

The constrained run goes first; the unconstrained one then asks each request for exactly the
number of tokens its constrained twin produced (ignore_eos), so that both runs decode the same
batches and the ratio is the constraint's cost (the host's bitmask fill, its copy, the mask on
the device, sampling outside the decode graphs).

A real Qwen3 tokenizer cannot be downloaded here: ``--make-tokenizer DIR`` trains a byte-level
BPE of the model's vocabulary size on the Python standard library's sources (about a minute),
whose bitmasks cost what the real one's do (the same width, tokens of code and text).

    python benchmarks/bench_structured.py --make-tokenizer build/bench-tokenizer
    python benchmarks/bench_structured.py --tokenizer build/bench-tokenizer [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A form an application might ask for: nested objects, enums, bounded numbers and strings,
# a bounded array of objects.
BOUNDED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 32},
        "email": {"type": "string", "maxLength": 48},
        "status": {"enum": ["active", "suspended", "closed"]},
        "verified": {"type": "boolean"},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 24},
                "country": {"enum": ["DE", "FR", "US", "JP", "BR"]},
                "zip": {"type": "string", "maxLength": 10},
            },
            "required": ["street", "city", "country", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "gift"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "email", "status", "verified", "score", "address", "orders"],
    "additionalProperties": False,
}


def _unbounded(schema):
    if isinstance(schema, dict):
        return {k: _unbounded(v) for k, v in schema.items() if k != "maxLength"}
    return schema


SCHEMAS = {"typical": _unbounded(BOUNDED), "bounded": BOUNDED}


def make_tokenizer(out: Path, vocab_size: int) -> None:
    from nano_models.testing import build_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.rglob("*.py"))

    def texts():
        for f in files:
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    start = time.perf_counter()
    tokenizer = build_tokenizer(vocab_size=vocab_size - 300, corpus=texts())
    tokenizer.save_pretrained(out)
    print(f"tokenizer of {len(tokenizer):,} tokens -> {out} ({time.perf_counter() - start:.0f} s)")


def run(llm, prompts, params) -> tuple[float, list[int], list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs], outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "benchmarks/configs/qwen3-0.6b.json"))
    parser.add_argument("--tokenizer", help="a tokenizer directory (see --make-tokenizer)")
    parser.add_argument("--make-tokenizer", metavar="DIR", help="train one into DIR and exit")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each; the best counts")
    parser.add_argument("--schemas", default="typical,bounded", help="of: " + ", ".join(SCHEMAS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--phases", action="store_true", help="also print where each run's step time goes"
    )
    parser.add_argument(
        "--cprofile", type=int, metavar="N", help="and the loop's N costliest functions"
    )
    parser.add_argument(
        "--grammar-threads", type=int, help="xgrammar's threads for the bitmask (default: auto)"
    )
    args = parser.parse_args()
    vocab = json.loads(Path(args.model).read_text())["vocab_size"]
    if args.make_tokenizer:
        make_tokenizer(Path(args.make_tokenizer), vocab)
        return
    if not args.tokenizer:
        parser.error("--tokenizer DIR is needed (make one with --make-tokenizer DIR)")

    from nano_engine import LLM

    llm = LLM(
        args.model,
        tokenizer=args.tokenizer,
        load_format="dummy",
        max_num_seqs=args.requests,
        max_model_len=args.prompt_len + args.max_tokens + 16,
    )
    if args.grammar_threads:
        import xgrammar

        llm.engine.grammars._token_masks._batch = xgrammar.BatchGrammarMatcher(args.grammar_threads)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    results = {}
    for name in args.schemas.split(","):
        results[name] = measure(llm, prompts, SCHEMAS[name], args)
        r = results[name]
        print(
            f"{name}: {args.requests} requests, {r['output_tokens']:,} output tokens "
            f"({r['mean_output_len']:.0f} each, {r['valid_json']} valid JSON): constrained "
            f"{r['constrained_tok_s']:,.0f} tok/s, unconstrained {r['unconstrained_tok_s']:,.0f} "
            f"tok/s, ratio {r['ratio']:.3f}; schema compile {r['compile_first_s'] * 1e3:.0f} ms "
            f"first, {r['compile_cached_s'] * 1e3:.2f} ms cached"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    llm.shutdown()


def measure(llm, prompts, schema: dict, args) -> dict:
    from nano_engine import SamplingParams, StructuredOutputsParams
    from nano_engine.structured import GrammarCompiler

    engine = llm.engine
    so = StructuredOutputsParams(json=schema)
    fresh = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, [0])
    start = time.perf_counter()
    fresh.compile(so)  # (the tokenizer's preprocessing included: a server's first request)
    first = time.perf_counter() - start
    start = time.perf_counter()
    fresh.compile(so)
    cached = time.perf_counter() - start
    constrained = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, structured_outputs=so)
    run(llm, prompts[:4], constrained)  # warm-up
    best_c, lengths, outputs = min(
        (run(llm, prompts, constrained) for _ in range(args.repeat)), key=lambda r: r[0]
    )
    valid = sum(
        o.outputs[0].finish_reason == "stop" and _parses(o.outputs[0].text) for o in outputs
    )
    free = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
    best_u = min(run(llm, prompts, free)[0] for _ in range(args.repeat))
    tokens = sum(lengths)
    if args.phases:
        print("constrained:", phases(llm, prompts, constrained))
        print("unconstrained:", phases(llm, prompts, free))
    if args.cprofile:
        print(loop_profile(llm, prompts, constrained, args.cprofile))
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "mean_output_len": tokens / len(lengths),
        "valid_json": valid,
        "constrained_tok_s": tokens / best_c,
        "unconstrained_tok_s": tokens / best_u,
        "ratio": best_u / best_c,
        "compile_first_s": first,
        "compile_cached_s": cached,
    }


def phases(llm, prompts, params) -> str:
    """Mean milliseconds per decode step of one more run, by phase of the loop (the step log),
    with some of the calls inside them: ``accept`` (the matchers' work started and its tokens
    taken, in ``post``), ``masks`` (the wait for the bitmask and its copy, in ``sample``), the
    sampler's and the scheduler's calls."""
    engine = llm.engine
    calls = {
        "accept": (engine.grammars, ("follow", "followed")),
        "masks": (engine.grammars, ("masks",)),
        "fused_rows": (engine.sampler, ("fused_rows",)),
        "prepare": (engine.sampler, ("prepare", "prepare_fused")),
        "sampler": (engine.sampler, ("sample",)),
        "advance": (engine.scheduler, ("advance",)),
        "resolve": (engine.scheduler, ("resolve",)),
        "output": (engine, ("_output",)),
    }
    spent = dict.fromkeys(calls, 0.0)

    def timed(name, fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    for name, (owner, methods) in calls.items():
        for method in methods:
            setattr(owner, method, timed(name, getattr(owner, method)))
    recorder = engine.record_steps()
    try:
        run(llm, prompts, params)
    finally:
        engine.stop_recording()
        for owner, methods in calls.values():
            for method in methods:
                delattr(owner, method)
    steps = [s for s in recorder.steps if s.decodes[0] and not s.prefills]
    n = max(1, len(steps))
    mean = {
        name: 1e3 * sum(getattr(s, name) or 0.0 for s in steps) / n
        for name in ("schedule", "launch", "wait", "post", "sample", "publish")
    }
    mean["step"] = 1e3 * (steps[-1].t - steps[0].t) / max(1, n - 1) if steps else 0.0
    for name in ("forward", "sample_device"):
        mean[name] = 1e3 * sum(getattr(s, name) or 0.0 for s in steps) / n
    mean |= {name: 1e3 * v / n for name, v in spent.items()}
    return f"{len(steps)} decode steps, ms each: " + ", ".join(
        f"{k} {v:.3f}" for k, v in mean.items()
    )


def loop_profile(llm, prompts, params, top: int) -> str:
    """cProfile of the loop's iterations during one more run: its ``top`` functions by own
    time (the profiler slows Python down, so shares, not times, are what it shows)."""
    import cProfile
    import io
    import pstats

    engine, profile = llm.engine, cProfile.Profile()
    step = engine._step

    def profiled(*a, **k):
        profile.enable()
        try:
            return step(*a, **k)
        finally:
            profile.disable()

    engine._step = profiled
    try:
        run(llm, prompts, params)
    finally:
        del engine._step
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
