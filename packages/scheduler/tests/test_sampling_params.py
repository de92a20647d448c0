from __future__ import annotations

import pytest

from nano_scheduler import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.ignore_eos) == (
        16,
        0,
        None,
        None,
        False,
    )
    assert p.stop == () and p.stop_token_ids == ()


def test_normalization():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.top_k == 0 and p.greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"presence_penalty": float("-inf")}, "presence_penalty must be a finite number"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ({"top_k": -2}, "top_k must be an integer >= 0, or -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids"),
        ({"logprobs": -1}, "logprobs must be an integer >= 0"),
        ({"seed": 1.5}, "seed must be a 64-bit integer"),
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"stop": 5}, "stop strings must be non-empty strings, got 5"),
        ({"stop_token_ids": 2}, "stop_token_ids must be a list of token ids >= 0, got 2"),
    ],
)
def test_invalid_values_are_rejected_with_an_actionable_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as info:
        SamplingParams(n=0, top_p=2.0)
    assert "n must be" in str(info.value) and "top_p must be" in str(info.value)
    with pytest.raises(ValueError) as info:  # a field that is not a number hides no other
        SamplingParams(temperature="hot", top_p=5, min_p="x", max_tokens=0)
    for problem in ("temperature must be a number", "top_p must be in", "min_p must be a number"):
        assert problem in str(info.value)
    assert "max_tokens must be" in str(info.value)


def test_tiny_temperatures_are_greedy_or_raised_as_in_vllm():
    assert SamplingParams(temperature=1e-45).greedy
    assert SamplingParams(temperature=9e-6).temperature == 0
    assert SamplingParams(temperature=1e-4).temperature == 1e-2
    assert SamplingParams(temperature=1e30).temperature == 1e30  # finite: near uniform


def test_params_cannot_change_after_validation():
    import dataclasses

    p = SamplingParams(n=2, stop=["x"], stop_token_ids=[3])
    for name, value in (("n", -1), ("top_k", "x"), ("temperature", float("nan"))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, name, value)
    assert isinstance(p.stop, tuple) and isinstance(p.stop_token_ids, tuple)  # no append
    assert p.replace(n=3).n == 3 and p.n == 2
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        p.replace(n=-1)
