"""The streaming engine: incremental outputs, stop strings, abort, async iteration, chat,
logprobs and n > 1, and bad input that leaves the engine serving."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest
import torch

from nano_engine import LLM, EngineDeadError, SamplingParams
from nano_models.testing import load_reference


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(checkpoints("qwen3"), kvcache_block_size=4) as llm:
        yield llm


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_increments_concatenate_to_the_final_text(llm):
    prompt = "Ünïcödé and 中文 🙂 text:"
    stream = llm.engine.add_request(prompt, greedy(48))
    deltas = list(stream)
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    text = "".join(d.outputs[0].text for d in deltas)
    ids = [t for d in deltas for t in d.outputs[0].token_ids]
    assert len(ids) == 48
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=True)
    assert text == llm.generate(prompt, greedy(48), use_tqdm=False)[0].outputs[0].text


def test_stop_strings_across_token_boundaries_are_cut(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    tokens = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string that starts inside one token's text and ends inside a later one.
    boundary = next(len(t) for t in tokens if len(t) >= 6)
    stop = full.text[boundary - 2 : boundary + 3]
    assert len(stop) == 5
    cut = full.text[: full.text.index(stop)]
    stream = llm.engine.add_request(prompt, greedy(stop=[stop]))
    deltas = list(stream)
    assert "".join(d.outputs[0].text for d in deltas) == cut
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    kept = llm.generate(
        prompt, greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == cut + stop


def test_a_stop_string_ending_in_the_last_allowed_token_finishes_with_stop(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    texts = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # the first k >= 4 whose text ends a 3-character stop string not found before it
    k, stop = next(
        (k, t[-3:])
        for k, t in enumerate(texts[3:], 4)
        if full.text.startswith(t)
        and len(t) > len(texts[k - 2])
        and full.text.index(t[-3:]) == len(t) - 3
    )
    out = llm.generate(prompt, greedy(k, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k and out.text == texts[k - 1][:-3]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)  # not "length"


def test_stop_strings_count_from_min_tokens_on(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    stop = full.text[0]  # in the first token's text
    early = llm.generate(prompt, greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) < 10 and early.finish_reason == "stop"
    late = llm.generate(prompt, greedy(20, stop=[stop], min_tokens=10), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) >= 10


def test_the_stop_token_text_is_left_out_unless_asked_for(llm):
    prompt = "The quick brown fox"
    ids = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    i = next(i for i in range(3, 20) if ids[i] not in ids[:i])  # its first occurrence
    decode = llm.tokenizer.decode
    out = llm.generate(prompt, greedy(20, stop_token_ids=[ids[i]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: i + 1] and out.text == decode(ids[:i])
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[i])
    params = greedy(20, stop_token_ids=[ids[i]], include_stop_str_in_output=True)
    kept = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert kept.text == decode(ids[: i + 1])


def test_outputs_report_the_prefix_cache_hits(llm):
    prompt = [11 + i % 7 for i in range(40)]
    first, second = (llm.generate(prompt, greedy(1), use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 36)  # 9 blocks of 4


def test_seeded_requests_leave_no_generator_behind(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, stop=["e", "a", " "])
    llm.generate(["Seeded one", "Seeded two"] * 10, params, use_tqdm=False)
    assert llm.engine.sampler._generators == {}


def test_abort_frees_the_blocks(llm):
    engine = llm.engine
    stream = engine.add_request("A long answer please", greedy(2000))
    first = stream.get(timeout=30)
    assert first is not None and not first.finished
    engine.abort(first.request_id)
    rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_async_iteration(llm):
    async def consume():
        stream = llm.engine.add_request("Async", greedy(12))
        return [out async for out in stream]

    outputs = asyncio.run(consume())
    assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 12


def test_requests_from_many_threads(llm):
    results = {}

    def worker(i):
        results[i] = llm.generate(f"Thread {i} says", greedy(10), use_tqdm=False)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6))
    for i, out in results.items():
        alone = llm.generate(f"Thread {i} says", greedy(10), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    chat = llm.chat(messages, greedy(8), use_tqdm=False)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    assert chat.prompt_token_ids == ids
    assert (
        chat.outputs[0].token_ids
        == llm.generate(ids, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    )


def test_logprobs_match_transformers(llm, checkpoints):
    ids = llm.tokenizer("Logprobs of").input_ids
    out = llm.generate(ids, greedy(3, logprobs=4), use_tqdm=False)[0].outputs[0]
    hf = load_reference(checkpoints("qwen3"))
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == expected.argmax().item()
    assert first.logprob == pytest.approx(expected[first.token_id].item(), abs=1e-4)
    assert [t for t, _ in first.top] == expected.topk(4).indices.tolist()
    assert len(out.logprobs) == 3


def test_n_samples(llm):
    out = llm.generate(
        "Several",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate(
        "Several",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_a_seeded_request_reproduces_inside_different_batches(llm):
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Seeded", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["Other prompt number one", "Seeded", "And another"]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(crowd, [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_bad_input_raises_and_the_engine_keeps_serving(llm):
    good = "Still serving"
    expected = llm.generate(good, greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    vocab = llm.engine.model_config.vocab_size
    bad = [
        (
            lambda: llm.generate([5] * 600, greedy(5), use_tqdm=False),
            ValueError,
            r"prompt \(600 tokens\) is longer than the maximum model length of 512",
        ),
        (lambda: llm.generate("", greedy(5), use_tqdm=False), ValueError, "empty"),
        (lambda: llm.generate([[]], greedy(5), use_tqdm=False), ValueError, "empty"),
        (
            lambda: llm.generate([1, vocab + 5], greedy(5), use_tqdm=False),
            ValueError,
            "outside the vocabulary",
        ),
        (
            lambda: llm.generate([1, -1], greedy(5), use_tqdm=False),
            ValueError,
            "outside the vocabulary",
        ),
        (lambda: llm.generate(good, SamplingParams(top_p=0), use_tqdm=False), ValueError, "top_p"),
        (
            lambda: llm.generate(good, {"temperature": 0}, use_tqdm=False),
            TypeError,
            "SamplingParams",
        ),
        (lambda: llm.generate([good, ""], greedy(5), use_tqdm=False), ValueError, "empty"),
        (
            lambda: llm.generate(good, greedy(5, logprobs=21), use_tqdm=False),
            ValueError,
            r"logprobs \(21\) is over the engine's limit of 20",
        ),
        (
            lambda: llm.generate(good, greedy(5, stop_token_ids=[vocab]), use_tqdm=False),
            ValueError,
            "stop_token_ids .* outside the vocabulary",
        ),
    ]
    for call, error, message in bad:
        with pytest.raises(error, match=message):
            call()
        assert not llm.engine.has_unfinished()  # nothing of a bad batch was queued
        assert llm.generate(good, greedy(5), use_tqdm=False)[0].outputs[0].token_ids == expected


def test_bad_engine_configuration(checkpoints, tmp_path):
    path = checkpoints("qwen3")
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_batch'\]"):
        LLM(path, max_batch=4)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLM(str(tmp_path))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", no_weights)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        LLM(str(no_weights))
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM(path, max_num_seqs=0)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(path, max_model_len=10**6)


def test_async_and_sync_scheduling_give_the_same_outputs(checkpoints):
    """Seeded sampling with stop strings, eos, min_tokens, penalties and logprobs: the tokens,
    texts, finish and stop reasons and logprobs do not depend on async scheduling (which finds
    a stop one step late and discards the step's extra token)."""
    prompts = ["The first prompt", "Another one, longer than the first", "Short", "Fourth"]
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, stop=["e"], logprobs=2),
        SamplingParams(temperature=0.8, seed=2, max_tokens=25, min_tokens=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=4, max_tokens=18, top_k=20, ignore_eos=True),
    ]
    results = []
    for async_scheduling in (False, True):
        path = checkpoints("qwen3")
        with LLM(path, kvcache_block_size=4, async_scheduling=async_scheduling) as llm:
            assert llm.engine.async_scheduling is async_scheduling
            outs = llm.generate(prompts * 2, params * 2, use_tqdm=False)
            assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        results.append(
            [
                (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                for o in outs
                for c in o.outputs
            ]
        )
    assert {r[2] for r in results[0]} == {"stop", "length"}
    assert results[0] == results[1]


def test_shutdown_fails_new_requests(checkpoints):
    llm = LLM(checkpoints("qwen3"))
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate("after", greedy(3), use_tqdm=False)


def test_the_engine_logs_its_throughput(llm, caplog, monkeypatch):
    monkeypatch.setattr(llm.engine.stats_log, "interval", 0.0)  # a line after every step

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "generation" in r.getMessage()]

    with caplog.at_level("INFO", logger="nano_engine"):
        llm.generate(["one", "two three"], greedy(5), use_tqdm=False)
        # The last step's line follows its outputs, which generate may return first.
        deadline = time.monotonic() + 10
        while len(lines()) < 5:
            assert time.monotonic() < deadline, lines()
            time.sleep(0.01)
    # The last step samples both sequences' fifth tokens and leaves nothing behind.
    assert lines()[-1].startswith("prompt 0 tok/s")
    assert "running 0, waiting 0, KV cache 0.0%, preemptions 0" in lines()[-1]


def test_streamed_samples_concatenate_to_the_whole_output(llm):
    """n > 1 streamed: each sample's deltas, in index order within each output, add up to
    what generate returns whole (the same seed)."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    deltas = list(llm.engine.add_request("Several", params))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    streamed = {i: [] for i in range(3)}
    for d in deltas:
        for o in d.outputs:
            streamed[o.index] += o.token_ids
    whole = llm.generate("Several", params, use_tqdm=False)[0]
    assert [streamed[i] for i in range(3)] == [o.token_ids for o in whole.outputs]
    assert all(len(ids) == 16 for ids in streamed.values())


def test_a_replica_core_hands_over_every_streamed_output(checkpoints):
    """The replica's collector (``ReplicaCore.outputs``, on its own thread, as the engine's
    process sends batches) gets every delta of every stream, finished once, whether it was
    waiting or busy when the loop published them; greedy tokens equal generate's."""
    from nano_engine.config import EngineConfig
    from nano_engine.data_parallel.replica import ReplicaCore, RequestSpec

    path = checkpoints("qwen3")
    prompts = [[1 + (i * 13 + j) % 200 for j in range(3 + i % 5)] for i in range(24)]
    lengths = [1 + (i * 7) % 30 for i in range(24)]
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    errors: list[Exception] = []
    core = ReplicaCore(EngineConfig.from_kwargs(path, kvcache_block_size=4), 0)
    try:
        for way in ("at once", "one by one"):
            specs = [
                RequestSpec(f"{way} {i}", None, p, greedy(n), True, False)
                for i, (p, n) in enumerate(zip(prompts, lengths))
            ]

            def send(batches=[[s] for s in specs] if way == "one by one" else [specs]):
                try:
                    for batch in batches:
                        core.submit(batch)
                        time.sleep(0.002)
                except Exception as e:  # (said by the collecting loop)
                    errors.append(e)

            sender = threading.Thread(target=send)
            sender.start()
            deadline = time.monotonic() + 120
            while not all(spec.request_id in finished for spec in specs):
                assert time.monotonic() < deadline, "outputs lost"
                assert not errors, errors
                batch = core.outputs(0.5)
                assert batch.error is None
                for request_id, done, _, completions, *_ in batch.outputs:
                    assert request_id not in finished
                    tokens.setdefault(request_id, []).extend(
                        t for completion in completions for t in completion[2]
                    )
                    if done:
                        finished.add(request_id)
            sender.join()
        # An output published while the collector waits wakes it at once (not at its
        # timeout).
        woken = ("woken", True, 0, [(0, "", [5], None, None, None)], None, None)
        threading.Timer(0.05, core._queue, args=("woken", woken)).start()
        start = time.monotonic()
        batch = core.outputs(5.0)
        assert time.monotonic() - start < 2.0
        assert batch.outputs == [woken]
        # A request's outputs queued since the last call travel merged, in the order of their
        # requests' first output; an engine's failure travels alone, whatever a step in flight
        # published after it.
        for request_id, item in [
            ("two", ("two", False, 0, [(0, "a", [5], None, None, None)], None, 0.1)),
            ("failed", ("failed", False, 0, [(0, "", [6], None, None, None)], None, 0.1)),
            ("two", ("two", True, 0, [(0, "b", [7], "length", None, None)], None, 0.2)),
            ("failed", EngineDeadError("the engine stopped: boom")),
            ("failed", ("failed", False, 0, [(0, "", [8], None, None, None)], None, 0.2)),
        ]:
            core._queue(request_id, item)
        assert core.outputs(0.0).outputs == [
            ("two", True, 0, [(0, "ab", [5, 7], "length", None, None)], None, 0.2),
            ("failed", "the engine stopped: boom"),
        ]
    finally:
        core.shutdown()
    with LLM(path, kvcache_block_size=4) as reference:
        expected = reference.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    for way in ("at once", "one by one"):
        for i, out in enumerate(expected):
            assert tokens[f"{way} {i}"] == out.outputs[0].token_ids, (way, i)


def test_a_replica_core_sends_the_engines_failure_once_for_each_open_request(checkpoints):
    """Requests open when the engine stops (here: shut down mid-stream) each get one failure
    (request id, why) from the collector, after the outputs it had already sent."""
    from nano_engine.config import EngineConfig
    from nano_engine.data_parallel.replica import ReplicaCore, RequestSpec

    core = ReplicaCore(EngineConfig.from_kwargs(checkpoints("qwen3"), kvcache_block_size=4), 0)
    ids = [f"open {i}" for i in range(3)]
    try:
        longest = greedy(core.engine.max_model_len - 3)
        core.submit([RequestSpec(i, None, [1, 2, 3], longest, True, False) for i in ids])
        sent: set[str] = set()
        deadline = time.monotonic() + 60
        while sent != set(ids):  # (every request streams)
            assert time.monotonic() < deadline, "no outputs"
            batch = core.outputs(0.5)
            assert not any(out[1] for out in batch.outputs if len(out) == 6)  # none finished
            sent |= {out[0] for out in batch.outputs if len(out) == 6}
    finally:
        core.shutdown()
    batch = core.outputs(0.0)
    failures = {out[0]: out[1] for out in batch.outputs if len(out) == 2}
    assert sorted(failures) == ids
    assert all("shut down" in why for why in failures.values())
