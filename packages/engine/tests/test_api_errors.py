"""Misuse of the Python API and broken checkpoints: an exception that says what was expected,
raised before anything runs; the engine keeps serving."""

from __future__ import annotations

import re
import shutil
import tracemalloc

import pytest

from nano_engine import LLM, SamplingParams
from nano_engine.outputs import Logprob


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(checkpoints("qwen3"), max_model_len=128) as llm:
        yield llm


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda llm: llm.generate(5), TypeError, "prompts must be a string.*got int 5"),
        (lambda llm: llm.generate({"a": 1}), TypeError, "prompts must be .*got dict"),
        (lambda llm: llm.generate(b"ab"), TypeError, "prompts must be .*got bytes"),
        (lambda llm: llm.generate(["ok", None]), TypeError, "prompt 1 must be a string"),
        (lambda llm: llm.generate("a", {"n": 2}), TypeError, "sampling_params must be"),
        (lambda llm: llm.generate("a", [{"n": 2}]), TypeError, "sampling_params must be"),
        (lambda llm: llm.chat("hello"), TypeError, "messages must be a list of"),
        (lambda llm: llm.chat([{"content": "x"}]), TypeError, "message 0 of conversation 0"),
        (lambda llm: llm.chat([[]]), TypeError, "conversation 0 must be a non-empty list"),
        (
            lambda llm: llm.chat([{"role": "robot", "content": "x"}]),
            ValueError,
            "chat template failed on conversation 0: unknown role robot",
        ),
    ],
)
def test_misuse_raises_what_was_expected(llm, call, error, message):
    with pytest.raises(error, match=message):
        call(llm)
    out = llm.generate("still", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_sampling_params_cannot_be_broken_after_submission(llm):
    params = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    for name, value in (("n", -1), ("top_k", "x")):
        with pytest.raises(AttributeError):  # (dataclasses.FrozenInstanceError)
            setattr(params, name, value)
    outs = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]


def test_a_checkpoint_without_a_tokenizer_is_a_start_up_error(checkpoints, tmp_path, capsys):
    from nano_engine.cli import main

    bare = tmp_path / "bare"
    shutil.copytree(checkpoints("qwen3"), bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=rf"no tokenizer in '{bare}' \(looked for tokenizer.json"):
        LLM(str(bare))
    assert main(["serve", str(bare), "--port", "1"]) == 2
    assert f"no tokenizer in '{bare}'" in capsys.readouterr().err
    with LLM(str(bare), skip_tokenizer_init=True, max_model_len=64) as llm:  # (as documented)
        assert llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("config.json", "{bad", r"config.json is not valid JSON"),
        ("config.json", "[1]", r"config.json must hold a JSON object"),
        ("generation_config.json", "[1", r"generation_config.json is not a JSON object"),
        ("tokenizer.json", "{", r"cannot load the tokenizer in '.*broken'"),
    ],
)
def test_broken_json_names_the_file(checkpoints, tmp_path, name, text, message):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints("qwen3"), broken)
    (broken / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        LLM(str(broken))


@pytest.mark.parametrize("model", [5, None, ["a"]])
def test_a_model_that_is_not_a_path_is_a_type_error(model):
    with pytest.raises(TypeError, match="model must be a checkpoint path"):
        LLM(model)


def test_logprobs_are_stored_compactly():
    """A token's 20 top logprobs take a few hundred bytes, not the ~2.3 KB of tuples."""
    rows = [
        ([t * 7 + k for k in range(20)], [-0.5 * k - 0.1 for k in range(20)]) for t in range(2000)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [Logprob(t, -0.25, list(zip(ids, values))) for t, (ids, values) in enumerate(rows)]
    per_token = (tracemalloc.get_traced_memory()[0] - before) / len(kept)
    tracemalloc.stop()
    assert per_token < 600, per_token
    assert kept[3].top == [(21 + k, pytest.approx(-0.5 * k - 0.1)) for k in range(20)]
    assert Logprob.of(1, -0.5, [2, 3], [-1.0, -2.0]) == Logprob(1, -0.5, [(2, -1.0), (3, -2.0)])


@pytest.mark.parametrize(
    "options,advice",
    [
        ({"kv_cache_memory_gb": 1e-6}, r"raise kv_cache_memory_gb \(--kv-cache-memory-gb"),
        ({"num_kvcache_blocks": 1}, r"raise num_kvcache_blocks \(--num-kvcache-blocks\)"),
    ],
)
def test_a_kv_cache_too_small_says_what_to_change_on_this_device(checkpoints, options, advice):
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_model_len 128") as e:
        LLM(checkpoints("qwen3"), max_model_len=128, device="cpu", **options)
    assert re.search(advice, str(e.value)) and "gpu_memory_utilization" not in str(e.value)


def test_attention_backends_are_checked_by_name():
    from nano_engine.config import ATTENTION_BACKENDS, EngineConfig
    from nano_models.layers.attention import BACKEND_NAMES

    assert ATTENTION_BACKENDS == BACKEND_NAMES  # (the engine's copy of the names)
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*'flash_attn'"):
        EngineConfig.from_kwargs(__file__, load_format="dummy", attention_backend="flash")
