"""The model math every family shares, and the one forward for prefill and decode.

Parity with Hugging Face transformers is the definition of correct, so each
piece follows the reference's order of operations and dtype casts
(`transformers/models/{llama,qwen3,gemma3}/modeling_*.py`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jpaged.cache import kv_pool
from jpaged.cache.groups import KVGroups
from jpaged.cache.kv_pool import KVPool
from jpaged.kernels.common import apply_soft_cap, ieee_float32
from jpaged.kernels.ragged_attention import Ragged, ragged_paged_attention
from models import sharding
from models.config import ModelConfig

# A full-attention layer's window in a model that also has sliding layers: every key is
# visible, and `position - NO_WINDOW` cannot overflow int32 for any position >= 0.
NO_WINDOW = int(np.iinfo(np.int32).max)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:  # Gemma scales by (1 + w) in float32, then casts
        return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * normed.astype(x.dtype)  # Llama casts first, then scales


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """float32 [head_dim // 2], as modeling_rope_utils computes it (default/linear/llama3)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.float32(theta) ** exponent).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling[0] == "linear":
        return (inv_freq / np.float32(scaling[1])).astype(np.float32)
    if scaling[0] == "llama3":
        _, factor, low_freq_factor, high_freq_factor, old_context_len = scaling
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope scaling {scaling[0]!r}")


def rope_tables(
    positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[T, 1, head_dim]`, computed in float32 and cast like transformers does."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- blocks


def _linear(x: jax.Array, p: dict, name: str) -> jax.Array:
    y = x @ p[name]
    bias = p.get(f"{name}_bias")
    return y if bias is None else y + bias


def mlp(p: dict, x: jax.Array, act: str) -> jax.Array:
    gate = _linear(x, p, "gate")
    gate = jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    return _linear(gate * _linear(x, p, "up"), p, "down")


class LayerInputs(NamedTuple):
    """What every layer of one forward reads besides its weights (device arrays)."""

    slots: jax.Array  # int32 [T] flat slot of each token's K/V, 0 (null block) for padding
    meta: Ragged  # the step's attention metadata, block ids of this layer's group
    cos: jax.Array  # [T, 1, D], this layer's RoPE base
    sin: jax.Array
    window: jax.Array | None  # int32 [], this layer's window; None when no layer slides


def attention(
    p: dict,  # this layer's params
    x: jax.Array,  # [T, hidden], already normed
    kv: KVPool,
    layer: jax.Array,
    inputs: LayerInputs,
    config: ModelConfig,
    impl: str,
    mesh: Mesh | None,
) -> tuple[jax.Array, KVPool]:
    c = config
    t = x.shape[0]
    q = _linear(x, p, "q").reshape(t, c.num_heads, c.head_dim)
    k = _linear(x, p, "k").reshape(t, c.num_kv_heads, c.head_dim)
    v = _linear(x, p, "v").reshape(t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps, c.norm_plus_one)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps, c.norm_plus_one)
    q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
    window = () if inputs.window is None else (inputs.window,)

    def attend(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv: KVPool,
        layer: jax.Array,
        slots: jax.Array,
        m: Ragged,
        window: tuple,
    ) -> tuple[jax.Array, KVPool]:
        kv = kv_pool.write(kv, layer, slots, k, v)
        # The kernels see every layer's pool as one, this layer's pages offset into it: no
        # layer is ever sliced out (a copy) of the pool.
        m = m._replace(
            **{
                name: getattr(m, name)
                .at[0]
                .set(kv_pool.layer_blocks(kv, layer, getattr(m, name)[0]))
                for name in ("single", "tiled")
            },
            block_tables=kv_pool.layer_blocks(kv, layer, m.block_tables),
        )
        out, pools = ragged_paged_attention(
            q,
            kv.k,
            kv.v,
            m,
            k_scale=kv.k_scale,
            v_scale=kv.v_scale,
            scale=c.attn_scale,
            sliding_window=window[0] if window else None,
            soft_cap=c.attn_logit_softcapping,
            impl=impl,
        )
        return out, KVPool(*pools)

    if mesh is not None:  # each device attends with its own heads over its share of the pool
        heads, pool = P(None, sharding.AXIS, None), jax.tree.map(lambda _: sharding.pool_spec(), kv)
        specs = (heads, heads, heads, pool, P(), P(), P(), P())
        # (check_vma off: the kernels' loops mix per-device and replicated carries)
        attend = jax.shard_map(
            attend, mesh=mesh, in_specs=specs, out_specs=(heads, pool), check_vma=False
        )
    out, kv = attend(q, k, v, kv, layer, inputs.slots, inputs.meta, window)
    return _linear(out.reshape(t, -1), p, "o"), kv


def decoder_layer(
    p: dict,
    x: jax.Array,
    kv: KVPool,
    layer: jax.Array,
    inputs: LayerInputs,
    config: ModelConfig,
    impl: str,
    mesh: Mesh | None,
) -> tuple[jax.Array, KVPool]:
    c = config

    def norm(h: jax.Array, name: str) -> jax.Array:
        return rms_norm(h, p[name], c.rms_norm_eps, c.norm_plus_one)

    h, kv = attention(p, norm(x, "attn_norm"), kv, layer, inputs, c, impl, mesh)
    if c.sandwich_norm:
        h = norm(h, "post_attn_norm")
    x = x + h
    h = mlp(p, norm(x, "mlp_norm"), c.hidden_act)
    if c.sandwich_norm:
        h = norm(h, "post_mlp_norm")
    return x + h, kv


# --------------------------------------------------------------------------- forward


def forward(
    params: dict,
    kv: KVPool,
    tokens: jax.Array,  # int32 [T], every sequence's new tokens in a row, then padding
    meta: Ragged,  # from `ragged_attention.plan`, block_tables [G, S, W] (or [S, W]: G = 1)
    rows: jax.Array,  # int32 [R]: the tokens whose logits are wanted (each sequence's last)
    *,
    config: ModelConfig,
    attention_impl: str = "xla",
    mesh: Mesh | None = None,
    groups: KVGroups | None = None,
    head: bool = True,
) -> tuple[jax.Array, KVPool]:
    """Write every layer's new K/V into the pool and return float32 logits `[R, vocab]`
    of the tokens `rows` index (garbage but finite for padding); without the LM `head`,
    their final (normed) hidden states `[R, hidden]` in float32 instead (embeddings).

    `groups` (`jpaged.cache.groups`): which layers share a page table (`meta`'s tables,
    one per group) and a block; None: one group of every layer.

    With a `mesh` the params and pool lie on it as `models.sharding` says; the logits
    come back replicated, so sampling runs once on every device alike."""
    c = config
    dtype = params["embed"].dtype
    groups = groups or KVGroups.of(c.num_layers)
    positions = jnp.asarray(meta.positions, jnp.int32)
    tables = jnp.asarray(meta.block_tables, jnp.int32).reshape(
        groups.num_groups, *np.shape(meta.block_tables)[-2:]
    )
    slots = jax.vmap(kv_pool.slot_mapping, in_axes=(0, None, None, None))(
        tables, meta.seq_of, positions, kv.block_size
    )  # [G, T]

    x = embed_tokens(params["embed"], tokens, mesh)
    if c.embed_scale:  # transformers rounds sqrt(hidden) to the model dtype first
        x = x * jnp.asarray(c.hidden_size**0.5, dtype)

    # One RoPE table per base in use; each layer picks its own inside the loop.
    sliding = np.asarray(c.sliding_layers or (False,) * c.num_layers)
    inv_freqs = [rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)]
    if c.rope_local_base_freq is not None and sliding.any():
        inv_freqs.append(rope_inv_freq(c.head_dim, c.rope_local_base_freq, None))
    ropes = [rope_tables(positions, f, dtype) for f in inv_freqs]
    cos_all = jnp.stack([cos for cos, _ in ropes])
    sin_all = jnp.stack([sin for _, sin in ropes])
    rope_index = jnp.asarray(sliding & (len(inv_freqs) > 1), jnp.int32)
    has_window = c.sliding_window is not None and sliding.any()
    windows = jnp.asarray(np.where(sliding, c.sliding_window or 0, NO_WINDOW), jnp.int32)
    meta = Ragged(*(jnp.asarray(a, jnp.int32) for a in meta))
    # Each group's metadata, once a step rather than once a layer (one group: the plan's
    # work items hold its blocks already).
    metas = (
        None
        if groups.num_groups == 1
        else jax.vmap(lambda t: group_meta(meta, t, kv.block_size))(tables)
    )

    def body(carry: tuple[jax.Array, KVPool], xs: tuple) -> tuple[tuple[jax.Array, KVPool], None]:
        x, kv = carry
        p, group, slot, r, window = xs
        m = (
            meta._replace(block_tables=tables[0])
            if metas is None
            else jax.tree.map(lambda a: a[group], metas)
        )
        inputs = LayerInputs(
            slots[group], m, cos_all[r], sin_all[r], window if has_window else None
        )
        return decoder_layer(p, x, kv, slot, inputs, c, attention_impl, mesh), None

    group_of, slot_of = (jnp.asarray(a) for a in groups.layer_index())
    with ieee_float32(dtype):
        (x, kv), _ = lax.scan(
            body, (x, kv), (params["layers"], group_of, slot_of, rope_index, windows)
        )
        # Only the rows asked for reach the LM head (each sequence's last new token, and
        # prompt tokens scored for prompt logprobs): never [T, vocab].
        h = x[jnp.asarray(rows, jnp.int32)]
        h = rms_norm(h, params["final_norm"], c.rms_norm_eps, c.norm_plus_one)
        if not head:
            return h.astype(jnp.float32), kv
        logits = lm_head(h, params, c.tie_word_embeddings, mesh)
    return apply_soft_cap(logits, c.final_logit_softcapping), kv


def group_meta(
    meta: Ragged,  # the step's, work items holding group 0's blocks
    table: jax.Array,  # int32 [S, W]: one group's page tables
    block_size: int,
) -> Ragged:
    """`meta` with one KV group's blocks: its tables, and each work item's block looked up
    from its sequence and page (the items themselves are the same for every group)."""

    def blocks(work: jax.Array) -> jax.Array:  # int32 [3, P] -> [P]
        seq = jnp.take(meta.seq_of, work[1], mode="fill", fill_value=table.shape[0])
        pages = jnp.take(table, seq, axis=0, mode="fill", fill_value=0)
        return jnp.take_along_axis(pages, (work[2] // block_size)[:, None], axis=1)[:, 0]

    return meta._replace(
        block_tables=table,
        single=meta.single.at[0].set(blocks(meta.single)),
        tiled=meta.tiled.at[0].set(blocks(meta.tiled)),
    )


def lm_head(h: jax.Array, params: dict, tied: bool, mesh: Mesh | None) -> jax.Array:
    """float32 logits `[S, vocab]` of hidden states `h` `[S, hidden]`. With a mesh each
    device scores its shard of the vocabulary and the scores are all-gathered: only
    `[S, vocab]` crosses devices, never the table."""
    key = "embed" if tied else "lm_head"

    def scores(h: jax.Array, w: jax.Array) -> jax.Array:
        spec = "bh,vh->bv" if tied else "bh,hv->bv"
        return jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)

    if mesh is None:
        return scores(h, params[key])

    def local(h: jax.Array, w: jax.Array) -> jax.Array:
        return lax.all_gather(scores(h, w), sharding.AXIS, axis=1, tiled=True)

    spec = sharding.spec(key, layer=False)
    # (check_vma off: an all-gather's result is the same on every device, which the
    # checker cannot see)
    gathered = jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=P(), check_vma=False)
    return gathered(h, params[key])


def embed_tokens(table: jax.Array, tokens: jax.Array, mesh: Mesh | None) -> jax.Array:
    """`table[tokens]`; with a mesh each device looks up the tokens in its rows of the
    vocabulary and the rows are summed across devices (vocabulary-parallel embedding)."""
    if mesh is None:
        return table[tokens]

    def local(rows: jax.Array, tokens: jax.Array) -> jax.Array:
        i = tokens - lax.axis_index(sharding.AXIS) * rows.shape[0]
        mine = (i >= 0) & (i < rows.shape[0])
        found = jnp.where(mine[:, None], rows[jnp.clip(i, 0, rows.shape[0] - 1)], 0)
        return lax.psum(found, sharding.AXIS)

    spec = sharding.spec("embed", layer=False)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=P())(table, tokens)
