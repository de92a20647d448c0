"""Checkpoint loading: sharded files, dtype, dummy weights, and clear errors for bad checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import PagedRunner, prompts
from safetensors.torch import load_file, save_file

from nano_models import ModelConfig, load_model
from nano_models.testing import build_checkpoint, load_reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3", tokenizer=False)


def copy_with(checkpoint, tmp_path, edit_tensors=None, edit_config=None):
    target = tmp_path / "edited"
    shutil.copytree(checkpoint, target)
    if edit_tensors:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors")
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_sharded_checkpoint_with_an_index_loads(tmp_path):
    path = build_checkpoint(tmp_path / "one", "llama", tokenizer=False)
    sharded = tmp_path / "sharded"
    load_reference(path).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _, report = load_model(sharded, dtype=torch.float32)
    assert len(report.files) > 1
    seq = prompts(1, 100, seed=3)[0]
    a, b = PagedRunner(path), PagedRunner(sharded)
    torch.testing.assert_close(a.step([(0, seq, 0)], 1), b.step([(0, seq, 0)], 1))


def test_dtype_comes_from_the_config_or_the_override(checkpoint):
    model, _ = load_model(checkpoint)
    assert model.config.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32
    model, _ = load_model(checkpoint, dtype=torch.bfloat16)
    weights = [p for p in model.parameters() if not getattr(p, "optional", False)]
    assert {p.dtype for p in weights} == {torch.bfloat16}
    # (an FP8 cache's scales, kept in float32)
    assert {attn.k_scale.dtype for attn in model.attention_layers} == {torch.float32}
    # A dtype that is not one of the weights' dtypes: refused where it is read or set.
    raw = json.loads((checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8' in config\.json"):
        ModelConfig.from_dict({**raw, "torch_dtype": "int8"})
    with pytest.raises(ValueError, match=r"dtype_name must be one of .*, got 'fp8'"):
        dataclasses.replace(model.config, dtype_name="fp8")


def test_dummy_weights_read_no_file(checkpoint, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(checkpoint / "config.json", config_only)
    a, report = load_model(config_only, load_format="dummy", seed=1)
    b, _ = load_model(ModelConfig.from_pretrained(checkpoint), load_format="dummy", seed=1)
    assert report.bytes_read == 0 and report.files == []
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.model.norm.weight.mean().item() == pytest.approx(1.0, abs=0.05)
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(checkpoint, load_format="pt")


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = copy_with(
        checkpoint, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
    )
    # (named as the checkpoint names it, not as our packed qkv parameter)
    with pytest.raises(ValueError, match=r"missing.*'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 8)

    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape "
        r"\(64, 8\), the model expects \(64, 96\)",
    ):
        load_model(copy_with(checkpoint, tmp_path, shrink))


def test_integer_weights_are_named(checkpoint, tmp_path):
    def to_int(t):
        t["model.norm.weight"] = torch.arange(64)

    with pytest.raises(ValueError, match=r"model\.norm\.weight is torch.int64, not floating"):
        load_model(copy_with(checkpoint, tmp_path, to_int))


def test_a_tensor_in_two_files_is_named(checkpoint, tmp_path):
    path = copy_with(checkpoint, tmp_path)
    save_file({"model.norm.weight": torch.full((64,), 7.0)}, path / "zz-extra.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model\.norm\.weight is in both model\.safetensors and zz-extra\.safetensors",
    ):
        load_model(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(copy_with(checkpoint, tmp_path, add))


def test_unknown_architecture_lists_the_supported_ones(checkpoint, tmp_path):
    path = copy_with(
        checkpoint, tmp_path, edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture 'GPT2LMHeadModel'; "
        r"supported: \['LlamaForCausalLM', ",
    ):
        load_model(path)


def test_unsupported_rope_scaling_is_named(checkpoint, tmp_path):
    path = copy_with(
        checkpoint,
        tmp_path,
        edit_config=lambda c: c.update(
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"unsupported rope scaling type 'dynamic'; "
        r"supported: \['default', 'linear', 'llama3', 'yarn'\]",
    ):
        load_model(path)
    path = copy_with(
        checkpoint,
        tmp_path / "b",
        edit_config=lambda c: c.update(
            rope_parameters={"rope_type": "llama3", "factor": 2.0, "rope_theta": 10000.0}
        ),
    )
    with pytest.raises(ValueError, match="rope scaling 'llama3' needs the parameter"):
        load_model(path)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(checkpoint, tmp_path):
    """A model card's YaRN, added as rope_scaling to a config that has rope_parameters."""
    from helpers import reference_logits

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = copy_with(checkpoint, tmp_path, edit_config=lambda c: c.update(rope_scaling=yarn))
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    assert ModelConfig.from_pretrained(path).rope_scaling["rope_type"] == "yarn"
    tokens = list(range(1, 100))
    ours = PagedRunner(path).step([(0, tokens, 0)], 1)[0]
    expected = reference_logits(load_reference(path), tokens)
    plain = reference_logits(load_reference(checkpoint), tokens)
    assert (expected - plain).abs().max() > 0.1  # YaRN changes these logits
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)


def test_pickled_weights_are_never_loaded(checkpoint, tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(checkpoint / "config.json", path)
    torch.save({"x": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*never loaded"):
        load_model(path)


def test_missing_config_and_sliding_window(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(tmp_path)
    path = copy_with(
        checkpoint,
        tmp_path,
        edit_config=lambda c: c.update(
            use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None
        ),
    )
    with pytest.raises(ValueError, match="sliding-window attention"):
        load_model(path)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", tokenizer=False)


def test_a_mixture_of_experts_names_a_missing_expert_and_a_wrong_expert_count(
    moe_checkpoint, tmp_path
):
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    edited = copy_with(moe_checkpoint, tmp_path / "a", lambda t: t.pop(expert))
    with pytest.raises(ValueError, match=rf"missing from the checkpoint: \['{expert}'\]"):
        load_model(edited)
    # the config says 3 experts, the checkpoint holds 4 per layer
    fewer = copy_with(
        moe_checkpoint, tmp_path / "b", edit_config=lambda c: c.update(num_local_experts=3)
    )
    with pytest.raises(
        ValueError, match=r"experts\.3\.\w+_proj\.weight: expert 3 of a layer with 3"
    ):
        load_model(fewer)
    more = copy_with(
        moe_checkpoint, tmp_path / "c", edit_config=lambda c: c.update(num_local_experts=5)
    )
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight has shape \(4, 64\).* \(5, 64\)"):
        load_model(more)
    broken = copy_with(
        moe_checkpoint, tmp_path / "d", edit_config=lambda c: c.pop("moe_intermediate_size")
    )
    with pytest.raises(ValueError, match=r"needs \['moe_intermediate_size'\]"):
        load_model(broken)
