"""The fused Gumbel-max sampling pass: its draws follow softmax(logits / temperature) (a
chi-square test against the float64 softmax), greedy rows take the argmax, masked tokens are
never drawn, a seed gives the same draw; and through the sampler on CUDA, a seeded request
draws the same tokens in any batch, filtered rows beside it or not.

GPU-marked; with TRITON_INTERPRET=1 the kernel tests also run on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_engine.gumbel import gumbel_argmax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
VOCAB = 5000  # two slices of the kernel, merged
LIVE = {3: 0.0, 1000: 1.0, 4095: 2.0, 4096: 0.5, 4500: -1.0, 4999: 1.5}  # the rest is -inf


def masked_logits(rows: int, dtype=torch.float32) -> torch.Tensor:
    logits = torch.full((rows, VOCAB), float("-inf"))
    for token, value in LIVE.items():
        logits[:, token] = value
    return logits.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_softmax(dtype):
    rows, temperature = 3000, 0.7
    logits = masked_logits(rows, dtype)
    inv = torch.full((rows,), 1 / temperature, device=DEVICE)
    seeds = torch.arange(rows, device=DEVICE) * 7919 + 12345
    tokens = gumbel_argmax(logits, inv, seeds).tolist()
    assert set(tokens) <= set(LIVE), "a masked token was drawn"
    values = torch.tensor(list(LIVE.values()), dtype=torch.float64)
    expected = torch.softmax(values / temperature, 0) * rows
    observed = torch.tensor([tokens.count(t) for t in LIVE], dtype=torch.float64)
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, f"chi-square {chi2:.1f} over 5 degrees of freedom (p < 0.001)"


def test_greedy_rows_and_seeds():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, VOCAB, generator=g) * 3).to(DEVICE)
    inv = torch.tensor([0.0, 1.0] * 32, device=DEVICE)  # even rows greedy
    seeds = torch.arange(64, device=DEVICE)
    first = gumbel_argmax(logits, inv, seeds)
    assert torch.equal(first[::2], logits[::2].argmax(-1))
    assert torch.equal(gumbel_argmax(logits, inv, seeds), first)
    other = gumbel_argmax(logits, inv, seeds + 1000)
    assert torch.equal(other[::2], first[::2])
    assert not torch.equal(other[1::2], first[1::2])


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(monkeypatch):
    from nano_engine import gumbel
    from nano_engine.sampler import Sampler
    from nano_scheduler import SamplingParams, Sequence

    if DEVICE == "cpu":  # the interpreter runs the fused pass on the CPU
        monkeypatch.setattr(gumbel, "available", lambda device: True)
    vocab = 1000
    sampler = Sampler(torch.device(DEVICE), vocab)
    assert sampler.fused
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, vocab, generator=g).to(DEVICE)  # row 0 is the seeded request's
    seeded = SamplingParams(temperature=1.0, seed=42)
    others = [
        SamplingParams(temperature=0.8, top_p=0.9),  # filtered: the torch path
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2),
    ]

    def draws(params: list[SamplingParams], row: int) -> list[int]:
        seqs = [Sequence(i, [1, 2], p) for i, p in enumerate(params)]
        out = []
        for _ in range(8):
            batch = sampler.prepare(seqs)
            rows = logits[1 : len(params) + 1].clone()
            rows[row] = logits[0]
            tokens, _ = sampler(rows, batch)
            for seq, token in zip(seqs, tokens):
                seq.token_ids.append(token)
            out.append(tokens[row])
        return out

    alone = draws([seeded], 0)
    assert draws([*others, seeded], 3) == alone
    assert draws([others[0], seeded], 1) == alone
    assert len(set(alone)) > 1


def test_the_fused_pass_sees_min_tokens_masks_and_penalties(monkeypatch):
    from nano_engine import gumbel
    from nano_engine.sampler import Sampler
    from nano_scheduler import SamplingParams, Sequence

    if DEVICE == "cpu":
        monkeypatch.setattr(gumbel, "available", lambda device: True)
    vocab = 64
    sampler = Sampler(torch.device(DEVICE), vocab)
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[:, 7] = 30.0  # the stop token: always drawn at temperature 0.2 ...
    logits[:, 9] = 25.0  # ... unless masked or penalized below this one
    params = [
        SamplingParams(temperature=0.2, min_tokens=3),  # 7 masked until 3 tokens exist
        # 7 seen 5 times: 30 - 2 - 2 * 5 = 18 < 25
        SamplingParams(temperature=0.2, presence_penalty=2.0, frequency_penalty=2.0),
    ]
    seqs = [Sequence(0, [1, 2], params[0]), Sequence(1, [1, 2], params[1])]
    seqs[0].stop_token_ids = frozenset({7})
    seqs[1].token_ids += [7] * 5
    for _ in range(20):
        tokens, _ = sampler(logits.clone(), sampler.prepare(seqs))
        assert tokens == [9, 9]
    plain = [Sequence(i, [1, 2], SamplingParams(temperature=0.2)) for i in range(2)]
    assert sampler(logits.clone(), sampler.prepare(plain))[0] == [7, 7]
