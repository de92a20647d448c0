"""Reference outputs from transformers, and the prompts the engine tests share."""

from __future__ import annotations

import random

import torch

from nano_models.testing import load_reference

NEW_TOKENS = 32


def failing_at(fn, n: int, message: str):
    """fn, except that its n-th call raises RuntimeError(message) (an injected failure)."""
    calls = 0

    def wrapper(*args):
        nonlocal calls
        calls += 1
        if calls == n:
            raise RuntimeError(message)
        return fn(*args)

    return wrapper


def sample_prompts(vocab: int = 300, seed: int = 0) -> list[list[int]]:
    """8 prompts of different lengths; the first four share a 20-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    lengths = [24, 29, 21, 33, 1, 5, 12, 17]
    prompts = []
    for i, n in enumerate(lengths):
        own = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared + own[: n - 20] if i < 4 else own)
    return prompts


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' generate(do_sample=False), one prompt at a time (eos stops it)."""
    model = load_reference(path)
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs
