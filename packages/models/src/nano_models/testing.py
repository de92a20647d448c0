"""Tiny random checkpoints for tests, built with transformers' own classes and a tokenizer
trained locally with the tokenizers library: nothing is downloaded.

    from nano_models.testing import build_checkpoint
    path = build_checkpoint(tmp_path / "qwen3", "qwen3", num_key_value_heads=2)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

# A small vocabulary: byte-level BPE, every text encodes.
TOKENIZER_VOCAB = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # (real templates reject messages too: an unknown role here)
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler decides which requests run at every step.",
    "Prefix caching shares the blocks of a common prompt prefix.",
    "Tensor parallelism splits every layer's weights over several GPUs.",
    "Ünïcödé têxt, 中文字符, emoji 🙂 and numbers 12345 must all round-trip.",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
] * 20

ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# what a mixture of experts adds to TINY (overridable as the rest)
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

TINY = {
    "vocab_size": TOKENIZER_VOCAB + 16,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB, corpus: Iterable[str] | None = None):
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast) with Qwen-style specials and a chat
    template; <|im_end|> is its eos. Trained on ``corpus`` (a small built-in text by default)
    up to ``vocab_size`` tokens, where the corpus has that many merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS if corpus is None else corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_checkpoint(
    path: str | Path,
    architecture: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a randomly initialized transformers model (and the tiny tokenizer) to ``path``.
    ``overrides`` change the TINY config (e.g. num_key_value_heads, tie_word_embeddings,
    attention_bias, rope_parameters)."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}")
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHITECTURES[architecture])
    tokenizer_obj = build_tokenizer() if tokenizer else None
    eos = tokenizer_obj.eos_token_id if tokenizer_obj else 0
    moe = TINY_MOE if architecture.endswith("_moe") else {}
    config = config_cls(**{**TINY, **moe, "eos_token_id": eos, "bos_token_id": None, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    # transformers initializes norms to ones: random ones test that they are loaded.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_obj is not None:
        tokenizer_obj.save_pretrained(path)
    return path


def load_reference(path: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers model of a checkpoint, for comparisons (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


_FP8_LINEARS = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")


def fp8_checkpoint(
    source: str | Path, fp8: str | Path, dequantized: str | Path, block: tuple[int, int]
) -> tuple[Path, Path]:
    """An FP8 checkpoint in Qwen3-FP8's format made from ``source`` (its linear layers' weights
    in e4m3 with a float32 ``weight_scale_inv`` per ``block`` = (rows, columns), max|w| / 448
    of each block; ``quantization_config`` in config.json), and the checkpoint those FP8 weights
    stand for (each weight dequantized, in float32): the reference of the FP8 one."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, fp8, dequantized = Path(source), Path(fp8), Path(dequantized)
    bo, bi = block
    for target in (fp8, dequantized):
        shutil.copytree(source, target, dirs_exist_ok=True)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        quantized, plain = {}, {}
        for name, w in tensors.items():
            if not _FP8_LINEARS.fullmatch(name):
                quantized[name] = plain[name] = w
                continue
            rows, cols = w.shape
            padded = torch.zeros(-(-rows // bo) * bo, -(-cols // bi) * bi)
            padded[:rows, :cols] = w.float()
            blocks = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
            scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
            full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
            w8 = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale_inv"] = w8, scale
            plain[name] = w8.float() * full
        save_file(quantized, fp8 / file.name, metadata={"format": "pt"})
        save_file(plain, dequantized / file.name, metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [bo, bi],
    }
    (fp8 / "config.json").write_text(json.dumps(config, indent=2))
    plain_config = json.loads((dequantized / "config.json").read_text())
    plain_config["torch_dtype"] = plain_config["dtype"] = "float32"
    (dequantized / "config.json").write_text(json.dumps(plain_config, indent=2))
    return fp8, dequantized
