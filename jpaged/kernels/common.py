"""The attention kernel's parts: masks, dtypes, Triton tile sizes, argument checks, the
online-softmax step (the models use the soft cap and the float32 precision too).

XLA CPU and bfloat16: XLA's CPU backend runs bf16 gathers, dynamic slices and
scatters in f32 and inserts a convert of the whole operand. Inside a
`lax.scan`/`fori_loop` over layers that convert covers the whole KV pool and is
paid every step (measured: cost grows with num_blocks). A pool stored as uint16
holding bf16 bits avoids it; the kernel's XLA and Pallas paths accept such pools
and treat them as bfloat16.

Sliding window (Gemma 2/3): transformers' `sliding_window_overlay` keeps
`kv_idx > q_idx - sliding_window` on top of the causal `kv_idx <= q_idx`, so the
query at position p = context_len - 1 sees keys j with
p - sliding_window < j <= p, i.e. the last `sliding_window` tokens:
visible = [max(context_len - sliding_window, 0), context_len).
`sliding_window` may be a traced int32 scalar (a per-layer value inside a
`lax.fori_loop`/`scan` over layers); the kernel takes the window as data, so a
new window never recompiles.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so exp(mask - max) is 0 rather than NaN when a whole row is masked.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Triton dots want power-of-two tiles of >= 16 rows.
MIN_TILE = 16
# Shared memory per block on an H100 (227 KB) and its SM count, the default off a GPU.
SMEM_BUDGET = 232448
DEFAULT_SM_COUNT = 132


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def ieee_float32(dtype: Any) -> contextlib.AbstractContextManager:
    """Trace under this so float32 dots ask for Precision.HIGHEST: XLA on GPU runs float32
    dots as TF32 otherwise (~1e-2 off transformers). Other dtypes keep the default."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def as_float(x: jax.Array) -> jax.Array:
    # uint16 pools hold bfloat16 bits (see the module note on XLA CPU).
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def dequantize(
    values: jax.Array,  # [..., D]: pages as stored
    scales: jax.Array | None,  # [...]: each token's scale (quantized pages), or None
    dtype: Any,
) -> jax.Array:  # [..., D]
    """Pages as numbers: float pages as they are (bf16 bits as bf16), 1-byte pages times
    their token's scale, in `dtype`. Only ever applied to the pages a step reads."""
    if scales is None:
        return as_float(values)
    s = as_float(scales).astype(jnp.float32)[..., None]
    return (values.astype(jnp.float32) * s).astype(dtype)


def apply_soft_cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    if soft_cap is None:
        return logits
    return soft_cap * jnp.tanh(logits / soft_cap)


class Tiles(NamedTuple):
    chunk_tokens: int  # K/V tokens per loop iteration, a power of two >= 16
    num_stages: int  # Triton software-pipelining stages


def smem_bytes(
    head_dim: int, itemsize: int, group_tile: int, chunk_tokens: int, num_stages: int
) -> int:
    """Triton's shared memory for the kernel: the pipelined K and V tiles plus the q tile.
    Exact on the one measured failure (f32, head_dim 256, 64-token chunks, 2 stages,
    group tile 16: requested 2 * 2 * 64 * 256 * 4 + 16 * 256 * 4 = 278528 bytes)."""
    return (num_stages * 2 * chunk_tokens + group_tile) * head_dim * itemsize


def choose_tiles(head_dim: int, itemsize: int, block_size: int, group_tile: int) -> Tiles:
    """The largest chunk up to the preferred one that fits the shared memory budget
    with 2 stages, else with 1. Preferred: 64 tokens (measured at 87% of an H100's
    bandwidth for head_dim 128), and as many bytes per row at head_dim 64, whose
    64-token loads are narrow. A chunk holds whole pages, so never below block_size."""
    floor = max(MIN_TILE, block_size)
    preferred = max(floor, 64, 8192 // head_dim)
    for num_stages in (2, 1):
        chunk = preferred
        while chunk >= floor:
            if smem_bytes(head_dim, itemsize, group_tile, chunk, num_stages) <= SMEM_BUDGET:
                return Tiles(chunk, num_stages)
            chunk //= 2
    raise ValueError(
        f"no tile fits {SMEM_BUDGET} bytes of shared memory: head_dim {head_dim}, "
        f"itemsize {itemsize}, block_size {block_size}, group tile {group_tile}"
    )


@functools.cache
def sm_count() -> int:
    """The GPU's SM count (`core_count` of GPU devices), or an H100's elsewhere."""
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_SM_COUNT)


