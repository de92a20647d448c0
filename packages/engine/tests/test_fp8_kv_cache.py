"""An FP8 (e4m3) KV cache on the CPU: greedy outputs equal transformers' with its attention
reading K and V as such a cache holds them (each value divided by its layer's scale, rounded to
e4m3, multiplied back: an attention function of transformers' own, not our code), in every
scheduling mode, with scales of 1 and with a checkpoint's k_scale / v_scale; twice the tokens
of a bf16 cache in the same memory; clear errors where FP8 cannot go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import NEW_TOKENS, hf_greedy, sample_prompts
from safetensors.torch import load_file, save_file

from nano_engine import LLM, SamplingParams
from nano_models.testing import build_checkpoint

MODES = {
    "prefix-caching": {"kvcache_block_size": 4},
    "chunked-prefill": {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 40, "max_model_len": 128},
    "sync-scheduling": {"kvcache_block_size": 4, "async_scheduling": False},
}


def fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache gives it back."""
    stored = (x.float() * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def hf_greedy_fp8(path: str, prompts, scales: list[tuple[float, float]]) -> list[list[int]]:
    """transformers' greedy generate, its attention over K and V rounded as an FP8 cache holds
    them (layer i's scales: scales[i])."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        key, value = fake_fp8(key, k_scale), fake_fp8(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_reference", attention)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="fp8_kv_reference"
    )
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def scaled_checkpoint(checkpoints, tmp_path_factory):
    """The tiny Qwen3 with each layer's self_attn.k_scale and v_scale in its safetensors, as
    FP8 checkpoints carry them (scales that move many values across e4m3's steps)."""
    import shutil

    path = tmp_path_factory.mktemp("qwen3-kv-scales")
    shutil.copytree(checkpoints("qwen3"), path, dirs_exist_ok=True)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    scales = [(0.013 * (i + 1), 0.007 * (i + 2)) for i in range(layers)]
    for i, (k, v) in enumerate(scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(path), scales


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_over_an_fp8_cache_matches_transformers_rounding_k_and_v(checkpoints, mode):
    path = checkpoints("qwen3")
    layers = json.loads(Path(path, "config.json").read_text())["num_hidden_layers"]
    expected = hf_greedy_fp8(path, sample_prompts(), [(1.0, 1.0)] * layers)
    with LLM(path, kv_cache_dtype="fp8", **MODES[mode]) as llm:
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        outputs = llm.generate(
            sample_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False
        )
        if mode == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_checkpoints_kv_scales_are_used(scaled_checkpoint):
    path, scales = scaled_checkpoint
    expected = hf_greedy_fp8(path, sample_prompts(), scales)
    with LLM(path, kv_cache_dtype="fp8", kvcache_block_size=4) as llm:
        assert [a.kv_scales for a in llm.engine.runner.model.attention_layers] == [
            pytest.approx(s) for s in scales
        ]
        outputs = llm.generate(
            sample_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Without an FP8 cache the scales are loaded and not used: transformers' plain outputs.
    with LLM(path, kvcache_block_size=4) as llm:
        assert llm.engine.runner.model.attention_layers[0].kv_scales == (1.0, 1.0)
        outputs = llm.generate(
            sample_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, sample_prompts())


def test_an_fp8_cache_holds_twice_the_tokens_of_bf16(checkpoints):
    path = checkpoints("qwen3")
    options = {"kvcache_block_size": 16, "kv_cache_memory_gb": 0.01, "dtype": "bfloat16"}
    with LLM(path, **options) as bf16, LLM(path, kv_cache_dtype="fp8", **options) as fp8:
        a, b = bf16.engine.runner, fp8.engine.runner
        assert b.layout.bytes_per_block * 2 == a.layout.bytes_per_block
        assert b.num_blocks in (2 * a.num_blocks, 2 * a.num_blocks + 1)  # (floors of one budget)


def test_where_fp8_cannot_go_the_error_says_so(checkpoints, tmp_path):
    from nano_engine import EngineConfig
    from nano_models.layers.attention import choose_attention_backend

    path = checkpoints("qwen3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_kwargs(path, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="flash_attn backend does not read an FP8 KV cache"):
        choose_attention_backend("flash_attn", torch.device("cuda"), 256, torch.bfloat16, True)
    assert choose_attention_backend("auto", torch.device("cpu"), 256, torch.bfloat16, True) == (
        "torch"
    )
    bad = build_checkpoint(tmp_path / "bad-scales", "qwen3")
    (weights,) = bad.glob("*.safetensors")
    original = load_file(weights)
    for extra, message in (
        ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "finite and > 0"),
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "per-head KV cache scales"),
        ({"model.layers.0.self_attn.k_proj.v_scale": torch.tensor(1.0)}, "unexpected tensors"),
    ):
        save_file({**original, **extra}, weights, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            LLM(str(bad), kv_cache_dtype="fp8", kvcache_block_size=4)
    # A scale written as [1] (some quantizers do), under the projection's name: read.
    scales = {"model.layers.1.self_attn.v_proj.v_scale": torch.tensor([0.25])}
    save_file({**original, **scales}, weights, metadata={"format": "pt"})
    with LLM(str(bad), kv_cache_dtype="fp8", kvcache_block_size=4) as llm:
        assert llm.engine.runner.model.attention_layers[1].kv_scales == (1.0, 0.25)


def out(tokens: list[int], tops: list[dict[int, float]]):
    from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput

    logprobs = [
        Logprob(t, top[t], sorted(top.items(), key=lambda x: -x[1])) for t, top in zip(tokens, tops)
    ]
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", tokens, "length", logprobs)])


def test_compare_follows_vllms_rule_until_the_greedy_paths_part():
    from nano_engine.accuracy import compare

    top = {1: -0.1, 2: -0.5, 3: -2.0}
    same = out([1, 1, 1], [top, top, top])
    near = out([1, 1, 1], [{1: -0.12, 2: -0.4}, top, top])
    parted = out([1, 2, 9], [top, {2: -0.3, 1: -0.31}, {9: -0.1}])  # a near tie flips at 1
    far = out([1, 3, 1], [top, {3: -0.2, 4: -0.3}, top])  # 3 is in ours, ours' 1 not in theirs
    result = compare([same, same, same], [near, parted, far], k=2)
    assert (result.sequences, result.identical) == (3, 1)  # (seq 0: the same tokens)
    # seq 0: all 3 compared and the same; seq 1: 2 compared (stops where they part); seq 2: 2
    assert (result.positions, result.matched) == (3 + 2 + 2, 3 + 1 + 1)
    assert result.outside_top_k == [(2, 1)] and not result.passed
    assert result.max_logprob_error == pytest.approx(0.02)
    assert compare([same], [same]).summary()["greedy_match_rate"] == 1.0
    with pytest.raises(ValueError, match="2 reference outputs, 1 candidates"):
        compare([same, same], [same])


def test_the_accuracy_command_compares_fp8_with_the_models_dtype(checkpoints, tmp_path):
    import subprocess
    import sys

    path = checkpoints("qwen3")
    proc = subprocess.run(
        [sys.executable, "-m", "nano_engine", "accuracy", path, "--kv-cache-dtype", "fp8",
         "--device", "cpu", "--num-prompts", "6", "--input-len", "8", "30", "--max-tokens", "12",
         "--json", str(tmp_path / "acc.json")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "top-5 agreement" in proc.stdout
    summary = json.loads((tmp_path / "acc.json").read_text())
    assert summary["sequences"] == 6 and summary["tokens_compared"] >= 6
    proc = subprocess.run(
        [sys.executable, "-m", "nano_engine", "accuracy", path, "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "nothing to compare" in proc.stderr
