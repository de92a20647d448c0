"""A model whose attention slides over a window (Mistral v0.1's 4,096 of 32,768 positions): full
attention is the same up to the window's length, so the engine serves it up to there. By
default max_model_len is the window, and its greedy outputs equal transformers' (which slides);
a longer max_model_len is refused with the window named, as is loading the model alone for
longer sequences."""

from __future__ import annotations

import pytest
from engine_helpers import NEW_TOKENS, hf_greedy, sample_prompts

from nano_engine import LLM, SamplingParams
from nano_models import ModelConfig
from nano_models.loader import load_model

WINDOW = 80  # (the longest sample prompt, 33 tokens, and 32 new ones fit)


@pytest.fixture(scope="module")
def mistral(checkpoints):
    return checkpoints("mistral", sliding_window=WINDOW)


def test_the_window_caps_max_model_len_and_greedy_matches_transformers(mistral):
    config = ModelConfig.from_pretrained(mistral)
    assert config.max_position_embeddings > WINDOW
    assert (config.sliding_window, config.max_context) == (WINDOW, WINDOW)
    expected = hf_greedy(mistral, sample_prompts())
    with LLM(mistral, kvcache_block_size=4) as llm:
        assert llm.engine.max_model_len == WINDOW
        outputs = llm.generate(
            sample_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_longer_max_model_len_is_refused_naming_the_window(mistral):
    with pytest.raises(ValueError, match=f"sliding window \\({WINDOW} tokens\\)"):
        LLM(mistral, max_model_len=WINDOW + 1)
    with pytest.raises(ValueError, match=f"window {WINDOW}"):
        load_model(mistral, max_len=WINDOW + 1)
    model, _ = load_model(mistral, max_len=WINDOW)
    assert model.config.sliding_window == WINDOW


def test_a_window_that_is_off_or_as_long_as_the_positions_changes_nothing(checkpoints):
    off = ModelConfig.from_pretrained(
        checkpoints("qwen2", use_sliding_window=False, sliding_window=WINDOW)
    )
    assert off.sliding_window is None and off.max_context == off.max_position_embeddings
    whole = ModelConfig.from_pretrained(checkpoints("mistral", sliding_window=512))
    assert whole.sliding_window is None and whole.max_context == 512
