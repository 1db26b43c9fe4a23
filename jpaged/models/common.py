"""The blocks every family shares (`flax.nnx` modules) and the one forward for prefill and decode.

Parity with Hugging Face transformers is the definition of correct, so each
piece follows the reference's order of operations and dtype casts
(`transformers/models/{llama,qwen3,gemma3}/modeling_*.py`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jpaged.cache import kv_pool
from jpaged.cache.groups import KVGroups
from jpaged.cache.kv_pool import KVPool
from jpaged.kernels import ragged_plan
from jpaged.kernels.common import apply_soft_cap, ieee_float32, on_gpu
from jpaged.kernels.ragged_attention import ragged_paged_attention
from jpaged.kernels.ragged_plan import Ragged
from jpaged.models import fused as fused_mod
from jpaged.models import lora, qdot, quant, sharding
from jpaged.models.config import ModelConfig

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


def _param(value: jax.Array, split: tuple | None = None, kv: bool = False) -> nnx.Param:
    """A weight; `split`: its axes' names on the tensor-parallel mesh (None: replicated),
    `kv`: a k/v weight whose heads repeat when devices outnumber KV heads
    (`models.sharding.repeat_kv`). Placement is the loader's, never eager."""
    meta: dict[str, Any] = {"eager_sharding": False}
    if split is not None:
        meta["out_sharding"] = split
    if kv:
        meta["kv_heads"] = True
    return nnx.Param(value, **meta)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return nnx.initializers.normal(0.02)(rngs.params(), shape, dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, config: ModelConfig, *, dtype: Any) -> None:
        # Gemma stores w for a (1 + w) scale: zeros are its identity, ones Llama's.
        init = jnp.zeros if config.norm_plus_one else jnp.ones
        self.scale = _param(init((dim,), dtype))
        self.eps, self.plus_one = config.rms_norm_eps, config.norm_plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.plus_one)


class Linear(nnx.Module):
    """`x @ kernel (+ bias)`, the kernel `[in, out]` (PyTorch's transposed). Tensor
    parallelism splits its `out` axis (`column`: each device its heads or its slice of the
    MLP) or its `in` axis (row-parallel: XLA all-reduces the partial sums)."""

    def __init__(
        self,
        din: int,
        dout: int,
        *,
        bias: bool,
        column: bool,
        dtype: Any,
        rngs: nnx.Rngs,
        kv: bool = False,
    ) -> None:
        split = (None, sharding.AXIS) if column else (sharding.AXIS, None)
        self.kernel = _param(_normal(rngs, (din, dout), dtype), split, kv)
        bias_split = (sharding.AXIS,) if column else None  # a row-parallel bias is added once
        self.bias = _param(jnp.zeros((dout,), dtype), bias_split, kv) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = quant.matmul(x, self.kernel)
        return y if self.bias is None else y + self.bias[...]


def _projections(
    owner: MLP | Attention,
    group: str,
    din: int,
    config: ModelConfig,
    *,
    bias: bool,
    dtype: Any,
    rngs: nnx.Rngs,
) -> None:
    """Give `owner` the column-parallel projections of fused `group` (`models.fused`: e.g.
    "attn.qkv"): one Linear of all its parts side by side, or one Linear each."""
    owner.widths = fused_mod.widths(config)[group]
    if config.fused_projections:
        linear = Linear(din, sum(owner.widths), bias=bias, column=True, dtype=dtype, rngs=rngs)
        setattr(owner, group.split(".")[1], linear)
        return
    for part, dout in zip(fused_mod.GROUPS[group], owner.widths, strict=True):
        kv = part in fused_mod.KV_PARTS
        linear = Linear(din, dout, bias=bias, column=True, dtype=dtype, rngs=rngs, kv=kv)
        setattr(owner, part.split(".")[1], linear)


def _project(
    owner: MLP | Attention,
    group: str,
    x: jax.Array,
    adapters: lora.LoRALayer | None,
    devices: int,
) -> list[jax.Array]:
    """`owner`'s projections of fused `group` (`_projections`) of `x`, each with its LoRA
    delta, in the group's order."""
    names = [part.split(".")[1] for part in fused_mod.GROUPS[group]]
    linear = getattr(owner, group.split(".")[1], None)
    if linear is None:
        ys = [getattr(owner, name)(x) for name in names]
    else:
        ys = fused_mod.split(linear(x), owner.widths, devices)
    return [lora.apply(adapters, name, x, y) for name, y in zip(names, ys, strict=True)]


class MLP(nnx.Module):
    widths: tuple[int, ...]  # gate's and up's (`_projections`)

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c = config
        h, i, bias = c.hidden_size, c.intermediate_size, c.mlp_bias
        _projections(self, "mlp.gate_up", h, c, bias=bias, dtype=dtype, rngs=rngs)
        self.down = Linear(i, h, bias=bias, column=False, dtype=dtype, rngs=rngs)
        self.act = c.hidden_act

    def __call__(
        self, x: jax.Array, adapters: lora.LoRALayer | None = None, devices: int = 1
    ) -> jax.Array:
        gate, up = _project(self, "mlp.gate_up", x, adapters, devices)
        gate = jax.nn.silu(gate) if self.act == "silu" else jax.nn.gelu(gate, approximate=True)
        h = gate * up
        return lora.apply(adapters, "down", h, self.down(h))


class LayerInputs(NamedTuple):
    """What every layer of one forward reads besides its weights (device arrays)."""

    meta: Ragged  # the step's attention metadata, block ids of this layer's group
    cos: jax.Array  # [T, 1, D], this layer's RoPE base
    sin: jax.Array
    window: jax.Array | None  # int32 [], this layer's window; None when no layer slides
    adapters: lora.LoRALayer | None = None  # this layer's LoRA adapters; None: LoRA off
    layer_index: jax.Array | None = None  # int32 []: the layer's place in the stack


