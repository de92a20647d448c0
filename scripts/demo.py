"""The main job on any machine (CPU is fine): generate with a tiny random checkpoint built
locally, then run nano-vllm's benchmark on a small config with dummy weights."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from nano_engine import LLM, SamplingParams
from nano_models.testing import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "tiny-qwen3", "qwen3")
        with LLM(str(path), max_model_len=256) as llm:
            prompts = ["The quick brown fox", "Paged attention stores"]
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
            for prompt, out in zip(prompts, outputs):
                print(f"{prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    # A random model writes gibberish; what matters is the engine's path end to end.
    bench = [
        sys.executable,
        "-m",
        "nano_engine.cli",
        "bench",
        str(ROOT / "benchmarks" / "configs" / "tiny-qwen3.json"),
        "--load-format",
        "dummy",
        "--num-seqs",
        "128",
        "--input-len",
        "32",
        "256",
        "--output-len",
        "32",
        "256",
        "--max-model-len",
        "1024",
        *sys.argv[1:],
    ]
    subprocess.run(bench, check=True)


if __name__ == "__main__":
    main()
