"""FP8 weights through the engine on the CPU: a checkpoint in Qwen3-FP8's format generates
what transformers generates from the weights it stands for (dequantized), in every scheduling
mode and with tensor parallelism 2; quantization="fp8" runs and stays close to the unquantized
engine (nano-engine accuracy), with its LM head in e4m3 too (quantize_lm_head, tensor
parallelism 2 generating what one process does); a tensor-parallel split that would cut weight
blocks, and an FP8 checkpoint compared without its reference, are errors that say so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from engine_helpers import NEW_TOKENS, hf_greedy, sample_prompts

from nano_engine import LLM, SamplingParams
from nano_models.testing import fp8_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
MODES = {
    "prefix-caching": {"kvcache_block_size": 4},
    "chunked-prefill": {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
    "tensor-parallel-2": {"kvcache_block_size": 4, "tensor_parallel_size": 2},
}


@pytest.fixture(scope="module")
def fp8(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-engine")
    path, plain = fp8_checkpoint(checkpoints("qwen3"), root / "fp8", root / "plain", (16, 16))
    return str(path), hf_greedy(str(plain), sample_prompts()), str(plain)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_fp8_checkpoint_generates_what_its_weights_stand_for(fp8, mode):
    path, expected, _ = fp8
    with LLM(path, device="cpu", **MODES[mode]) as llm:
        outputs = llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fp8_mixture_of_experts_generates_what_its_weights_stand_for(checkpoints, tmp_path, tp):
    """Qwen3-MoE in Qwen3-FP8's format (experts and attention in e4m3, routers not), with
    chunked prefill, and its experts split over two ranks."""
    source = checkpoints("qwen3_moe")
    path, plain = fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "plain", (16, 16))
    expected = hf_greedy(str(plain), sample_prompts())
    options = {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    with LLM(str(path), device="cpu", tensor_parallel_size=tp, **options) as llm:
        outputs = llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if tp == 2:  # (16 intermediate columns a rank would cut blocks of 32)
        cut, _ = fp8_checkpoint(source, tmp_path / "cut", tmp_path / "cut-plain", (16, 32))
        with pytest.raises(ValueError, match=r"experts' 32 intermediate columns split over 2"):
            LLM(str(cut), device="cpu", tensor_parallel_size=2, kvcache_block_size=4)


def test_a_tensor_parallel_split_that_cuts_weight_blocks_is_refused(checkpoints, tmp_path):
    path, _ = fp8_checkpoint(checkpoints("qwen3"), tmp_path / "fp8", tmp_path / "plain", (16, 96))
    with pytest.raises(ValueError, match=r"o_proj: its 128 input columns split over 2 .* 96"):
        LLM(str(path), device="cpu", tensor_parallel_size=2, kvcache_block_size=4)


def accuracy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nano_engine", "accuracy", *args, "--device", "cpu",
         "--num-prompts", "4", "--input-len", "8", "24", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_fp8_weights_stay_close_to_the_unquantized_engine(fp8, checkpoints, tmp_path):
    path, _, plain = fp8
    proc = accuracy(checkpoints("qwen3"), "--quantization", "fp8", "--json", f"{tmp_path}/q.json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "q.json").read_text())
    assert summary["top5_agreement"] == 1.0 and summary["tokens_compared"] >= 4
    proc = accuracy(path)
    assert proc.returncode == 2 and "quantized itself: give --reference" in proc.stderr
    proc = accuracy(path, "--reference", plain, "--json", f"{tmp_path}/c.json")
    assert proc.returncode == 0, proc.stderr
    # (the reference: the checkpoint these FP8 weights stand for, so the same tokens)
    assert json.loads((tmp_path / "c.json").read_text())["greedy_match_rate"] == 1.0


def test_an_fp8_lm_head_stays_close_and_splits_over_ranks(checkpoints, tmp_path):
    # (416 vocabulary rows: 208 a rank, a multiple of 16 as FP8 products want)
    source = checkpoints("qwen3", vocab_size=416)
    proc = accuracy(source, "-q", "fp8", "--quantize-lm-head", "--json", f"{tmp_path}/h.json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "h.json").read_text())
    assert summary["top5_agreement"] >= 0.9 and summary["tokens_compared"] >= 4
    # Split over two ranks, the head computes what it does in one process. (An FP8 checkpoint:
    # on the CPU its layers do not round activations, which quantization="fp8"'s row-parallel
    # layers do per rank's shard, so that its two ranks differ from one process already.)
    path, _ = fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "plain", (16, 16))
    outputs = {}
    for tp in (1, 2):
        with LLM(
            str(path),
            device="cpu",
            kvcache_block_size=4,
            quantize_lm_head=True,
            tensor_parallel_size=tp,
        ) as llm:
            if tp == 1:
                assert llm.engine.runner.model.lm_head.weight.dtype == torch.float8_e4m3fn
            outputs[tp] = llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[2]] == [
        o.outputs[0].token_ids for o in outputs[1]
    ]
    with pytest.raises(ValueError, match="quantize_lm_head needs FP8 weights"):
        LLM(source, device="cpu", quantize_lm_head=True)
