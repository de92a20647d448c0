"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): one implementation, with the
differences between architectures as a few flags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from nano_models.config import ModelConfig
from nano_models.context import ForwardContext
from nano_models.layers.activation import SiluAndMul
from nano_models.layers.attention import Attention, AttentionBackend
from nano_models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nano_models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nano_models.layers.norm import RMSNorm
from nano_models.layers.rotary import RotaryEmbedding
from nano_models.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary


class DecoderAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, spec: DecoderSpec, rotary: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads, spec.qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, cfg.hidden_size, spec.o_bias, tp
        )
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, hd**-0.5)

    def qkv(self, positions, norm: RMSNorm, x, residual, ctx: ForwardContext):
        """From the layer's input x and residual: (q, k, v, residual). The input norm (the
        residual added first) and the qkv projection, then q, k, v [T, (kv_)heads, head_dim],
        q and k normed and rotated; K and V stored in the cache with the rotation (one kernel
        less per layer when fused)."""
        qkv, residual, _ = self.qkv_proj.normed(norm, x, residual)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        q, k, v = self.rotary.split_qkv(
            positions,
            qkv,
            self.num_heads,
            self.num_kv_heads,
            *norms,
            kv_cache=self.attn.cache(ctx),
        )
        return q, k, v, residual


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], spec.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, spec.mlp_bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, self.act))

    def normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the norm in the gate/up product's
        prologue and SiLU-and-mul in its epilogue where they can be (``LinearBase.normed``)."""
        h, residual, _ = self.gate_up_proj.normed(norm, x, residual, act=self.act)
        return self.down_proj(h), residual


class DecoderLayer(nn.Module):
    """One layer, in the two halves around its attention call (``DecoderModel.piece``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        spec: DecoderSpec,
        rotary: RotaryEmbedding,
        tp: TensorParallel,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, spec, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def before_attention(self, positions, x, residual, ctx):
        """The input norm (the residual added first) and the attention's q, k, v (K and V to
        the cache): (q, k, v, residual)."""
        return self.self_attn.qkv(positions, self.input_layernorm, x, residual, ctx)

    def after_attention(self, o, residual):
        """From the attention's output [T, heads, head_dim] (or [T, heads * head_dim]): the
        output projection, the norm, the MLP: (x, residual) for the next layer. (The MLP
        takes the norm: at a few rows on a GPU it runs in its first product's prologue.)"""
        x = self.self_attn.o_proj(o.flatten(1))
        return self.mlp.normed(self.post_attention_layernorm, x, residual)


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        spec: DecoderSpec,
        tp: TensorParallel,
        mlp: Callable[[int], nn.Module] | None = None,
    ) -> None:
        """``mlp(i)``: layer i's MLP (default: the gated MLP of every dense model)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        mlp = mlp or (lambda i: DecoderMLP(cfg, spec, tp))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, spec, rotary, tp, mlp(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, ctx):
        state, out = input_ids, None
        for i, layer in enumerate(self.layers):
            q, k, v, state = self.piece(i, positions, state, out, ctx)
            out = layer.self_attn.attn(q, k, v, ctx)
        return self.piece(len(self.layers), positions, state, out, ctx)

    def piece(self, i, positions, state, attn_out, ctx):
        """Piece ``i`` of the forward cut at its attention calls (what a piecewise CUDA graph
        holds): piece 0 embeds the ids (``state``) and computes layer 0's q, k, v; piece i
        finishes layer i - 1 from its attention output and residual (``state``) and computes
        layer i's q, k, v; the last piece finishes the last layer and returns the normed hidden
        states. Returns (q, k, v, residual) or the hidden states. Of ``ctx`` a piece reads only
        the slot mapping (where K and V go)."""
        if i == 0:
            x, residual = self.embed_tokens(state), None
        else:
            x, residual = self.layers[i - 1].after_attention(attn_out, state)
        if i == len(self.layers):
            return self.norm(x, residual)[0]
        return self.layers[i].before_attention(positions, x, residual, ctx)


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over a paged KV cache.

    ``forward(input_ids [T], positions [T], ctx)`` returns hidden states [T, hidden];
    ``compute_logits(hidden, ctx)`` the logits [S, vocab] of the rows in ctx.logits_indices
    (None on tensor-parallel ranks other than 0).
    """

    spec: ClassVar[DecoderSpec]
    # checkpoint name fragment -> (our parameter's fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        spec = self.spec_for(cfg)
        self.model = DecoderModel(cfg, spec, tp, lambda i: self.make_mlp(cfg, spec, tp, i))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> DecoderSpec:
        return cls.spec

    @classmethod
    def make_mlp(
        cls, cfg: ModelConfig, spec: DecoderSpec, tp: TensorParallel, layer: int
    ) -> nn.Module:
        """Layer ``layer``'s MLP (a mixture of experts overrides this)."""
        return DecoderMLP(cfg, spec, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    @property
    def num_pieces(self) -> int:
        """Pieces of the forward cut at its attention calls (``piece``): layers + 1."""
        return len(self.model.layers) + 1

    def piece(self, i, positions, state, attn_out, ctx):
        """``DecoderModel.piece``: the forward between attention calls i - 1 and i."""
        return self.model.piece(i, positions, state, attn_out, ctx)

    def compute_logits(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        return self.logits(hidden[ctx.logits_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits [R, vocab] of hidden states [R, hidden] (None on tensor-parallel ranks
        other than 0)."""
        return self.lm_head(hidden)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, backend: AttentionBackend | None = None
    ) -> None:
        """Give every layer its view of ``kv_cache`` [layers, 2, blocks, kv_heads, block_size,
        head_dim] (``nano_kvcache.layout``) and, optionally, an attention backend."""
        layers = self.attention_layers
        if kv_cache.shape[0] != len(layers):
            raise ValueError(f"the cache has {kv_cache.shape[0]} layers, the model {len(layers)}")
        for i, attn in enumerate(layers):
            attn.bind(kv_cache[i, 0], kv_cache[i, 1], backend)