class Attention(nnx.Module):
    """Self-attention over the paged KV pool, which it is handed and hands back (the pool is
    the engine's, shared by every layer: never a field of the module)."""

    widths: tuple[int, ...]  # q's, k's and v's (`_projections`)

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c = config
        h, q_out, bias = c.hidden_size, c.num_heads * c.head_dim, c.attention_bias
        _projections(self, "attn.qkv", h, c, bias=bias, dtype=dtype, rngs=rngs)
        self.o = Linear(q_out, h, bias=bias, column=False, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(c.head_dim, c, dtype=dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c, dtype=dtype) if c.qk_norm else None
        self.config = c

    def __call__(
        self,
        x: jax.Array,  # [T, hidden], already normed
        kv: KVPool,
        layer: jax.Array,
        inputs: LayerInputs,
        impl: str,
        mesh: Mesh | None,
    ) -> tuple[jax.Array, KVPool]:
        c = self.config
        t = x.shape[0]
        ad = inputs.adapters
        devices = 1 if mesh is None else mesh.size
        q, k, v = _project(self, "attn.qkv", x, ad, devices)
        q = q.reshape(t, c.num_heads, c.head_dim)
        k, v = (a.reshape(t, c.num_kv_heads, c.head_dim) for a in (k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
        window = () if inputs.window is None else (inputs.window,)

        def attend(
            q: jax.Array,
            k: jax.Array,
            v: jax.Array,
            kv: KVPool,
            layer: jax.Array,
            m: Ragged,
            window: tuple,
        ) -> tuple[jax.Array, KVPool]:
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
                # written first (by the Pallas kernel itself where it can: no scatter launch)
                new_kv=(k, v),
            )
            return out, KVPool(*pools)

        if mesh is not None:  # each device attends with its own heads over its share of the pool
            heads = P(None, sharding.AXIS, None)
            pool = jax.tree.map(lambda _: sharding.pool_spec(), kv)
            specs = (heads, heads, heads, pool, P(), P(), P())
            # (check_vma off: the kernels' loops mix per-device and replicated carries)
            attend = jax.shard_map(
                attend, mesh=mesh, in_specs=specs, out_specs=(heads, pool), check_vma=False
            )
        out, kv = attend(q, k, v, kv, layer, inputs.meta, window)
        out = out.reshape(t, -1)
        return lora.apply(ad, "o", out, self.o(out)), kv


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c, h = config, config.hidden_size
        self.attn_norm = RMSNorm(h, c, dtype=dtype)
        self.attn = Attention(c, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(h, c, dtype=dtype) if c.sandwich_norm else None
        self.mlp_norm = RMSNorm(h, c, dtype=dtype)  # Gemma 3: pre_feedforward_layernorm
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)
        self.post_mlp_norm = RMSNorm(h, c, dtype=dtype) if c.sandwich_norm else None

    def __call__(
        self,
        x: jax.Array,
        kv: KVPool,
        layer: jax.Array,
        inputs: LayerInputs,
        impl: str,
        mesh: Mesh | None,
    ) -> tuple[jax.Array, KVPool]:
        h, kv = self.attn(self.attn_norm(x), kv, layer, inputs, impl, mesh)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.feed_forward(self.mlp_norm(x), inputs, mesh)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h, kv

    def feed_forward(self, y: jax.Array, inputs: LayerInputs, mesh: Mesh | None) -> jax.Array:
        """The layer's MLP over its normed input (a mixture of experts' layer picks its
        experts here: `models.qwen3_moe`)."""
        return self.mlp(y, inputs.adapters, 1 if mesh is None else mesh.size)


class Embedder(nnx.Module):
    """The token table `[vocab, hidden]`; with a mesh each device holds 1/N of its rows
    (vocabulary-parallel)."""

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        shape = (config.vocab_size, config.hidden_size)
        self.embedding = _param(_normal(rngs, shape, dtype), (sharding.AXIS, None))

    def __call__(self, tokens: jax.Array, mesh: Mesh | None) -> jax.Array:
        """`table[tokens]`; with a mesh each device looks up the tokens in its rows of the
        vocabulary and the rows are summed across devices."""
        w = self.embedding
        if isinstance(w, quant.QuantWeight) and w.transposed:  # held as a tied head's kernel
            return quant.take_columns(w, tokens)
        parts, dtype = quant.held(w)[0], w.dtype  # a table: no layer of a stack
        if mesh is None:
            return quant.take_rows(parts, tokens, dtype)

        def local(parts: tuple[jax.Array, ...], tokens: jax.Array) -> jax.Array:
            rows = parts[0].shape[0]
            i = tokens - lax.axis_index(sharding.AXIS) * rows
            mine = (i >= 0) & (i < rows)
            found = quant.take_rows(parts, jnp.clip(i, 0, rows - 1), dtype)
            return lax.psum(jnp.where(mine[:, None], found, 0), sharding.AXIS)

        in_specs = (quant.specs(w), P())
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(parts, tokens)


class CausalLM(nnx.Module):
    """A decoder-only LM of any of the three families (their differences are `config` data),
    its layers' weights stacked on a leading `[num_layers]` axis and scanned.

    `model(kv, tokens, meta, rows)` writes every layer's new K/V into the paged pool `kv`
    and returns the logits of the tokens `rows` index and the pool; `forward` is the same
    call on the split module (`nnx.split`), as the engine's jitted step makes it."""

    layer_class: type[DecoderLayer] = DecoderLayer  # a family's own (`models.qwen3_moe`)

    def __init__(self, config: ModelConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        c = config
        self.config = c
        self.embed = Embedder(c, dtype=dtype, rngs=rngs)

        # One DecoderLayer whose weights carry a leading [num_layers] axis, never split
        # over the mesh: what `lax.scan` slices in `__call__`.
        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def stacked(rngs: nnx.Rngs) -> DecoderLayer:
            return self.layer_class(c, dtype=dtype, rngs=rngs)

        self.layers = stacked(rngs)
        self.final_norm = RMSNorm(c.hidden_size, c, dtype=dtype)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else Linear(
                c.hidden_size, c.vocab_size, bias=False, column=True, dtype=dtype, rngs=rngs
            )
        )

    def __call__(
        self,
        kv: KVPool,
        tokens: jax.Array,  # int32 [T], every sequence's new tokens in a row, then padding
        meta: Ragged,  # from `ragged_plan.plan`, block_tables [G, S, W] (or [S, W]: G = 1)
        rows: jax.Array,  # int32 [R]: the tokens whose logits are wanted (each sequence's last)
        *,
        attention_impl: str = "xla",
        mesh: Mesh | None = None,
        groups: KVGroups | None = None,
        adapters: lora.LoRABatch | None = None,
        head: bool = True,
        images: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVPool]:
        """Write every layer's new K/V into the pool and return float32 logits `[R, vocab]`
        of the tokens `rows` index (garbage but finite for padding); without the LM `head`,
        their final (normed) hidden states `[R, hidden]` in float32 instead (embeddings).

        `groups` (`jpaged.cache.groups`): which layers share a page table (`meta`'s tables,
        one per group) and a block; None: one group of every layer.

        With a `mesh` the weights and pool lie on it as their partition specs say; the
        logits come back replicated, so sampling runs once on every device alike.

        `adapters`: LoRA adapters and each token's slot among them (`models.lora`).

        `images`: (features [M, hidden], at int32 [T]): token t's embedding is row `at[t]`
        of the images' soft tokens where `at[t] >= 0` (`models.gemma3_mm.merge_images`)."""
        with qdot.unsplit(mesh is None):
            return self._forward(
                kv, tokens, meta, rows, attention_impl, mesh, groups, adapters, head, images
            )

    def _forward(
        self,
        kv: KVPool,
        tokens: jax.Array,
        meta: Ragged,
        rows: jax.Array,
        attention_impl: str,
        mesh: Mesh | None,
        groups: KVGroups | None,
        adapters: lora.LoRABatch | None,
        head: bool,
        images: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVPool]:
        c = self.config
        dtype = self.embed.embedding.dtype
        groups = groups or KVGroups.of(c.num_layers)
        positions = jnp.asarray(meta.positions, jnp.int32)
        tables = jnp.asarray(meta.block_tables, jnp.int32).reshape(
            groups.num_groups, *np.shape(meta.block_tables)[-2:]
        )

        if images is not None:  # (an image token's id may lie past the vocabulary)
            tokens = jnp.where(images[1] >= 0, 0, tokens)
        x = self.embed(tokens, mesh)
        if c.embed_scale:  # transformers rounds sqrt(hidden) to the model dtype first
            x = x * jnp.asarray(c.hidden_size**0.5, dtype)
        if images is not None:
            features, at = images
            image = features[jnp.maximum(at, 0)].astype(x.dtype)
            x = jnp.where((at >= 0)[:, None], image, x)

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
        # The layers are scanned (unrolled on a GPU, below): the scan slices one layer's
        # state out of the stacked state and the body merges it back into a layer. Where
        # the CPU kernels may read the quantized weights, and on a GPU, those stay whole
        # and are read in place (as a MixedWeight's stacks always are: none is as deep as
        # the scan).
        in_place = qdot.stacks() or on_gpu() or quant.has_mixed(self.layers)
        # weights marked `whole` (a mixture's experts, `models.moe`) are never sliced either:
        # their layer's routed experts are gathered from the stack where they lie
        whole = quant.whole(self.layers)
        split: tuple[Any, ...] = (
            nnx.split(self.layers, quant.in_place(self.layers, whole), ...)
            if in_place
            else nnx.split(self.layers, whole, ...)
            if whole is not None
            else nnx.split(self.layers)
        )
        layer_def, *held, layer_state = split
        onehot, lora_weights = (
            (None, None)
            if adapters is None
            else (
                lora.onehot(adapters.slots, lora.num_slots(adapters), dtype),
                adapters.weights,
            )
        )

        def body(
            carry: tuple[jax.Array, KVPool], xs: tuple
        ) -> tuple[tuple[jax.Array, KVPool], None]:
            x, kv = carry
            state, index, group, slot, r, window, lora_layer = xs
            m = (
                meta._replace(block_tables=tables[0])
                if metas is None
                else jax.tree.map(lambda a: a[group], metas)
            )
            inputs = LayerInputs(
                m,
                cos_all[r],
                sin_all[r],
                window if has_window else None,
                None if onehot is None else lora.LoRALayer(onehot, lora_layer),
                index,
            )
            layer = nnx.merge(layer_def, *held, state)
            if in_place:
                quant.read_in_place(layer, index)
            elif whole is not None:
                quant.read_in_place(layer, index, whole_only=True)
            return layer(x, kv, slot, inputs, attention_impl, mesh), None

        group_of, slot_of = (jnp.asarray(a) for a in groups.layer_index())
        layer_index = jnp.arange(c.num_layers, dtype=jnp.int32)
        if on_gpu():
            # Unrolled, a constant index makes each quantized weight a static slice of its
            # stack, which XLA converts into a bfloat16 copy (1,856 MiB a 1B int8 step); an
            # index it cannot fold stays a dynamic slice, read inside the GEMM's fusion.
            layer_index = lax.optimization_barrier(layer_index)
        # On a GPU the loop is unrolled: a while loop runs outside CUDA graphs (its body's
        # kernels launched one by one, every layer); unrolled, the whole step is one
        # command buffer (`benchmarks/gpu_structure.py` counts it).
        unroll = c.num_layers if on_gpu() else 1
        with ieee_float32(dtype):
            (x, kv), _ = lax.scan(
                body,
                (x, kv),
                (layer_state, layer_index, group_of, slot_of, rope_index, windows, lora_weights),
                unroll=unroll,
            )
            # Only the rows asked for reach the LM head (each sequence's last new token, and
            # prompt tokens scored for prompt logprobs): never [T, vocab].
            h = self.final_norm(x[jnp.asarray(rows, jnp.int32)])
            if not head:
                return h.astype(jnp.float32), kv
            weights = self.embed.embedding if self.lm_head is None else self.lm_head.kernel
            logits = lm_head(h, weights, tied=self.lm_head is None, mesh=mesh)
        return apply_soft_cap(logits, c.final_logit_softcapping), kv


def forward(
    graphdef: nnx.GraphDef[CausalLM],
    state: nnx.State | dict,  # or its `nnx.to_pure_dict`, the cheaper pytree to flatten
    kv: KVPool,
    tokens: jax.Array,
    meta: Ragged,
    rows: jax.Array,
    *,
    attention_impl: str = "xla",
    mesh: Mesh | None = None,
    groups: KVGroups | None = None,
    adapters: lora.LoRABatch | None = None,
    head: bool = True,
    images: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, KVPool]:
    """`CausalLM.__call__` on a split model (`nnx.split`): weights and pool are plain pytrees
    to `jax.jit`, the module exists only inside the trace and no Flax state outlives it."""
    model = nnx.merge(graphdef, state)
    return model(
        kv,
        tokens,
        meta,
        rows,
        attention_impl=attention_impl,
        mesh=mesh,
        groups=groups,
        adapters=adapters,
        head=head,
        images=images,
    )


def logits(
    model: CausalLM,
    tokens: jax.Array,
    *,
    block_size: int = 16,
    adapters: lora.LoRABatch | None = None,
) -> jax.Array:
    """float32 logits `[B, T, vocab]` at every position of `tokens` int32 `[B, T]` (B whole
    sequences), computed as the engine computes them, through a throwaway pool of exactly
    their blocks: the model outside the engine. Jittable: `jax.jit(logits)(model, tokens)`.
    `adapters`: LoRA adapters (`models.lora.batch`), their slots `[B * T]`."""
    c = model.config
    b, t = tokens.shape
    pages = -(-t // block_size)
    tables = np.arange(1, b * pages + 1, dtype=np.int32).reshape(b, pages)  # 0: the null block
    lens = np.full(b, t)
    meta = ragged_plan.plan(
        lens, lens, tables, num_tokens=b * t, num_seqs=b, width=pages, block_size=block_size,
        impl="xla",
    )  # fmt: skip
    kv = kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=block_size,
        num_blocks=b * pages + 1,
        dtype=model.embed.embedding.dtype,
    )
    out, _ = model(kv, tokens.reshape(-1), meta, jnp.arange(b * t), adapters=adapters)
    return out.reshape(b, t, -1)


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


def lm_head(
    h: jax.Array, w: nnx.Param | quant.QuantWeight, tied: bool, mesh: Mesh | None
) -> jax.Array:
    """float32 logits `[S, vocab]` of hidden states `h` `[S, hidden]` against `w` (the
    embedding `[vocab, hidden]` when `tied`, unless held `transposed`, else `[hidden,
    vocab]`). With a mesh each device scores its shard of the vocabulary and the scores are
    all-gathered: only `[S, vocab]` crosses devices, never the table."""

    def scores(h: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
        if tied:
            return quant.dot_t(h, parts, w.dtype, quant.int8_inputs(w))
        if len(parts) == 1:
            return jnp.einsum("bh,hv->bv", h, parts[0], preferred_element_type=jnp.float32)
        return quant.dot(h, parts, w.dtype).astype(jnp.float32)

    if mesh is None:
        # as a layer's (int8 inputs too), a table held as its kernel as well
        if isinstance(w, quant.QuantWeight) and (not tied or w.transposed):
            return quant.matmul(h, w).astype(jnp.float32)
        return scores(h, quant.held(w)[0])

    def local(h: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
        return lax.all_gather(scores(h, parts), sharding.AXIS, axis=1, tiled=True)

    # (check_vma off: an all-gather's result is the same on every device, which the
    # checker cannot see)
    gathered = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), quant.specs(w)), out_specs=P(), check_vma=False
    )
    return gathered(h, quant.arrays(w))
