"""ModelConfig: everything the model needs to know, as hashable data.

The three families differ only in these fields; the shared blocks of
`models.common` read them. Instances are frozen and hashable: a module's config is
part of its `nnx.GraphDef`, a static argument of the jitted step.

The module's state (`nnx.state(model)`; both loaders fill exactly this; linear
kernels are `[in, out]`, i.e. transposed from PyTorch's `[out, in]`; the layers'
weights are stacked with a leading `[num_layers]` axis so the layer loop is a
`lax.scan` and compiles once):

    embed.embedding        [vocab, hidden]
    final_norm.scale       [hidden]
    lm_head.kernel         [hidden, vocab]          only when not tie_word_embeddings
    layers.
      attn_norm.scale      [L, hidden]
      attn.qkv.kernel      [L, hidden, (num_heads + 2 * num_kv_heads) * head_dim]
      attn.o.kernel        [L, num_heads * head_dim, hidden]
      attn.{qkv,o}.bias                         only when attention_bias
      attn.q_norm.scale, attn.k_norm.scale [L, head_dim]   only when qk_norm
      mlp_norm.scale       [L, hidden]          (Gemma 3: pre_feedforward_layernorm)
      mlp.gate_up.kernel   [L, hidden, 2 * intermediate]
      mlp.down.kernel      [L, intermediate, hidden]
      mlp.{gate_up,down}.bias                   only when mlp_bias
      post_attn_norm.scale, post_mlp_norm.scale [L, hidden]   only when sandwich_norm

`qkv` and `gate_up` hold the checkpoint's q, k, v and gate, up side by side
(`models.fused`); with `fused_projections` off they are `attn.{q,k,v}` and `mlp.{gate,up}`
(`[L, hidden, num_heads * head_dim]`, `[L, hidden, num_kv_heads * head_dim]` twice,
`[L, hidden, intermediate]` twice), the names the loaders map checkpoints to.

Norm weights are kept in Hugging Face's convention: Gemma's `(1 + w)` is
applied in the forward (`norm_plus_one`), never folded into the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen3moe")
# (tensor name, file, shape, read): a checkpoint tensor, read on demand (PyTorch's
# orientation): a NumPy array, or a GGUF matrix's `gguf_blocks.Blocks` kept quantized
TensorEntry = tuple[str, str, tuple[int, ...], Callable[[], Any]]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (`models.moe`): `num_experts` SwiGLU experts of
    `intermediate_size`, `top_k` routed a token (softmax over all experts, then the top k,
    renormalised to sum 1 when `norm_topk_prob`); `sparse_layers`: per layer, True where the
    layer's MLP is the experts (else the dense `ModelConfig.intermediate_size` MLP).
    `expert_parallel`: on a mesh, whole experts a device (tokens replicated, one reduction)
    rather than each expert's intermediate dimension split."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    expert_parallel: bool = False


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
    # q/k/v and gate/up each one matrix (`models.fused`); the loader turns it off where a
    # checkpoint holds the parts in different quantized forms
    fused_projections: bool = True
    moe: MoEConfig | None = None  # a mixture-of-experts model's experts (`models.moe`)

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5
