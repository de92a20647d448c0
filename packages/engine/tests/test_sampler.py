"""The sampler against independent computations on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from nano_engine.sampler import Sampler
from nano_scheduler import SamplingParams, Sequence

VOCAB = 50


def seqs_for(params: list[SamplingParams], outputs: list[list[int]] | None = None):
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, [1, 2, 3], p)
        seq.token_ids.extend(outputs[i] if outputs else [])
        seq.stop_token_ids = frozenset({7})
        seqs.append(seq)
    return seqs


def allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a filter keeps, computed one token at a time in float64."""
    probs = torch.softmax(logits.double() / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    ranked = order[: p.top_k] if p.top_k else order
    total = sum(probs[t] for t in ranked)  # top-p is a share of what top-k kept
    keep, mass = set(), 0.0
    for t in ranked:
        if p.top_p < 1 and mass >= p.top_p * total:
            break
        keep.add(t)
        mass += probs[t]
    top = max(probs)
    return {t for t in keep if probs[t] >= p.min_p * top}


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
    ],
)
def test_filters_never_emit_a_token_outside_the_allowed_set(p):
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    logits = torch.randn(64, VOCAB, generator=g) * 3
    seen = set()
    for _ in range(20):
        tokens, _ = sampler(logits.clone(), sampler.prepare(seqs_for([p] * 64)))
        for row, token in enumerate(tokens):
            assert token in allowed(logits[row], p), (row, token)
            seen.add((row, token))
    assert len(seen) > 64  # it does sample, not only pick the top token


def test_top_p_is_a_share_of_the_top_k_tokens():
    """As in vLLM and transformers: top-k keeps .4 and .3, renormalized .57 and .43; top_p 0.5
    then keeps the first alone (a share of the whole distribution would keep both)."""
    probs = torch.full((VOCAB,), 0.2 / (VOCAB - 2))
    probs[:2] = torch.tensor([0.4, 0.3])
    logits = probs.log().expand(256, VOCAB)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    tokens, _ = sampler(logits.clone(), sampler.prepare(seqs_for([p] * 256)))
    assert set(tokens) == {0}
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    tokens, _ = sampler(logits.clone(), sampler.prepare(seqs_for([p] * 256)))
    assert set(tokens) == {0, 1}


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(torch.device("cpu"), VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    tokens, _ = sampler(logits.clone(), sampler.prepare(seqs_for(params)))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_a_seeded_request_reproduces_in_any_batch():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(VOCAB, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(position: int, batch: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), VOCAB)
        params = [SamplingParams(temperature=1.0)] * batch
        params[position] = seeded
        tokens = []
        for _ in range(10):
            logits = torch.randn(batch, VOCAB, generator=g)
            logits[position] = row
            out, _ = sampler(logits, sampler.prepare(seqs_for(params)))
            tokens.append(out[position])
        return tokens

    first = draw(0, 1)
    assert draw(3, 8) == first and draw(5, 6) == first
    assert len(set(first)) > 1


def test_penalties_move_logits_as_defined():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    outputs = [[5, 5, 9], [11]]
    params = [
        SamplingParams(
            temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25
        ),
        SamplingParams(temperature=0, repetition_penalty=0.8),
    ]
    seqs = seqs_for(params, outputs)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    batch = sampler.prepare(seqs)
    got = sampler._penalize(logits.clone(), batch)
    for row, (seq, p) in enumerate(zip(seqs, params)):
        for t in range(VOCAB):
            x = logits[row, t].item()
            count = seq.output_token_ids.count(t)
            if count or t in seq.prompt_token_ids:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert got[row, t].item() == pytest.approx(x, abs=1e-6), (row, t)


def test_min_tokens_masks_stop_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 100.0  # token 7 is the stop token of seqs_for
    sampler = Sampler(torch.device("cpu"), VOCAB)
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0)]
    tokens, _ = sampler(logits, sampler.prepare(seqs_for(params)))
    assert tokens[0] != 7 and tokens[1] == 7


def test_logprobs_of_the_sampled_and_top_tokens():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(torch.device("cpu"), VOCAB)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    tokens, logprobs = sampler(logits.clone(), sampler.prepare(seqs_for(params)))
    reference = torch.log_softmax(logits[0].double(), -1)
    lp = logprobs[0]
    assert lp.token_id == tokens[0] and math.isclose(lp.logprob, reference[tokens[0]], abs_tol=1e-5)
    best = reference.topk(3)
    assert [t for t, _ in lp.top] == best.indices.tolist()
    assert logprobs[1] is None


