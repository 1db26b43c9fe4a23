"""The device KV pool: one pytree of two arrays, updated functionally.

Layout `[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`: a flat
slot `block_id * block_size + offset` addresses one token of one layer. Block 0
is the null block: padded tokens scatter there and padded page-table entries
point there, so no step ever needs a branch for padding.

Every jitted function that returns an updated pool must donate it
(`donate_argnums`): without donation XLA copies the whole pool on each write.

A step's new K/V reach the pool inside `ragged_attention.ragged_paged_attention`: on a GPU
its kernel stores float pools' rows itself (no scatter launch); `write`, a scatter, does
it everywhere else (quantized pools, the XLA path).

No step may slice a layer out of the pool: inside the model's loop over layers
`pool[layer]` is a copy of the whole layer on every step (on an H100, 30% of a
256-row decode step). Writes scatter at `(layer, block, head, offset)`, and
readers see every layer as one pool of `num_layers * num_blocks` blocks (a
reshape, a view) with the layer's blocks offset by `layer * num_blocks`
(`layer_blocks`).

On CPU a bfloat16 pool is stored as its raw bits (uint16): XLA on CPU has no
native bf16 scatter and would convert the whole pool to f32 and back on every
write, O(pool) per step despite donation. The bits are written and read through
bitcasts of only the tokens and pages touched; `dtype` is the logical type.
GPUs scatter bf16 natively, and a kernel there takes the pool as it is stored.

A quantized pool (`kv_cache_dtype` int8, fp8_e4m3 or fp8_e5m2) stores each token's
K and V head vectors in the 1-byte type, divided by a scale of their own (the
vector's absmax over the type's largest value, in the model's dtype) kept beside
them (`k_scale`, `v_scale`, `[num_layers, num_blocks, num_kv_heads, block_size]`),
written in the same scatter and copied with their blocks. int8 vectors are stored
in a rotated basis, which spreads outlier channels (`rotate`).
The scale takes the model's dtype, not float32: at head_dim 64 a float32 scale per
token and head would cost 6% of a 1-byte token, and keep the pool under twice the
tokens of a bfloat16 one (1.88x; 1.94x with a bfloat16 scale). Readers dequantize
the pages they read (`jpaged.kernels.common.dequantize`), never a whole layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.dtypes import KV_QUANT, resolve_dtype


@functools.cache
def rotation(head_dim: int) -> np.ndarray:  # float32 [D, D], orthogonal
    """The fixed basis int8 pools keep K and V in (see `rotate`): a seeded random
    orthogonal matrix, so any head_dim has one and every run the same."""
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
    return q.astype(np.float32)


def rotate(
    x: jax.Array,  # [..., D]
    values: Any,  # the pool's storage dtype: only int8 pools are rotated
    *,
    back: bool = False,
) -> jax.Array:  # [..., D], x's dtype
    """`x` into (or, `back`, out of) the basis of an int8 pool. An absmax scale over a
    head vector with an outlier channel leaves the other channels few of int8's 255
    evenly spaced levels; rotated, every channel carries a share of the outlier and
    the rounding error spreads evenly (QuaRot). Measured on Gemma 3 270M: perplexity
    ratio to float32 KV 1.0150 without, 1.0024 with. Attention needs nothing more than
    q rotated like k (qR.kR = q.k) and its output rotated back (v was rotated). fp8's
    grid is relative to each value's magnitude: rotating it changes nothing measurable
    (e4m3 1.0065 vs 1.0074), so fp8 pools stay in the model's basis."""
    if jnp.dtype(values) != jnp.int8:
        return x
    r = rotation(x.shape[-1])
    r = r.T if back else r
    out = jnp.einsum("...d,de->...e", x.astype(jnp.float32), r, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim], storage dtype
    v: jax.Array  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim], storage dtype
    # quantized pools: each token's scale per KV head, [num_layers, num_blocks,
    # num_kv_heads, block_size] in the model's (storage) dtype; None otherwise
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def dtype(self) -> jnp.dtype:
        """What the model computes K and V in (a quantized pool's scales are of it)."""
        stored = self.k if self.k_scale is None else self.k_scale
        return jnp.dtype(jnp.bfloat16) if stored.dtype == jnp.uint16 else jnp.dtype(stored.dtype)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))


def block_bytes(
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: Any,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one block takes across all layers, K and V together (scales included)."""
    itemsize = resolve_dtype(dtype).itemsize
    if kv_cache_dtype == "auto":
        return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize
    per_token = KV_QUANT[kv_cache_dtype][0].itemsize * head_dim + itemsize  # values + scale
    return 2 * num_layers * num_kv_heads * block_size * per_token


def create(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: Any = "bfloat16",
    kv_cache_dtype: str = "auto",
    sharding: jax.sharding.Sharding | None = None,
) -> KVPool:
    """A zeroed pool of `num_blocks` blocks, the null block included, made in place on
    the devices `sharding` spreads it over (each its share, never the whole). K and V
    are of `dtype`, or of `kv_cache_dtype` with scales of `dtype`."""
    for name, value in [
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ]:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(
            f"num_blocks must be an int >= 2 (block 0 is the reserved null block), "
            f"got {num_blocks!r}"
        )
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_QUANT:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {list(KV_QUANT)}, got {kv_cache_dtype!r}"
        )
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    dt = _storage_dtype(resolve_dtype(dtype))
    if kv_cache_dtype == "auto":
        return KVPool(*(jnp.zeros(shape, dt, device=sharding) for _ in "kv"))
    values = KV_QUANT[kv_cache_dtype][0]
    k, v = (jnp.zeros(shape, values, device=sharding) for _ in "kv")
    k_scale, v_scale = (jnp.zeros(shape[:-1], dt, device=sharding) for _ in "kv")
    return KVPool(k, v, k_scale, v_scale)


def _storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    on_cpu = jax.default_backend() == "cpu"
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 and on_cpu else dtype


def _to_storage(x: jax.Array, stored: jnp.dtype) -> jax.Array:
    """`x`, already of the pool's logical dtype, as stored (bf16 as its bits on CPU)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if stored == jnp.uint16 else x


def quantize(
    x: jax.Array,  # [..., head_dim]
    values: jnp.dtype,
    scale_dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:  # values [..., head_dim], scales [...] of scale_dtype
    """Each head vector in `values` over a scale of its own: absmax / the type's largest.
    The division uses the scale as stored, so dequantizing gives back x to the type's
    precision. int8 vectors are rotated first (`rotate`): readers
    rotate q like them and the output back."""
    largest = next(m for t, m in KV_QUANT.values() if t == values)
    xf = rotate(x.astype(jnp.float32), values)
    scale = (jnp.max(jnp.abs(xf), axis=-1) / largest).astype(scale_dtype)
    s = scale.astype(jnp.float32)[..., None]
    q = jnp.where(s > 0, xf / jnp.where(s > 0, s, 1.0), 0.0)
    if values == jnp.int8:
        q = jnp.round(q)
    return jnp.clip(q, -largest, largest).astype(values), scale


def slot_mapping(
    block_tables: jax.Array,  # int32 [S, W]: each sequence's pages
    seq_of: jax.Array,  # int32 [T]: each token's sequence, S for padding
    positions: jax.Array,  # int32 [T]
    block_size: int,
) -> jax.Array:  # int32 [T]
    """Each token's flat slot, `page * block_size + offset` of its position in its
    sequence's table; padding tokens get 0, a slot of the null block."""
    pages = jnp.take(
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(seq_of, jnp.int32),
        axis=0,
        mode="fill",
        fill_value=0,
    )
    positions = jnp.asarray(positions, jnp.int32)
    page = jnp.take_along_axis(pages, (positions // block_size)[:, None], axis=1)[:, 0]
    return page * block_size + positions % block_size


def write(
    kv: KVPool,
    layer: int | jax.Array,
    slot_mapping: jax.Array,  # int32 [*T] flat slots; 0 for padding (the null block)
    k: jax.Array,  # [*T, num_kv_heads, head_dim]
    v: jax.Array,  # [*T, num_kv_heads, head_dim]
) -> KVPool:
    """Scatter new K/V of one layer into their slots. `layer` may be traced.

    Each (token, head) row is indexed by (layer, block, head, offset), the pool's leading
    dimensions in order: the canonical scatter XLA on GPU runs in place. Indexing only
    (layer, block, offset) would make its ScatterSimplifier transpose the whole pool
    to bring them to the front, and back, on every write."""
    slots = slot_mapping.reshape(-1, 1)
    blocks, offsets = slots // kv.block_size, slots % kv.block_size
    heads = jnp.arange(kv.k.shape[2])[None, :]
    rows = (-1, kv.k.shape[2], kv.k.shape[4])  # [T, Hkv, D]
    at = (layer, blocks, heads, offsets)
    if not kv.quantized:
        new = [
            pool.at[at].set(_to_storage(x.reshape(rows).astype(kv.dtype), pool.dtype))
            for pool, x in ((kv.k, k), (kv.v, v))
        ]
        return KVPool(*new)
    assert kv.k_scale is not None and kv.v_scale is not None
    (k_q, k_s), (v_q, v_s) = (quantize(x.reshape(rows), kv.k.dtype, kv.dtype) for x in (k, v))
    return KVPool(
        kv.k.at[at].set(k_q),
        kv.v.at[at].set(v_q),
        kv.k_scale.at[at].set(_to_storage(k_s, kv.k_scale.dtype)),
        kv.v_scale.at[at].set(_to_storage(v_s, kv.v_scale.dtype)),
    )


def layer_blocks(
    kv: KVPool, layer: int | jax.Array, block_ids: jax.Array
) -> jax.Array:  # int32, block_ids' shape
    """Block ids of one layer as ids into every layer's pool seen as one,
    `[num_layers * num_blocks, ...]` (the kernels take the pool whole: no layer is sliced)."""
    return block_ids + jnp.asarray(layer, jnp.int32) * kv.num_blocks


def copy_blocks(
    kv: KVPool,
    pairs: jax.Array,  # int32 [n, 2] (src, dst) block ids, one array: one transfer
) -> KVPool:
    """Copy whole blocks `src -> dst` in every layer (copy-on-write). Pad with 0 -> 0.
    Indexed by (layer, block), leading and in order, as `write` explains."""
    layers = jnp.arange(kv.num_layers)[:, None]
    src, dst = pairs[None, :, 0], pairs[None, :, 1]
    # values and scales alike: a block's scales travel with it
    return jax.tree.map(lambda a: a.at[layers, dst].set(a[layers, src]), kv)


copy_blocks_jit = jax.jit(copy_blocks, donate_argnums=0)
