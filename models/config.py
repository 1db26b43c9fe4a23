"""ModelConfig: everything the forward pass needs to know, as hashable data.

The three families differ only in these fields; `models.common.forward` reads
them. Instances are frozen and hashable so they can be static jit arguments.

Params pytree (all family ports and both loaders produce exactly this; linear
weights are stored `[in, out]`, i.e. transposed from PyTorch's `[out, in]`;
per-layer arrays are stacked with a leading `[num_layers]` axis so the layer
loop is a `lax.scan`/`fori_loop` and compiles once):

    embed        [vocab, hidden]
    final_norm   [hidden]
    lm_head      [hidden, vocab]          only when not tie_word_embeddings
    layers:
      attn_norm  [L, hidden]
      q          [L, hidden, num_heads * head_dim]
      k, v       [L, hidden, num_kv_heads * head_dim]
      o          [L, num_heads * head_dim, hidden]
      q_bias, k_bias, v_bias, o_bias    only when attention_bias
      q_norm, k_norm  [L, head_dim]       only when qk_norm
      mlp_norm   [L, hidden]              (Gemma 3: pre_feedforward_layernorm)
      gate, up   [L, hidden, intermediate]
      down       [L, intermediate, hidden]
      gate_bias, up_bias, down_bias       only when mlp_bias
      post_attn_norm, post_mlp_norm [L, hidden]   only when sandwich_norm (Gemma 3)

Norm weights are kept in Hugging Face's convention: Gemma's `(1 + w)` is
applied in the forward (`norm_plus_one`), never folded into the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("llama", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    # or ("linear", factor) or None
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    qk_norm: bool = False  # Qwen3, Gemma 3
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w)
    embed_scale: bool = False  # Gemma: embeddings * sqrt(hidden) in model dtype
    sandwich_norm: bool = False  # Gemma 3: post-attention and post-feedforward norms
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 when set
    sliding_window: int | None = None
    # per layer: True where the layer uses the sliding window (and the local RoPE base)
    sliding_layers: tuple[bool, ...] = ()
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5


@dataclasses.dataclass
class LoadedModel:
    """What `models.load` returns: config, weights on the device, tokenizer."""

    config: ModelConfig
    params: dict  # the pytree documented at the top of this module
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    generation_config: dict  # generation_config.json as a dict ({} when absent)
    source: str  # the file or directory it came from
