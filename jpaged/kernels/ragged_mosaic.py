"""The ragged Pallas kernel's body under Mosaic GPU (`ragged_attention`'s
`lowering="mosaic"`): one warpgroup per (query tile, KV head, context split), a chunk's
pages copied into shared memory by the TMA, wgmma dots; interpreted elsewhere by Mosaic
GPU's interpret mode. Apart from `ragged_attention` so that Mosaic GPU's modules are
imported only where this lowering is asked for."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from jpaged.kernels.common import (
    MASK_VALUE,
    SMEM_BUDGET,
    apply_soft_cap,
    as_float,
    choose_tiles,
    split_run,
)
from jpaged.kernels.ragged_plan import PALLAS_TILE, Ragged

# A program's rows: a warpgroup's tensor-core dot (wgmma) takes 64 of them.
ROWS = 64
# Mosaic's shared-memory tiles are rows of 128 bytes, swizzled: head_dim and a chunk's
# tokens whole multiples of 64 2-byte values.
SWIZZLE = 128
# Shared memory a kernel takes beyond its buffers (measured: 2584 bytes at head_dim 256;
# its reduction scratch is 2048 of them).
SMEM_RESERVE = 4096


def kernel(
    *refs: Any,
    scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    splits: int,
    group_tile: int,
    interpret: bool,
) -> None:
    """One warpgroup per (query tile, KV head, split), the split layout of the Triton
    kernel's outputs always. refs: each tile's rows for each KV head [NT, Hkv, rows, D]
    (row r: token r // group_tile of the tile, query head r % group_tile of the KV head;
    rows past the tile's tokens see nothing); the pools [N, Hkv, bs, D]; each tile's pages
    [NT, W] (whole chunks); each tile's (first chunk, past its last, first token's
    position, live tokens, window) [NT, 5]. Outputs [NT, Hkv, S, rows, D], [NT, Hkv, S,
    rows] twice: as the split Triton kernel's. Then shared memory: the rows, one or two
    slots (`kv_slots`) of K and of V chunks (a chunk's pages copied in by the TMA; with
    two, the next chunk's while this one is attended), the probabilities, the output and
    its stats; and barriers for the rows and each slot. Rows see causally within the
    window: the tile's tokens are consecutive positions of
    one sequence (no image spans)."""
    q_ref, k_ref, v_ref, tables_ref, tile_ref, o_ref, m_ref, denom_ref, *scratch = refs
    q_smem, k_smem, v_smem, p_smem, o_smem, stats_smem, q_barrier, kv_barriers = scratch
    i, h, s = (lax.axis_index(name) for name in ("tile", "head", "split"))
    slots = k_smem.shape[0]
    rows, head_dim = q_smem.shape
    block_size = k_ref.shape[2]
    chunk = pages_per_chunk * block_size

    def layout(x: jax.Array, to: Any) -> jax.Array:
        # GPU interpret mode has no register layouts (the values are the same)
        return x if interpret else plmgpu.layout_cast(x, to)

    def fetch(c: jax.Array, slot: jax.Array) -> None:
        for j in range(pages_per_chunk):
            page = tables_ref[i, c * pages_per_chunk + j]
            at = pl.ds(j * block_size, block_size)
            for ref, smem in ((k_ref, k_smem), (v_ref, v_smem)):
                plmgpu.copy_gmem_to_smem(ref.at[page, h], smem.at[slot, at], kv_barriers.at[slot])

    plmgpu.copy_gmem_to_smem(q_ref.at[i, h], q_smem, q_barrier)
    lo, hi = split_run(tile_ref[i, 0], tile_ref[i, 1], splits, s)
    pos0, live, window = tile_ref[i, 2], tile_ref[i, 3], tile_ref[i, 4]
    wgmma = plmgpu.Layout.WGMMA
    token = layout(lax.broadcasted_iota(jnp.int32, (rows, chunk), 0), wgmma) // group_tile
    end = jnp.where(token < live, pos0 + token + 1, 0)  # past each row's last key; 0: none
    first = jnp.maximum(end - window, 0)

    @pl.when(lo < hi)
    def _() -> None:
        fetch(lo, jnp.int32(0))

    plmgpu.barrier_wait(q_barrier)

    def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        o, m, denom = carry
        slot = (c - lo) % slots

        def prefetch() -> None:
            # the next chunk into the other slot, which the previous chunk's dots have
            # done with; into the only one once this chunk's have
            pl.when(c + 1 < hi)(lambda: fetch(c + 1, (slot + 1) % slots))

        if slots == 2:
            prefetch()
        plmgpu.barrier_wait(kv_barriers.at[slot])
        k = k_smem.at[slot]
        if interpret:  # (the interpreter's wgmma takes no transposed operand)
            dims = (((1,), (1,)), ((), ()))
            logits = lax.dot_general(q_smem[...], k[...], dims, preferred_element_type=jnp.float32)
        else:

            def qk(acc: Any) -> jax.Array:
                plmgpu.wgmma(acc, q_smem, plmgpu.transpose_ref(k, (1, 0)))
                return acc[...]

            logits = pl.run_scoped(qk, plmgpu.WGMMAAccumulatorRef((rows, chunk), jnp.float32))
        pos = c * chunk + layout(lax.broadcasted_iota(jnp.int32, (rows, chunk), 1), wgmma)
        seen = (pos >= first) & (pos < end)
        logits = jnp.where(seen, apply_soft_cap(logits * scale, soft_cap), MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(logits - lax.broadcast_in_dim(m_new, seen.shape, [0])), 0.0)
        denom = correction * denom + p.sum(axis=1)
        # the probabilities go through shared memory: the interpreter's wgmma reads no
        # registers (on a GPU it could)
        p_smem[...] = p.astype(p_smem.dtype)
        plmgpu.commit_smem()

        def pv(acc: Any) -> jax.Array:
            plmgpu.wgmma(acc, p_smem, v_smem.at[slot])
            return acc[...]

        o = lax.broadcast_in_dim(correction, o.shape, [0]) * o
        o = o + pl.run_scoped(pv, plmgpu.WGMMAAccumulatorRef((rows, head_dim), jnp.float32))
        if slots == 1:
            prefetch()
        return o, m_new, denom

    row = wgmma.reduce(1)
    carry = (
        layout(jnp.zeros((rows, head_dim), jnp.float32), wgmma),
        layout(jnp.full((rows,), MASK_VALUE, jnp.float32), row),
        layout(jnp.zeros((rows,), jnp.float32), row),
    )
    o, m, denom = lax.fori_loop(lo, hi, body, carry)
    # denom == 0 when a row sees nothing here (padding, an empty run): zeros, not NaN
    safe = lax.broadcast_in_dim(jnp.where(denom > 0, denom, 1.0), o.shape, [0])
    o_smem[...] = o / safe
    stats_smem[0] = m
    stats_smem[1] = denom
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(o_smem, o_ref.at[i, h, s])
    plmgpu.copy_smem_to_gmem(stats_smem.at[0], m_ref.at[i, h, s])
    plmgpu.copy_smem_to_gmem(stats_smem.at[1], denom_ref.at[i, h, s])
    plmgpu.wait_smem_to_gmem(0)


def call(
    q_rows: jax.Array,  # [NT, Hkv, rows, D]: see `kernel`
    k_pool: jax.Array,  # [N, Hkv, bs, D]
    v_pool: jax.Array,
    tables: jax.Array,  # int32 [NT, W]
    per_tile: jax.Array,  # int32 [NT, 5]
    *,
    scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    splits: int,
    group_tile: int,
    interpret: bool,
) -> list[jax.Array]:  # f32 [NT, Hkv, S, rows, D], [NT, Hkv, S, rows] twice
    num_tiles, num_kv_heads, rows, head_dim = q_rows.shape
    chunk = pages_per_chunk * k_pool.shape[2]
    dtype = k_pool.dtype
    slots = kv_slots(rows, chunk, head_dim)
    swizzled = (
        plmgpu.TilingTransform((8, SWIZZLE // dtype.itemsize)),
        plmgpu.SwizzleTransform(SWIZZLE),
    )
    part = (num_tiles, num_kv_heads, splits, rows)
    call = plmgpu.kernel(
        functools.partial(
            kernel,
            scale=scale,
            soft_cap=soft_cap,
            pages_per_chunk=pages_per_chunk,
            splits=splits,
            group_tile=group_tile,
            interpret=interpret,
        ),
        out_type=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        scratch_types=[
            plmgpu.SMEM((rows, head_dim), dtype, transforms=swizzled),
            plmgpu.SMEM((slots, chunk, head_dim), dtype, transforms=swizzled),
            plmgpu.SMEM((slots, chunk, head_dim), dtype, transforms=swizzled),
            plmgpu.SMEM((rows, chunk), dtype, transforms=swizzled),
            plmgpu.SMEM((rows, head_dim), jnp.float32),
            plmgpu.SMEM((2, rows), jnp.float32),
            plmgpu.Barrier(),
            # a slot's K and V pages each arrive on it
            plmgpu.Barrier(num_arrivals=2 * pages_per_chunk, num_barriers=slots),
        ],
        grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "head", "split"),
        compiler_params=plmgpu.CompilerParams(),
        interpret=_gpu_interpret() if interpret else None,
    )
    return list(call(q_rows.astype(dtype), k_pool, v_pool, tables, per_tile))


def kv_slots(rows: int, chunk: int, head_dim: int) -> int:
    """K/V slots of the Mosaic kernel's shared memory: two (the next chunk copied in while
    this one is attended) where they fit an H100's, else one."""
    for slots in (2, 1):
        # 2-byte rows, K and V chunks, probabilities; f32 output and stats
        buffers = 2 * (rows * head_dim + 2 * slots * chunk * head_dim + rows * chunk)
        if buffers + 4 * (rows * head_dim + 2 * rows) + SMEM_RESERVE <= SMEM_BUDGET:
            return slots
    raise NotImplementedError(
        f"the Mosaic GPU kernel fits no {chunk}-token chunk of head_dim {head_dim} for "
        f"{rows} query rows in {SMEM_BUDGET} bytes of shared memory"
    )


