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


@pytest.mark.parametrize(
    "arch,keys,window",
    [
        ("MistralForCausalLM", {}, WINDOW),  # (Mistral: on when set)
        ("MistralForCausalLM", {"sliding_window": None}, None),
        ("MistralForCausalLM", {"sliding_window": 512}, None),  # (as long as the positions)
        ("Qwen2ForCausalLM", {}, None),  # (the Qwen models: off unless switched on)
        ("Qwen2ForCausalLM", {"use_sliding_window": False}, None),
        ("Qwen2ForCausalLM", {"use_sliding_window": True}, WINDOW),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 2}, None),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}, WINDOW),
        ("Qwen3ForCausalLM", {"layer_types": ["full_attention"] * 2}, None),
        ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]}, WINDOW),
    ],
)
def test_the_window_is_read_as_transformers_reads_it(arch, keys, window):
    """Which configs slide (transformers' reading: layer_types, else use_sliding_window with
    its per-model default and max_window_layers); a window as long as the positions does not
    count."""
    raw = {
        "architectures": [arch],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "sliding_window": WINDOW,
        **keys,
    }
    config = ModelConfig.from_dict(raw)
    assert config.sliding_window == window
    assert config.max_context == (window or 512)