def check_window(sliding_window: Any) -> jax.Array | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool):
        raise ValueError("sliding_window must be None, an int or an int scalar array, got bool")
    if isinstance(sliding_window, int | np.integer):
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        return jnp.asarray(sliding_window, jnp.int32)
    shape, dtype = np.shape(sliding_window), getattr(sliding_window, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            "sliding_window must be None, an int or an int scalar array, "
            f"got shape {shape} dtype {dtype}"
        )
    return jnp.asarray(sliding_window, jnp.int32)


def attend_chunk(
    q: jax.Array,  # [rows, D], the program's queries
    k_ref: Any,  # [num_blocks, block_size, D], the program's KV head
    v_ref: Any,  # [num_blocks, block_size, D]
    tables_ref: Any,  # [W] pages, padded to whole chunks
    c: jax.Array,  # the chunk: pages [c * pages_per_chunk, (c + 1) * pages_per_chunk)
    carry: tuple[jax.Array, ...],  # (o [rows, D], running max [rows], sum of exp [rows]), f32
    visible: Callable[[jax.Array], jax.Array],  # positions [chunk] -> bool [rows or 1, chunk]
    *,
    pages_per_chunk: int,
    scale: float,
    soft_cap: float | None,
    ks_ref: Any = None,  # [num_blocks, block_size]: 1-byte pages' scales, or None
    vs_ref: Any = None,
    stored: jax.Array | None = None,  # [] int32: positions from here are not read, or None
) -> tuple[jax.Array, ...]:
    """One online-softmax step of the Pallas kernel over one chunk of a page table (its
    loop body). Masked keys add nothing, even to a row that sees none of them. 1-byte
    pages are dequantized here, a chunk at a time, in registers. `stored`: where the
    kernel writes the step's new K/V itself, the slots from the sequence's first new
    position on are being written by other programs of the launch: never loaded (0)."""
    block_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    chunk = pages_per_chunk * block_size
    pages = tables_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
    pos = c * chunk + jnp.arange(chunk)
    if stored is None:
        k, v = k_ref[pages], v_ref[pages]
    else:
        shape = (pages_per_chunk, block_size, head_dim)
        mask = jnp.broadcast_to((pos < stored).reshape(pages_per_chunk, block_size, 1), shape)
        # every axis indexed by an array: what interpret mode can mask
        at = (
            pages[:, None, None],
            jnp.arange(block_size)[None, :, None],
            jnp.arange(head_dim)[None, None, :],
        )
        k, v = (plgpu.load(ref.at[at], mask=mask, other=0) for ref in (k_ref, v_ref))
    k, v = k.reshape(chunk, head_dim), v.reshape(chunk, head_dim)
    if ks_ref is not None:
        k = dequantize(k, ks_ref[pages].reshape(chunk), q.dtype)
        v = dequantize(v, vs_ref[pages].reshape(chunk), q.dtype)
    return softmax_step(q, k, v, visible(pos), carry, scale=scale, soft_cap=soft_cap)


def softmax_step(
    q: jax.Array,  # [rows, D]
    k: jax.Array,  # [keys, D]
    v: jax.Array,  # [keys, D]
    seen: jax.Array,  # bool [rows or 1, keys]: which keys each row sees
    carry: tuple[jax.Array, ...],  # (o [rows, D], running max [rows], sum of exp [rows]), f32
    *,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, ...]:
    """Fold a block of keys into a Pallas program's running softmax (flash attention)."""
    o, m, denom = carry
    # f32 pools get IEEE dots on GPU (Triton's default is TF32)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = apply_soft_cap(plgpu.dot(q, k, trans_b=True, precision=precision) * scale, soft_cap)
    logits = jnp.where(seen, logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(axis=-1))
    correction = jnp.exp(m - m_new)
    p = jnp.where(seen, jnp.exp(logits - m_new[:, None]), 0.0)
    denom_new = correction * denom + p.sum(axis=-1)
    o_new = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o_new, m_new, denom_new


def split_run(
    lo: jax.Array, hi: jax.Array, splits: int, split: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Split `split`'s run of the chunks [lo, hi): `splits` equal runs, the last ones empty
    past a short tile's chunks."""
    run = pl.cdiv(hi - lo, splits)
    lo = jnp.minimum(lo + split * run, hi)
    return lo, jnp.minimum(lo + run, hi)
