"""Prompt logprobs against transformers' (float64 log-softmax of its logits): every prompt
token's logprob, rank and top ids, with prefix caching (such a request computes its whole
prompt; others still hit the cache), chunked prefill, preemption and n > 1; through the server
as vLLM's prompt_logprobs and OpenAI's echo with logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from engine_helpers import sample_prompts
from server_helpers import ServerProcess

from nano_engine import LLM, SamplingParams
from nano_models.testing import load_reference

K = 3
MODES = {
    "prefix-caching": {"kvcache_block_size": 4},
    "chunked-prefill": {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 40, "max_model_len": 128},
}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Per prompt: transformers' logprobs [T - 1] of tokens 1.. and its top-K per position."""
    path = checkpoints("qwen3")
    model = load_reference(path)
    out = []
    with torch.no_grad():
        for ids in sample_prompts():
            logits = model(torch.tensor([ids])).logits[0].double()
            logprobs = torch.log_softmax(logits, -1)[:-1]
            target = torch.tensor(ids[1:])[:, None]
            chosen = logprobs.gather(-1, target)[:, 0]
            rank = (logprobs > chosen[:, None]).sum(-1) + 1
            out.append((chosen, rank, logprobs.topk(K, -1)))
    return path, out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprobs_match_transformers(reference, mode):
    path, expected = reference
    prompts = sample_prompts()
    with LLM(path, **MODES[mode]) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # (cached now)
        hits = llm.engine.block_manager.hit_tokens
        params = SamplingParams(max_tokens=24, prompt_logprobs=K, n=2, temperature=1.0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.block_manager.hit_tokens == hits  # (these read no cached block)
        again = llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
        if mode == "prefix-caching":
            assert llm.engine.block_manager.hit_tokens > hits  # (others still do)
        if mode == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.prompt_logprobs is None for o in again)
    for out, ids, (chosen, rank, (top_values, top_ids)) in zip(outputs, prompts, expected):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for i, lp in enumerate(lps[1:]):
            assert lp.token_id == ids[i + 1]
            assert lp.logprob == pytest.approx(chosen[i].item(), abs=2e-4)
            assert lp.rank == rank[i].item() or abs(lp.logprob - top_values[i][0].item()) < 1e-4
            assert list(lp.top_logprobs) == pytest.approx(top_values[i].tolist(), abs=2e-4)
            assert list(lp.top_ids) == top_ids[i].tolist()


def test_prompt_logprobs_over_the_limit_are_refused(checkpoints):
    with (
        LLM(checkpoints("qwen3"), max_logprobs=5) as llm,
        pytest.raises(ValueError, match=r"prompt_logprobs \(6\) is over"),
    ):
        llm.generate(["x"], SamplingParams(prompt_logprobs=6), use_tqdm=False)


def test_the_server_writes_prompt_logprobs_and_echoes_them(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        kwargs = dict(model=srv.model, prompt="Hello there", max_tokens=3, temperature=0)
        plain = client.completions.create(**kwargs, logprobs=2).choices[0]
        vllm = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 2})
        entries = vllm.choices[0].model_extra["prompt_logprobs"]
        ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
        assert entries[0] is None and len(entries) == len(ids)
        for token, entry in zip(ids[1:], entries[1:]):
            assert str(token) in entry and len(entry) in (2, 3)
            assert {"logprob", "rank", "decoded_token"} == set(entry[str(token)])
        for stream in (False, True):
            reply = client.completions.create(**kwargs, logprobs=2, echo=True, stream=stream)
            choices = [c for chunk in reply for c in chunk.choices] if stream else reply.choices
            tokens = [t for c in choices for t in c.logprobs.tokens]
            values = [v for c in choices for v in c.logprobs.token_logprobs]
            text = "".join(c.text for c in choices)
            assert text == "Hello there" + plain.text
            assert len(tokens) == len(ids) + 3 and values[0] is None
            assert values[len(ids) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
            assert values[1 : len(ids)] == pytest.approx(
                [e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:])], abs=1e-5
            )
    finally:
        assert srv.stop() == 0
