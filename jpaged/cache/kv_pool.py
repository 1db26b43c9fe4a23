"""The device KV pool: one pytree of two arrays, updated functionally.

Layout `[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`: a flat
slot `block_id * block_size + offset` addresses one token of one layer. Block 0
is the null block: padded tokens write there and padded page-table entries
point there, so no step ever needs a branch for padding.

Every jitted function that returns an updated pool must donate it
(`donate_argnums`): without donation XLA copies the whole pool on each write.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jpaged.dtypes import resolve_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim], storage dtype
    v: jax.Array  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim], storage dtype

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.bfloat16) if self.k.dtype == jnp.uint16 else jnp.dtype(self.k.dtype)

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
        return int(self.k.nbytes + self.v.nbytes)


def block_bytes(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: Any
) -> int:
    """Bytes one block takes across all layers, K and V together."""
    itemsize = resolve_dtype(dtype).itemsize
    return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


def create(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: Any = "bfloat16",
    sharding: jax.sharding.Sharding | None = None,
) -> KVPool:
    """A zeroed pool of `num_blocks` blocks, the null block included, made in place on
    the devices `sharding` spreads it over (each its share, never the whole)."""
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
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    dt = _storage_dtype(resolve_dtype(dtype))
    return KVPool(k=jnp.zeros(shape, dt, device=sharding), v=jnp.zeros(shape, dt, device=sharding))


def _storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    on_cpu = jax.default_backend() == "cpu"
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 and on_cpu else dtype


def _to_storage(x: jax.Array, kv: KVPool) -> jax.Array:
    x = x.astype(kv.dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if kv.k.dtype == jnp.uint16 else x


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
    new_k = kv.k.at[layer, blocks, heads, offsets].set(_to_storage(k.reshape(rows), kv))
    new_v = kv.v.at[layer, blocks, heads, offsets].set(_to_storage(v.reshape(rows), kv))
    return KVPool(k=new_k, v=new_v)


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
    return KVPool(
        k=kv.k.at[layers, dst].set(kv.k[layers, src]),
        v=kv.v.at[layers, dst].set(kv.v[layers, src]),
    )


copy_blocks_jit = jax.jit(copy_blocks, donate_argnums=0)

