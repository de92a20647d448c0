"""Greedy outputs of LLM.generate equal transformers' generate, token for token, on tiny random
Qwen3, Qwen2, Llama and Qwen3-MoE checkpoints: with prefix caching on and off, with chunked
prefill forced by a small token budget, with a KV pool so small that sequences are preempted,
and without async scheduling (each step's tokens read before the next step is scheduled)."""

from __future__ import annotations

import gc

import pytest
from engine_helpers import NEW_TOKENS, hf_greedy, sample_prompts

from nano_engine import LLM, SamplingParams

MODES = {
    "prefix-caching": {"kvcache_block_size": 4},
    "no-prefix-caching": {"kvcache_block_size": 16, "enable_prefix_caching": False},
    "chunked-prefill": {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 40, "max_model_len": 128},
    "sync-scheduling": {"kvcache_block_size": 4, "async_scheduling": False},
}


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "qwen3_moe"])
def reference(request, checkpoints):
    path = checkpoints(request.param)
    return path, hf_greedy(path, sample_prompts())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_transformers(reference, mode):
    path, expected = reference
    with LLM(path, **MODES[mode]) as llm:
        outputs = llm.generate(
            sample_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False
        )
        engine = llm.engine
        if mode == "prefix-caching":
            assert engine.block_manager.hit_tokens > 0
        if mode == "no-prefix-caching":
            assert engine.block_manager.hit_tokens == 0
        if mode == "preemption":
            assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for out, ids in zip(outputs, sample_prompts()):
        assert out.prompt_token_ids == ids and out.finished
        assert out.outputs[0].finish_reason in ("length", "stop")


def test_reset_prefix_cache_computes_repeated_prompts_again(reference):
    path, expected = reference
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    with LLM(path, kvcache_block_size=4) as llm:
        blocks = llm.engine.block_manager
        llm.generate(sample_prompts(), params, use_tqdm=False)
        first = blocks.hit_tokens  # what the prompts share among themselves
        llm.generate(sample_prompts(), params, use_tqdm=False)
        assert blocks.hit_tokens - first > first  # the repeat finds its prompts cached
        assert llm.reset_prefix_cache() > 0
        hits = blocks.hit_tokens
        outputs = llm.generate(sample_prompts(), params, use_tqdm=False)
        assert blocks.hit_tokens - hits == first  # as the first run: nothing from before
        assert llm.reset_prefix_cache() > 0 and blocks.num_cached_free_blocks == 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_the_collector_skips_the_models_while_engines_live(checkpoints):
    """A full collection walks every tracked object; each engine freezes its start-up objects
    (model, compiled code) out of it, and the last one to shut down hands them back so cycles
    among them can go. An engine that fails to start freezes nothing."""
    path = checkpoints("qwen3")
    with pytest.raises(ValueError):
        LLM(path, scheduling_policy="nope")
    assert gc.get_freeze_count() == 0

    def tracked(obj) -> bool:
        return any(o is obj for o in gc.get_objects())

    first, second = LLM(path), LLM(path)
    models = [next(llm.engine.runner.model.modules()) for llm in (first, second)]
    assert not tracked(models[0]) and not tracked(models[1])
    out = first.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    first.shutdown()
    first.shutdown()  # twice: still one release
    assert not tracked(models[1])  # the second engine still runs
    second.shutdown()
    assert gc.get_freeze_count() == 0 and tracked(models[0]) and tracked(models[1])
