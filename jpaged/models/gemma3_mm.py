"""Gemma 3 with images, as a plain dense forward (no KV pool): the reference the paged
engine's multimodal steps will be checked against, and the definition of how images enter
the text model.

Each image is `mm_tokens_per_image` image tokens in the sequence (between
`<start_of_image>` and `<end_of_image>`), whose embeddings are replaced by the image's
soft tokens (`models.gemma3_vision`). Attention is causal, and bidirectional among one
image's tokens: transformers' `create_masks_for_vision_model` makes full-attention layers
OR(causal, same image) and sliding layers AND(window, OR(causal, same image)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.kernels.common import apply_soft_cap
from jpaged.models.common import (
    CausalLM,
    RMSNorm,
    _project,
    apply_rope,
    lm_head,
    rope_inv_freq,
    rope_tables,
)
from jpaged.models.gemma3_vision import Gemma3Vision


def _norm(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    return x if norm is None else norm(x)


def image_blocks(tokens: jax.Array, image_token_id: int) -> jax.Array:  # int32 [T] -> [T]
    """Which image each token belongs to (0, 1, ... in order of the images' runs of image
    tokens), -1 for text: transformers' `get_block_sequence_ids_for_mask`."""
    is_image = tokens == image_token_id
    starts = is_image & ~jnp.concatenate([jnp.zeros(1, bool), is_image[:-1]])
    return jnp.where(is_image, jnp.cumsum(starts) - 1, -1).astype(jnp.int32)


def attention_mask(
    tokens: jax.Array,  # int32 [T]
    image_token_id: int,
    window: int | None,  # a sliding layer's window; None: a full-attention layer
) -> jax.Array:
    """bool `[T, T]`: query row may attend to key column."""
    t = tokens.shape[0]
    q, k = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    blocks = image_blocks(tokens, image_token_id)
    same_image = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    visible = (k <= q) | same_image
    return visible if window is None else visible & (k > q - window)


def merge_images(
    embeds: jax.Array,  # [T, hidden], the text embeddings (scaled)
    tokens: jax.Array,  # int32 [T]
    features: jax.Array,  # [N, mm_tokens_per_image, hidden], the images' soft tokens
    image_token_id: int,
) -> jax.Array:
    """`embeds` with the image tokens' rows replaced by `features`, in order (transformers'
    `masked_scatter`). The count of image tokens must equal N * mm_tokens_per_image."""
    flat = features.reshape(-1, features.shape[-1]).astype(embeds.dtype)
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image) - 1, 0, flat.shape[0] - 1)
    return jnp.where(is_image[:, None], flat[index], embeds)


def dense_logits(
    model: CausalLM,
    vision: Gemma3Vision,
    tokens: jax.Array,  # int32 [T], one sequence, N * mm_tokens_per_image image tokens
    pixels: jax.Array | None,  # [N, 3, image_size, image_size], `models.image.preprocess`d
) -> jax.Array:
    """float32 logits `[T, vocab]` at every position of one multimodal sequence: the text
    model's weights (`models.gemma3.Gemma3`) run layer by layer with dense attention.
    Jittable (`jax.jit(dense_logits)`); tokens after the sequence's end change none of its
    logits (text attends causally), so one padded length serves a whole generation."""
    c, vc = model.config, vision.config
    dtype = model.embed.embedding.dtype
    # An image token id past the vocabulary (transformers looks up 0 there) never reaches the
    # table: its row is replaced anyway.
    x = model.embed(jnp.where(tokens == vc.image_token_id, 0, tokens), None)
    x = x * jnp.asarray(c.hidden_size**0.5, dtype)
    if pixels is not None:
        x = merge_images(x, tokens, vision(pixels), vc.image_token_id)
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    sliding = c.sliding_layers or (False,) * c.num_layers
    layer_def, layer_state = nnx.split(model.layers)
    for i, slides in enumerate(sliding):
        layer = nnx.merge(layer_def, jax.tree.map(lambda a, i=i: a[i], layer_state))
        theta = c.rope_local_base_freq if slides and c.rope_local_base_freq else c.rope_theta
        scaling = None if slides else c.rope_scaling
        cos, sin = rope_tables(positions, rope_inv_freq(c.head_dim, theta, scaling), dtype)
        mask = attention_mask(tokens, vc.image_token_id, c.sliding_window if slides else None)

        h = layer.attn_norm(x)
        q, k, v = _project(layer.attn, "attn.qkv", h, None, 1)
        q = q.reshape(t, c.num_heads, c.head_dim)
        k, v = (a.reshape(t, c.num_kv_heads, c.head_dim) for a in (k, v))
        q, k = _norm(layer.attn.q_norm, q), _norm(layer.attn.k_norm, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32) * c.attn_scale
        scores = jnp.where(mask[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)
        x = x + _norm(layer.post_attn_norm, layer.attn.o(out))
        x = x + _norm(layer.post_mlp_norm, layer.mlp(layer.mlp_norm(x)))
    h = model.final_norm(x)
    weights = model.embed.embedding if model.lm_head is None else model.lm_head.kernel
    logits = lm_head(h, weights, tied=model.lm_head is None, mesh=None)
    return apply_soft_cap(logits, c.final_logit_softcapping)
