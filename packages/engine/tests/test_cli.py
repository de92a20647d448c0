"""The nano-engine command, run for real in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nano_scheduler.sim.profile import read_step_log

TINY = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "tiny-qwen3.json"


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "nano_engine.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_generate(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nThe quick brown fox\n")
    proc = run(
        "generate",
        checkpoints("qwen3"),
        "--prompt",
        "First",
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--kvcache-block-size",
        "8",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--- prompt:") == 3 and "'The quick brown fox'" in proc.stdout


def test_bench_with_dummy_weights_and_no_tokenizer(tmp_path):
    out = tmp_path / "bench.json"
    steps = tmp_path / "steps.jsonl"
    proc = run(
        "bench",
        str(TINY),
        "--load-format",
        "dummy",
        "--num-seqs",
        "16",
        "--input-len",
        "8",
        "32",
        "--output-len",
        "8",
        "32",
        "--max-model-len",
        "256",
        "--json",
        str(out),
        "--step-log",
        str(steps),
        "--repeat",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout and "host share of step time" in proc.stdout
    result = json.loads(out.read_text())
    assert result["num_seqs"] == 16 and result["output_tokens"] > 0
    # The second run repeats the prompts but finds none of them cached: both compute them all.
    assert result["prefix_cache_hit_tokens_each_run"] == [0, 0]
    assert "prefix cache hits: 0 tokens" in proc.stdout
    # The step log of the last run: every step, its device and host times, every request.
    log = read_step_log(steps)
    computed = [r for r in log.steps if r.num_tokens]
    assert len(computed) == result["steps"]
    assert sum(r.sampled for r in computed) == result["output_tokens"]
    assert all(r.forward > 0 and r.sample_device > 0 and r.host > 0 for r in computed)
    assert all(r.schedule > 0 for r in computed) and log.device["synchronous"]
    assert sorted(int(r.id) for r in log.requests) == list(range(16 + 64, 2 * 16 + 64))
    assert all(r.arrival <= r.first_scheduled <= r.finish for r in log.requests)
    assert sum(r.output_tokens for r in log.requests) == result["output_tokens"]


def test_bad_arguments_are_reported():
    proc = run("bench", "/nonexistent", "--load-format", "dummy")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run("generate", str(TINY), "--prompt", "x")
    assert proc.returncode == 2 and "is a file" in proc.stderr
    proc = run("bench", str(TINY), "--load-format", "dummy", "--repeat", "0")
    assert proc.returncode == 2 and "--repeat: must be >= 1, got 0" in proc.stderr
    proc = run("serve", str(TINY), "--port", "99999")
    assert proc.returncode == 2 and "a port is 1-65535, got 99999" in proc.stderr


def test_bench_on_a_model_with_a_small_vocabulary(checkpoints):
    """nano-vllm's prompt ids go up to 10,000: folded into a smaller vocabulary."""
    args = ("--num-seqs", "4", "--input-len", "8", "16", "--output-len", "4", "8")
    proc = run("bench", checkpoints("qwen3"), *args, "--max-model-len", "256")
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout
