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
    seqs[1].token_ids.extend([7] * 5)
    for _ in range(20):
        tokens, _ = sampler(logits.clone(), sampler.prepare(seqs))
        assert tokens == [9, 9]
    plain = [Sequence(i, [1, 2], SamplingParams(temperature=0.2)) for i in range(2)]
    assert sampler(logits.clone(), sampler.prepare(plain))[0] == [7, 7]


def bitmask_of(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout, built independently: bit t % 32 of word t // 32 allows token t."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_a_bitmask_restricts_each_row_to_its_tokens():
    """Rows with a bitmask draw among its tokens only, by their softmax (greedy: their argmax);
    rows without one (mask row -1) draw from the whole vocabulary as before."""
    rows, temperature = 2000, 0.8
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(rows, VOCAB, generator=g) * 2).to(DEVICE, torch.bfloat16)
    # tokens in several words and slices: the first, one at a word's top bit, the last
    allowed = [{0, 31, 32, 4095, 4096, 4999}, {7, 2047, 2048, 4127}]
    bitmask = bitmask_of(allowed, VOCAB).to(DEVICE)
    # rows 0 mod 4 -> mask 0, 1 mod 4 -> mask 1, the rest unmasked; row 2 mod 4 greedy
    mask_rows = torch.tensor([[0, 1, -1, -1][r % 4] for r in range(rows)], dtype=torch.int32)
    inv = torch.tensor([0.0 if r % 4 == 2 else 1 / temperature for r in range(rows)])
    seeds = torch.arange(rows) * 104729 + 7
    tokens = gumbel_argmax(
        logits, inv.to(DEVICE), seeds.to(DEVICE), bitmask, mask_rows.to(DEVICE)
    ).tolist()
    assert all(tokens[r] in allowed[0] for r in range(0, rows, 4))
    assert all(tokens[r] in allowed[1] for r in range(1, rows, 4))
    greedy = logits[2::4].float().argmax(-1).tolist()
    assert tokens[2::4] == greedy
    unmasked = gumbel_argmax(logits, inv.to(DEVICE), seeds.to(DEVICE)).tolist()
    assert tokens[3::4] == unmasked[3::4]  # (a row without a mask draws as without one)
    # one row's logits repeated, masked to its 6 tokens: the draws follow their softmax
    same = logits[:1].repeat(rows, 1)
    masked = gumbel_argmax(
        same,
        torch.full((rows,), 1 / temperature, device=DEVICE),
        seeds.to(DEVICE),
        bitmask,
        torch.zeros(rows, dtype=torch.int32, device=DEVICE),
    ).tolist()
    live = sorted(allowed[0])
    values = same[0, live].double().cpu()
    expected = torch.softmax(values / temperature, 0) * rows
    observed = torch.tensor([masked.count(t) for t in live], dtype=torch.float64)
    keep = expected >= 5  # (the chi-square test needs expected counts of at least 5)
    chi2 = ((observed - expected)[keep] ** 2 / expected[keep]).sum().item()
    assert sum(observed) == rows
    assert chi2 < 20.5, f"chi-square {chi2:.1f} (p < 0.001 at 5 degrees of freedom)"


def test_a_bad_bitmask_is_refused():
    logits = torch.zeros(2, VOCAB, device=DEVICE)
    inv, seeds = torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    narrow = torch.zeros(2, VOCAB // 32, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="bitmask"):
        gumbel_argmax(logits, inv, seeds, narrow, rows)
    with pytest.raises(ValueError, match="bitmask"):
        gumbel_argmax(logits, inv, seeds, narrow.long(), rows)
    wide = torch.zeros(2, -(-VOCAB // 32), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="mask_rows"):
        gumbel_argmax(logits, inv, seeds, wide, rows.long())
    with pytest.raises(ValueError, match="mask_rows"):
        gumbel_argmax(logits, inv, seeds, wide, rows[:1])


@pytest.mark.parametrize("path", ["prepare_fused", "prepare", "logprobs"])
def test_the_sampler_keeps_constrained_rows_to_their_bitmask(monkeypatch, path):
    """A grammar's bitmask through the sampler: read by the fused pass (plain rows, with
    ``prepare_fused``'s inputs or ``prepare``'s) or applied to the float32 logits (a row asks
    for logprobs); rows without one are untouched."""
    from nano_engine import gumbel
    from nano_engine.sampler import Sampler
    from nano_scheduler import SamplingParams, Sequence, StructuredOutputsParams

    if DEVICE == "cpu":
        monkeypatch.setattr(gumbel, "available", lambda device: True)
    vocab = 96
    sampler = Sampler(torch.device(DEVICE), vocab)
    logits = torch.zeros(4, vocab, device=DEVICE, dtype=torch.bfloat16)
    logits[:, 5] = 40.0  # what an unconstrained row takes (at temperature 0.5)
    regex = StructuredOutputsParams(regex="a")  # (rows 2 and 0; their bitmasks are made here)
    params = [
        SamplingParams(temperature=0.5, structured_outputs=regex),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.5, structured_outputs=regex),
        SamplingParams(temperature=0.5, logprobs=2 if path == "logprobs" else None),
    ]
    seqs = [Sequence(i, [1, 2], p) for i, p in enumerate(params)]
    assert sampler.fused_rows(seqs) is None
    allowed = [{33, 64}, {0, 95}]  # rows 2 and 0 are constrained, in that order
    grammar = (bitmask_of(allowed, vocab).to(DEVICE), [2, 0])
    seen = [set() for _ in range(4)]
    for _ in range(24):
        if path == "prepare_fused":
            batch = sampler.prepare_fused(sampler.fused_rows(seqs, grammar=True), grammar)
        else:
            batch = sampler.prepare(seqs, grammar)
        tokens, logprobs = sampler(logits.clone(), batch)
        for row, token in enumerate(tokens):
            seen[row].add(token)
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)  # (new Philox seeds each step)
    assert seen[2] <= allowed[0] and seen[0] <= allowed[1]
    assert len(seen[2]) == 2 and len(seen[0]) == 2  # (the allowed tokens are equally likely)
    assert seen[1] == {5} and seen[3] == {5}
    assert (logprobs[3] is not None) == (path == "logprobs")
    if path == "logprobs":
        assert sampler.fused_rows(seqs, grammar=True) is None
