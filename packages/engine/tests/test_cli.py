"""The nano-engine command: its parser in process, and the command run for real in a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import nano_engine
from nano_engine import cli, options
from nano_engine.config import DEVICES, DTYPES, LOAD_FORMATS, EngineConfig
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
    # Progress on stderr: a line before the warm-up, then a bar with tok/s for each timed run.
    assert proc.stderr.index("warming up") < proc.stderr.index("timed run 1 of 2")
    assert proc.stderr.index("timed run 1 of 2") < proc.stderr.index("timed run 2 of 2")
    assert proc.stderr.count("tok/s") >= 2 and "16/16" in proc.stderr
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
    assert all(
        r.gc is not None and 0 <= r.gc <= r.host + r.forward + r.sample_device for r in computed
    )
    assert sorted(int(r.id) for r in log.requests) == list(range(16 + 64, 2 * 16 + 64))
    assert all(r.arrival <= r.first_scheduled <= r.finish for r in log.requests)
    assert sum(r.output_tokens for r in log.requests) == result["output_tokens"]
    # Each request counted once where it was taken in, with its prompt's tokens.
    assert sum(r.accepted for r in log.steps) == 16
    assert sum(r.accepted_tokens for r in log.steps) == sum(r.prompt_tokens for r in log.requests)


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


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_every_option_of_every_command_has_help_and_shows_its_default():
    parser = cli.build_parser()
    assert "serve" in parser.format_usage() and "serve" in parser.format_help()
    commands = subcommands()
    assert set(commands) == {"generate", "bench", "accuracy", "serve", "profile"}
    for name, sub in [("", parser), *commands.items()]:
        sub.format_help()  # (every %(default)s expands)
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{what} has no help"
            shown = options.HelpFormatter(prog="x")._get_help_string(action)
            if action.option_strings and action.default not in (None, argparse.SUPPRESS):
                assert "default" in shown or action.nargs == 0, f"{what} hides its default"
            if action.default is None and action.option_strings and action.nargs != 0:
                assert "(default: None)" not in shown
    # Every engine option is spelled on every command that builds an engine; choices come from
    # the config's own lists.
    for sub in commands.values():
        dests = {a.dest: a for a in sub._actions}
        for f in fields(EngineConfig):
            assert f.name == "model" or f.name in dests, f.name
        assert tuple(dests["dtype"].choices) == DTYPES
        assert tuple(dests["device"].choices) == DEVICES
        assert tuple(dests["load_format"].choices) == LOAD_FORMATS


def test_help_and_version_through_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "nano_engine", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: nano-engine") and "serve" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "nano_engine", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"nano-engine {nano_engine.__version__}"
    proc = subprocess.run(
        [sys.executable, "-m", "nano_engine", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--tensor-parallel-size" in proc.stdout


def test_verbose_before_or_after_the_command():
    assert cli.parse_args(["-v", "bench", "m"]).verbose
    assert cli.parse_args(["bench", "m", "-v"]).verbose
    assert cli.parse_args(["serve", "--verbose", "m"]).verbose
    assert not cli.parse_args(["bench", "m"]).verbose


VLLM_SPELLINGS = [
    "-tp", "2",
    "--block-size", "32",
    "--dtype", "bfloat16",
    "--gpu-memory-utilization", "0.8",
    "--max-model-len", "4096",
    "--no-enable-prefix-caching",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "2048",
    "--enforce-eager",
    "--seed", "7",
    "--num-gpu-blocks-override", "100",
    "--load-format", "dummy",
]  # fmt: skip
# ours, where they differ from vLLM's
OURS = [
    {
        "-tp": "--tensor-parallel-size",
        "--block-size": "--kvcache-block-size",
        "--num-gpu-blocks-override": "--num-kvcache-blocks",
    }.get(arg, arg)
    for arg in VLLM_SPELLINGS
]


def test_vllm_flag_spellings_and_ours_give_the_same_engine():
    expected = {f.name: f.default for f in fields(EngineConfig) if f.name != "model"}
    expected.update(
        tensor_parallel_size=2,
        kvcache_block_size=32,
        dtype="bfloat16",
        gpu_memory_utilization=0.8,
        max_model_len=4096,
        enable_prefix_caching=False,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        seed=7,
        num_kvcache_blocks=100,
        load_format="dummy",
    )
    for command in ("generate", "bench", "serve", "profile"):
        extra = ["--out", "p.json"] if command == "profile" else []
        for spelling in (VLLM_SPELLINGS, OURS):
            args = cli.parse_args([command, str(TINY), *spelling, *extra])
            assert options.engine_kwargs(args) == expected, (command, spelling)
    args = cli.parse_args(["serve", str(TINY), "--served-model-name", "qwen", *VLLM_SPELLINGS])
    assert args.served_model_name == "qwen"
    config = EngineConfig.from_kwargs(str(TINY), **expected)
    # engine_flags (for an engine started in another process) is the inverse of the parser.
    again = cli.parse_args(["bench", str(TINY), *options.engine_flags(config)])
    assert options.engine_kwargs(again) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be >= 1, got 0"),
        (["--block-size", "x"], "an integer is needed, got 'x'"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5"),
        (["--kv-cache-memory-gb", "0"], "must be a number of GB > 0, got 0"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--max-logprobs", "-1"], "must be >= 0, got -1"),
    ],
)
def test_bad_engine_options_are_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["bench", str(TINY), *argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_engine_errors_are_reported_in_flags():
    assert (
        cli.in_flags("pass tokenizer=DIR, or skip_tokenizer_init=True and token-id prompts")
        == "pass --tokenizer DIR, or --skip-tokenizer-init and token-id prompts"
    )
    assert (
        cli.in_flags("raise gpu_memory_utilization, or lower max_model_len (on the device)")
        == "raise --gpu-memory-utilization, or lower --max-model-len (on the device)"
    )
    assert cli.in_flags("enforce_eager=False") == "--no-enforce-eager"
    path = "model '/ckpt/max_model_len/x.max_num_seqs' does not exist"
    assert cli.in_flags(path) == path
