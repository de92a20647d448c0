"""FP8 weights on the CPU: a checkpoint in Qwen3-FP8's format (e4m3 weights, block scales)
gives the logits of the checkpoint its weights stand for (dequantized, float32), for block
sizes that divide the layers and ones that do not; quantization="fp8" on a float32
checkpoint computes what per-channel weights and per-token activations in e4m3 give; bad
checkpoints and configurations are errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PagedRunner, prompts, reference_logits
from safetensors.torch import load_file, save_file

from nano_models.loader import load_model
from nano_models.quantization import FP8, BlockFp8, ChannelFp8, ExpertsFp8, dequantize
from nano_models.testing import build_checkpoint, fp8_checkpoint, load_reference


def run(runner: PagedRunner, seqs) -> list[torch.Tensor]:
    prefills = [(i, s[:-1], 0) for i, s in enumerate(seqs) if len(s) > 1]
    out = [runner.step(prefills, len(prefills))]
    out.append(runner.step([(i, s[-1:], len(s) - 1) for i, s in enumerate(seqs)], 0))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("fp8-source"), "qwen3", tokenizer=False)


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (16, 48)])
def test_an_fp8_checkpoint_gives_the_logits_of_its_dequantized_weights(source, tmp_path, block):
    """(32, 32) divides every layer; (128, 128) is larger than them (one partial block); with
    (16, 48) the merged q/k/v and gate/up parts start inside blocks."""
    fp8, plain = fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "plain", block)
    ours, reference = PagedRunner(fp8), PagedRunner(plain)
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and isinstance(qkv.quant, BlockFp8)
    assert ours.model.lm_head.weight.dtype == torch.float32  # (not quantized)
    seqs = prompts(6, ours.model.config.vocab_size, seed=2)
    for got, want in zip(run(ours, seqs), run(reference, seqs)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # transformers, on the dequantized weights, agrees too.
    hf = load_reference(plain)
    for seq in seqs[:3]:
        runner = PagedRunner(fp8)
        (logits,) = runner.step([(0, seq, 0)], 1)
        torch.testing.assert_close(logits, reference_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_quantizing_when_loading_computes_fp8_weights_and_activations(source):
    model, _ = load_model(source, dtype=torch.float32, quantization="fp8")
    layer = model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == FP8 and isinstance(layer.quant, ChannelFp8)
    full, _ = load_model(source, dtype=torch.float32)
    w = full.model.layers[1].mlp.down_proj.weight
    # Per output row: max|w| / 448, rounded to e4m3 within its step.
    scale = w.abs().amax(dim=1) / 448
    torch.testing.assert_close(layer.weight_scale, scale)
    assert ((dequantize(layer) - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-9).all()
    # A product: the activations per token in e4m3 too (independent arithmetic here).
    x = torch.randn(5, w.shape[1])
    sx = x.abs().amax(dim=1, keepdim=True) / 448
    x8 = (x / sx).to(torch.float8_e4m3fn).float() * sx
    w8 = (w / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]
    torch.testing.assert_close(layer(x), x8 @ w8.t(), atol=1e-5, rtol=1e-5)
    assert_near_unquantized(model, source)


def assert_near_unquantized(model, source) -> None:
    """The quantized model's logits stay near those of the checkpoint it was loaded from."""
    ours, reference = PagedRunner(source), PagedRunner(source)
    ours.model = model
    ours.model.bind_kv_cache(ours.cache)
    seqs = prompts(4, model.config.vocab_size, seed=3)
    for got, want in zip(run(ours, seqs), run(reference, seqs)):
        assert (got - want).norm() / want.norm() < 0.1


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("moe-source"), "qwen3_moe", tokenizer=False)


