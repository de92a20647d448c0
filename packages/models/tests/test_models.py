"""Our Qwen3, Qwen3-MoE, Qwen2 and Llama against transformers on tiny random checkpoints, in
fp32, through a paged KV cache: a batched prefill of prompts of different lengths, then 16
decode steps."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import PagedRunner, prompts, reference_logits

from nano_models.testing import build_checkpoint, load_reference

TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # wavelengths on both sides and between
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "qwen3-gqa-untied": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen3-mqa-bias-yarn": (
        "qwen3",
        {"num_key_value_heads": 1, "attention_bias": True, "rope_parameters": YARN_ROPE},
    ),
    "qwen2-gqa-untied": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama-gqa-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "llama-tied-plain-head-dim-llama3-rope": (
        "llama",
        {"head_dim": 16, "tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE},
    ),
    # mixtures of experts: top-2 of 4 with a dense layer between; top-4 of 6, renormalized
    "qwen3-moe-top2-dense-layer": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3-moe-top4-norm-topk": (
        "qwen3_moe",
        {"num_experts": 6, "num_experts_per_tok": 4, "norm_topk_prob": True},
    ),
    # experts in every second layer only, one expert per token
    "qwen3-moe-sparse-step-2-top1": (
        "qwen3_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "num_experts_per_tok": 1},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_logits_match_transformers_through_prefill_and_decode(checkpoint):
    compare_with_transformers(checkpoint, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_logits_match_transformers_on_cuda(checkpoint):
    compare_with_transformers(checkpoint, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU (or TRITON_INTERPRET=1)",
)
def test_logits_match_transformers_with_the_triton_backend(checkpoint):
    """The Triton attention kernels (prefill over the cache, the split decode and its merge)
    inside whole models, in fp32 (on the CPU: Triton's interpreter, about 15 minutes)."""
    compare_with_transformers(checkpoint, "cuda" if torch.cuda.is_available() else "cpu", "triton")


def compare_with_transformers(checkpoint, device, backend="torch"):
    hf = load_reference(checkpoint)
    ours = PagedRunner(checkpoint, device=device, backend=backend)
    cfg = ours.model.config
    seqs = prompts(8, cfg.vocab_size)
    logits = ours.step([(i, s, 0) for i, s in enumerate(seqs)], num_prefills=len(seqs))
    for step in range(17):
        expected = torch.stack([reference_logits(hf, s) for s in seqs])
        diff = (logits - expected).abs().max().item()
        assert diff <= TOLERANCE, f"step {step}: max abs diff {diff}"
        if step == 16:
            break
        next_tokens = expected.argmax(-1).tolist()
        for s, t in zip(seqs, next_tokens):
            s.append(t)
        logits = ours.step([(i, [s[-1]], len(s) - 1) for i, s in enumerate(seqs)], num_prefills=0)


def test_chunked_prefill_cached_prefix_and_mixed_batches_match_one_shot_prefill(checkpoint):
    ours = PagedRunner(checkpoint)
    vocab = ours.model.config.vocab_size
    prompt = prompts(1, vocab, seed=1, lengths=(23,))[0]
    one_shot = ours.step([(0, prompt, 0)], num_prefills=1)[0]
    # Chunked: 8 tokens, then 15 (the runner's tables grow with each chunk).
    ours.step([(1, prompt[:8], 0)], num_prefills=1)
    chunked = ours.step([(1, prompt[8:], 8)], num_prefills=1)[0]
    torch.testing.assert_close(chunked, one_shot, atol=TOLERANCE, rtol=0)
    # A cached prefix: sequence 2 starts with sequence 0's first two blocks.
    ours.tables[2] = ours.tables[0][:2]
    cached = ours.step([(2, prompt[8:], 8)], num_prefills=1)[0]
    torch.testing.assert_close(cached, one_shot, atol=TOLERANCE, rtol=0)
    # Mixed: a prefill chunk and two decodes in one step equal the same work done apart
    # (recomputing a step rewrites the same KV into the same slots).
    other = prompts(1, vocab, seed=2, lengths=(11,))[0]
    ours.step([(3, other[:5], 0)], num_prefills=1)
    alone = [
        ours.step([(3, other[5:], 5)], num_prefills=1)[0],
        ours.step([(0, [7], 23)], num_prefills=0)[0],
        ours.step([(1, [9], 23)], num_prefills=0)[0],
    ]
    mixed = ours.step([(3, other[5:], 5), (0, [7], 23), (1, [9], 23)], num_prefills=1)
    torch.testing.assert_close(mixed, torch.stack(alone), atol=TOLERANCE, rtol=0)


def test_compiled_layers_give_the_same_logits(tmp_path):
    from nano_models.compile import compile_layers

    path = build_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False)
    eager, compiled = PagedRunner(path), PagedRunner(path)
    compile_layers(compiled.model)
    chunks = [(i, s, 0) for i, s in enumerate(prompts(4, 100, seed=9))]
    torch.testing.assert_close(compiled.step(chunks, 4), eager.step(chunks, 4), atol=1e-5, rtol=0)