def test_fused_rows_only_for_batches_the_fused_pass_draws_alone(monkeypatch):
    """``fused_rows``: the inputs a CUDA graph draws with, only when every row needs nothing
    but the fused pass; a seeded row's seed is the one ``prepare`` gives it."""
    from nano_engine import gumbel

    monkeypatch.setattr(gumbel, "available", lambda device: True)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    plain = [
        Sequence(0, [1, 2], SamplingParams(temperature=0)),
        Sequence(1, [1, 2], SamplingParams(temperature=0.5, seed=7)),
        Sequence(2, [1, 2], SamplingParams(temperature=2.0, top_k=VOCAB)),  # top-k off
    ]
    rows = sampler.fused_rows(plain)
    assert rows.inv_temperature == [0.0, 2.0, 0.5]
    batch = sampler.prepare(plain)
    assert rows.seeds[1] == int(batch.seeds[1])
    assert all(0 <= s < 2**53 for s in rows.seeds)
    for seq_id, params in enumerate(
        (
            SamplingParams(temperature=0.5, top_p=0.9),
            SamplingParams(temperature=0.5, top_k=5),
            SamplingParams(temperature=0.5, min_p=0.1),
            SamplingParams(temperature=0, logprobs=0),
            SamplingParams(temperature=0.5, repetition_penalty=1.2),
            SamplingParams(temperature=0.5, frequency_penalty=0.5),
            SamplingParams(temperature=0.5, presence_penalty=0.5),
            SamplingParams(temperature=0.5, logit_bias={3: 1.0}),
            SamplingParams(temperature=0.5, allowed_token_ids=[3]),
        ),
        start=10,
    ):
        assert sampler.fused_rows([*plain, Sequence(seq_id, [1, 2], params)]) is None, params
    masked = Sequence(4, [1, 2], SamplingParams(temperature=0.5, min_tokens=2))
    masked.stop_token_ids = frozenset({7})
    assert sampler.fused_rows([masked]) is None
    masked.token_ids.extend([3, 4])  # min_tokens reached: no mask any more
    assert sampler.fused_rows([masked]) is not None
    # (a row's params are read once, at its first step, and forgotten when it is released)
    sampler.release(10)
    rows = sampler.fused_rows([Sequence(10, [1, 2], SamplingParams(temperature=4.0))])
    assert rows is not None and rows.inv_temperature == [0.25]
    monkeypatch.setattr(gumbel, "available", lambda device: False)
    assert Sampler(torch.device("cpu"), VOCAB).fused_rows(plain) is None


def test_logit_bias_and_allowed_token_ids():
    """Greedy rows take the argmax of the biased logits (computed here in float64); sampled
    and seeded rows with allowed_token_ids draw only those; logprobs stay the raw ones."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    bias = {3: 4.5, 17: -100, 40: 2.25}
    params = [
        SamplingParams(temperature=0, logit_bias=bias, logprobs=0),
        SamplingParams(temperature=0, allowed_token_ids=[9, 21, 33]),
        SamplingParams(temperature=1.0, allowed_token_ids=[2, 44]),
        SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[5], logit_bias={6: 100}),
    ]
    sampler = Sampler(torch.device("cpu"), VOCAB)
    biased = logits[0].clone()
    for t, b in bias.items():
        biased[t] += b
    for _ in range(20):
        tokens, logprobs = sampler(logits.float(), sampler.prepare(seqs_for(params)))
        assert tokens[0] == int(biased.argmax())
        raw = torch.log_softmax(logits[0], -1)[tokens[0]].item()
        assert logprobs[0].logprob == pytest.approx(raw, abs=1e-5)
        assert tokens[1] == max((9, 21, 33), key=lambda t: logits[1, t].item())
        assert tokens[2] in (2, 44) and tokens[3] == 5


def test_banned_rows_never_take_their_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 12] = 50.0
    logits[:, 13] = 40.0
    sampler = Sampler(torch.device("cpu"), VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    batch = sampler.prepare(seqs_for(params), banned=[(0, [12]), (1, [12, 13])])
    tokens, _ = sampler(logits, batch)
    assert tokens[0] == 13 and tokens[1] not in (12, 13)


@pytest.mark.parametrize(
    "params",
    [
        {"logit_bias": {1: 101}},
        {"logit_bias": {-1: 1}},
        {"logit_bias": {1: float("nan")}},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-3]},
        {"bad_words": [" "]},
        {"bad_words": "word"},
    ],
)
def test_bad_values_are_refused(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        SamplingParams(**params)