@pytest.mark.parametrize("block", [(16, 16), (32, 32), (16, 48)])
def test_an_fp8_mixture_of_experts_gives_the_logits_of_its_dequantized_weights(
    moe_source, tmp_path, block
):
    """A Qwen3-MoE checkpoint in Qwen3-FP8's format: its experts in e4m3 with block scales
    (kept a row and block of columns: (16, 48) leaves the up rows and the 32 intermediate
    columns inside blocks), its routers in the checkpoint's dtype."""
    fp8, plain = fp8_checkpoint(moe_source, tmp_path / "fp8", tmp_path / "plain", block)
    ours, reference = PagedRunner(fp8), PagedRunner(plain)
    sparse = ours.model.model.layers[0].mlp
    assert sparse.experts.w13_weight.dtype == FP8 and sparse.experts.w2_weight.dtype == FP8
    assert isinstance(sparse.experts.quant, ExpertsFp8)
    assert sparse.gate.weight.dtype == torch.float32 and sparse.gate.quant is None
    seqs = prompts(6, ours.model.config.vocab_size, seed=4)
    for got, want in zip(run(ours, seqs), run(reference, seqs)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    hf = load_reference(plain)
    for seq in seqs[:2]:
        (logits,) = PagedRunner(fp8).step([(0, seq, 0)], 1)
        torch.testing.assert_close(logits, reference_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_quantizing_a_mixture_of_experts_when_loading(moe_source):
    """quantization="fp8": each expert's rows in e4m3 with a scale a row, the products of the
    activations as they are (independent arithmetic here); the routers stay."""
    model, _ = load_model(moe_source, dtype=torch.float32, quantization="fp8")
    full, _ = load_model(moe_source, dtype=torch.float32)
    experts, dense = model.model.layers[1].mlp.experts, full.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8 and model.model.layers[1].mlp.gate.quant is None
    w13, w2 = dense.w13_weight, dense.w2_weight
    s13, s2 = (w.abs().amax(dim=2, keepdim=True) / 448 for w in (w13, w2))
    torch.testing.assert_close(experts.w13_weight_scale, s13)
    torch.testing.assert_close(experts.w2_weight_scale, s2)
    x = torch.randn(5, w13.shape[2])
    logits = torch.randn(5, w13.shape[0])
    w13_8 = (w13.double() / s13).to(FP8).double() * s13
    w2_8 = (w2.double() / s2).to(FP8).double() * s2
    weights, ids = torch.topk(torch.softmax(logits.double(), -1), experts_per_token(model), -1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = torch.zeros(5, w13.shape[2], dtype=torch.float64)
    for t in range(5):
        for slot, e in enumerate(ids[t].tolist()):
            gate, up = (w13_8[e] @ x[t].double()).chunk(2)
            want[t] += weights[t, slot] * (w2_8[e] @ (torch.nn.functional.silu(gate) * up))
    got = experts(x, logits, experts_per_token(model), True)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert_near_unquantized(model, moe_source)


def experts_per_token(model) -> int:
    return model.config.raw["num_experts_per_tok"]


def test_bad_fp8_experts_are_named(moe_source, tmp_path):
    fp8, _ = fp8_checkpoint(moe_source, tmp_path / "fp8", tmp_path / "plain", (16, 16))
    (weights,) = fp8.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    save_file({k: v for k, v in tensors.items() if k != name}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*experts\.2\.up_proj\.weight_scale_inv"):
        load_model(fp8)
    tensors[name] = tensors[name][:1]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight_scale_inv has shape"):
        load_model(fp8)


@pytest.mark.parametrize("tied", [False, True])
def test_an_fp8_lm_head_computes_e4m3_weights_and_activations(tmp_path, tied):
    source = build_checkpoint(tmp_path, "qwen3", tokenizer=False, tie_word_embeddings=tied)
    full, _ = load_model(source, dtype=torch.float32)
    plain, _ = load_model(source, dtype=torch.float32, quantization="fp8")
    assert plain.lm_head.weight.dtype == torch.float32  # (by default the head stays)
    model, _ = load_model(source, dtype=torch.float32, quantization="fp8", quantize_lm_head=True)
    head = model.lm_head
    assert head.weight.dtype == FP8 and isinstance(head.quant, ChannelFp8)
    # The embedding keeps its weight, tied to the head's or not.
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32
    torch.testing.assert_close(embedding, full.model.embed_tokens.weight, atol=0, rtol=0)
    # Per vocabulary row: max|w| / 448; the products round the activations per token too
    # (independent arithmetic here).
    w = full.lm_head.weight
    scale = w.abs().amax(dim=1) / 448
    torch.testing.assert_close(head.weight_scale, scale)
    x = torch.randn(5, w.shape[1], dtype=torch.float64)
    sx = x.abs().amax(dim=1, keepdim=True) / 448
    x8 = (x / sx).to(torch.float8_e4m3fn).double() * sx
    w8 = (w.double() / scale[:, None]).to(torch.float8_e4m3fn).double() * scale[:, None]
    got = model.logits(x.float())
    torch.testing.assert_close(got.double(), x8 @ w8.t(), atol=1e-5, rtol=1e-5)
    assert (got - full.logits(x.float())).norm() / got.norm() < 0.1
    # The rest of the model is the one quantized without the head.
    torch.testing.assert_close(
        model.model.layers[0].mlp.down_proj.weight.float(),
        plain.model.layers[0].mlp.down_proj.weight.float(),
    )


def test_an_fp8_lm_head_that_cannot_be_made_is_refused(source, tmp_path):
    with pytest.raises(ValueError, match="quantize_lm_head needs FP8 weights"):
        load_model(source, quantize_lm_head=True)
    odd = build_checkpoint(tmp_path, "qwen3", tokenizer=False, vocab_size=408)
    with pytest.raises(ValueError, match=r"LM head's 408 x 64 weight .* multiples of 16"):
        load_model(odd, quantization="fp8", quantize_lm_head=True)


def test_bad_fp8_checkpoints_and_settings_are_named(source, tmp_path):
    fp8, _ = fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "plain", (32, 32))
    (weights,) = fp8.glob("*.safetensors")
    tensors = load_file(weights)
    # A missing scale.
    broken = tmp_path / "missing"
    broken.mkdir()
    for f in fp8.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.weight_scale_inv"},
        broken / weights.name,
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match=r"missing .*mlp\.up_proj\.weight_scale_inv"):
        load_model(broken)
    # The config's block size is not the tensors'.
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (broken / "config.json").write_text(json.dumps(config))
    save_file(tensors, broken / weights.name, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape .* the model expects"):
        load_model(broken)
    # A weight that is not e4m3 where the config says FP8.
    config["quantization_config"]["weight_block_size"] = [32, 32]
    (broken / "config.json").write_text(json.dumps(config))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors[
        "model.layers.0.mlp.down_proj.weight"
    ].float()
    save_file(tensors, broken / weights.name, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.weight is torch\.float32, not float8"):
        load_model(broken)
    for q, message in (
        ({"quant_method": "awq"}, "quant_method 'awq': only fp8"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "only dynamic"),
        ({"quant_method": "fp8"}, "weight_block_size must be two positive integers"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [1, 1]}, "only e4m3"),
        ({"quant_method": "fp8", "weight_block_size": [128, 24]}, "a multiple of 16"),
    ):
        config["quantization_config"] = q
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_model(broken)
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(source, quantization="int4")


def test_dummy_fp8_weights(source):
    """A config with an FP8 quantization_config and no weights: random e4m3 weights with
    scales, as the dummy load format of any other model."""
    from nano_models import ModelConfig

    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    model, _ = load_model(ModelConfig.from_dict(config), load_format="dummy", seed=1)
    layer = model.model.layers[0].self_attn.o_proj
    assert layer.weight.dtype == FP8 and (layer.weight_scale_inv == 0.02).all()
    assert 0.5 < dequantize(layer).std() / 0.02 < 2