def _gpu_interpret() -> Any:
    """Mosaic GPU's interpret mode (a GPU's memories, barriers and TMA simulated on the
    host): exported since JAX 0.11, private in 0.10."""
    params: Any = getattr(plmgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        params = InterpretGPUParams
    return params()


def check(q: Any, k_pool: Any, k_scale: Any, meta: Ragged) -> None:
    """What the Mosaic kernel leaves out, named (`kernel`): 16-bit float pools of
    q's dtype (wgmma's operands; no 1-byte pages), whole 64s of head_dim and pages of
    whole 8-row tiles, and causal attention (no image spans)."""
    dtype = as_float(k_pool).dtype
    if k_scale is not None or dtype not in (jnp.bfloat16, jnp.float16) or q.dtype != dtype:
        raise NotImplementedError(
            f"the Mosaic GPU kernel takes bfloat16 or float16 q and pools alike, "
            f"got q {q.dtype} and {k_pool.dtype} pools"
        )
    block_size, head_dim = k_pool.shape[-2:]
    rows = PALLAS_TILE * pl.next_power_of_2(q.shape[1] // k_pool.shape[-3])
    chunk = choose_tiles(head_dim, 2, block_size, rows).chunk_tokens  # as `_pallas_impl`
    tile = SWIZZLE // 2
    if head_dim % tile or chunk % tile or block_size % 8:
        raise NotImplementedError(
            f"the Mosaic GPU kernel takes head_dim and chunks in whole {tile}s and pages "
            f"in whole 8s, got head_dim {head_dim}, {chunk}-token chunks of {block_size}"
        )
    kv_slots(-(-rows // ROWS) * ROWS, chunk, head_dim)
    if np.shape(meta.limits)[0]:
        raise NotImplementedError("the Mosaic GPU kernel attends causally: no image spans")
