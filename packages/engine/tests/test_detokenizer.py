"""Incremental detokenization: through tokenizers' ``DecodeStream`` (fast tokenizers) and
through the Python window (the fallback), the text equals ``tokenizer.decode`` of the whole
output for real text split anywhere (multi-byte characters across tokens), the two paths agree
token for token on random ids (special tokens, ids past the vocabulary, stop strings), and a
stream that fails midway hands over to the window without losing text."""

from __future__ import annotations

import random

import pytest

from nano_engine.detokenizer import IncrementalDetokenizer
from nano_models.testing import build_tokenizer

TEXTS = [
    "Grüße aus Köln, señor! Ça va? 東京タワー は 333 m。",
    "emoji 🦜🧪🇩🇪 and math ∑ᵢ xᵢ² ≤ ∞; tabs\tand\nnew lines",
    '{"name": "Zoë", "tags": ["naïve", "résumé"], "n": -1.5e3}',
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def detokenize(tokenizer, prompt, ids, stream: bool, stop=(), fail_at=None):
    """(pieces after each token, stop flags, final text) of one detokenizer."""
    d = IncrementalDetokenizer(tokenizer, prompt, list(stop))
    if not stream:
        d._stream = None
    ends_inside_a_character = tokenizer.decode(prompt[-4:]).endswith("\ufffd")
    assert (d._stream is not None) == (stream and not ends_inside_a_character)
    pieces, stops = [], []
    for i, token in enumerate(ids):
        if i == fail_at:

            class Broken:
                def step(self, *_):
                    raise Exception("Invalid prefix encountered")

            d._stream = Broken()
        stops.append(d.add(token))
        pieces.append(d.delta(finished=False))
        if d.stop_reason is not None:
            break
    pieces.append(d.delta(finished=True))
    return pieces, stops, d.text


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_decodes_as_a_whole_through_both_paths(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say: ", add_special_tokens=False)
    assert len(ids) > len(text) // 4  # (split into many tokens, some inside characters)
    for stream in (True, False):
        pieces, _, final = detokenize(tokenizer, prompt, ids, stream)
        assert final == "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(8))
def test_both_paths_agree_token_for_token_on_random_ids(tokenizer, seed):
    """Prompts of random ids too: one that ends inside a character keeps the Python window
    (the stream's would start after it)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    text_ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    ids = [
        rng.choice(text_ids) if rng.random() < 0.6 else rng.randrange(vocab + 20)  # (past it)
        for _ in range(200)
    ]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    stop = [tokenizer.decode(ids[150:152])] if seed % 2 else []
    expected = detokenize(tokenizer, prompt, ids, stream=False, stop=stop)
    assert detokenize(tokenizer, prompt, ids, stream=True, stop=stop) == expected
    # a stream that fails midway: the Python window goes on from where it was
    assert detokenize(tokenizer, prompt, ids, stream=True, stop=stop, fail_at=77) == expected


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_python_path(tokenizer):
    """``decode``'s clean-up of spaces is Python's alone: such tokenizers keep the window."""
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    d = IncrementalDetokenizer(tokenizer, [], [])
    assert d._stream is None
    ids = tokenizer.encode("a , b . c ' s", add_special_tokens=False)
    for token in ids:
        d.add(token)
    d.finish()
    assert d.text == tokenizer.decode(ids)
