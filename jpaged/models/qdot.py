"""CPU kernels for quantized matmuls at a few tokens (`qdot.cc`; built and registered by
`jpaged.kernels.cpu`, which says where they serve).

XLA:CPU runs the decode step's small dots on one thread and dequantizes through memory
(benchmarks/bench_quant.py); these read each code once and split the output columns over
XLA's intra-op threads, at most `TOKENS` tokens a call; `models.quant.dot` takes the XLA
path otherwise. With the inputs rounded to int8 (`activations="int8"`, 4-bit codes) they
multiply in integers, at any number of tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp

from jpaged.kernels import cpu
from jpaged.kernels.cpu import unsplit

__all__ = [
    "available", "bits", "centre", "dot", "dot_id", "dot_t", "int8_kernel", "narrow", "ordered",
    "stacks", "takes_int8", "takes_int8_t", "tile", "unsplit", "untile", "usable", "usable_id",
    "usable_t", "widen",
]  # fmt: skip

SOURCE = Path(__file__).with_name("qdot.cc")
# The most tokens a call takes with float inputs and codes as every reader takes them. The
# kernel re-reads a cache-sized tile of columns for each 8 tokens, so past a few chunks both
# it and XLA's path are bound by their multiply-adds: a SmolLM2-shaped 30-layer stack, Q4_1
# codes, ms kernel / XLA: 10 / 35 at 1 token, 60 / 104 at 16, 109 / 162 at 32, 230 / 261 at
# 64, 457 / 508 at 128, 878 / 863 at 384; int8 codes 22 / 50 at 4, 231 / 274 at 64
# (benchmarks/RESULTS.md, 2026-11-26). Codes in `tile`'s order take any: 512 through an 8B
# FFN's Q4_K gate_up 333 ms, XLA's path 1032 (2026-11-29).
TOKENS = 128
TILE = 16  # qdot.cc's kLanes: output columns must be a multiple
INT8_TILE = 32  # qdot.cc's kGroup: the same with int8 inputs
RUN = 32  # qdot.cc's kRun: inputs an int8 scale covers
# A tied head's scores: one pass over the table takes qdot.cc's kChunk tokens; at 16 (two
# passes) XLA's path is faster (SmolLM2's 49152 x 576 Q8_0, ms kernel / XLA on a 2-core
# AVX-512 EPYC: 1.0 / 1.9 at 1 token, 2.3 / 4.3 at 4, 4.2 / 5.3 at 8, 9.1 / 7.5 at 16).
TABLE_TOKENS = 8
TABLE_SUPERS = 16  # qdot.cc's kSupers: a two-level table's sub-scales a super-scale (Q6_K's)
KERNEL_CODES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8))  # the codes the kernels read
NAMES = (
    "jpaged_qdot_int8", "jpaged_qdot_narrow", "jpaged_qdot_packed", "jpaged_qdot_t_int8",
    "jpaged_qdot_t_packed", "jpaged_qdot_id_int8", "jpaged_qdot_id_narrow", "jpaged_qdot_id_packed",
)  # fmt: skip


def available() -> bool:
    """Whether the kernels are built and registered (`cpu.register`)."""
    return cpu.register(SOURCE, NAMES)


def usable(
    x: jax.Array, parts: tuple[jax.Array, ...], int8: bool = False, tiled: bool = False
) -> bool:
    """Whether `dot` takes `x [..., in]` against `parts` here (decided while tracing: shapes
    and the backend are static): whole lanes of output columns; with `int8` (inputs rounded
    to int8) or codes in `tile`'s order (`tiled`, or narrow ones), as `takes_int8` says, at
    any number of tokens."""
    codes = parts[0]
    if ordered(codes, x.shape[-1], int8, tiled):
        return (
            stacks()
            and len(parts) > 1
            and codes.ndim in (2, 3)
            and takes_int8(codes, parts[1], levels(parts)[2] is not None)
        )
    return (
        stacks()
        and len(parts) > 1
        and codes.dtype in KERNEL_CODES  # fp8 codes: XLA's path
        and x.size // x.shape[-1] <= TOKENS
        and codes.ndim in (2, 3)
        and codes.shape[-1] % TILE == 0
    )


def takes_int8(codes: Any, scale: Any, affine: bool) -> bool:
    """Whether the kernels take `int8` inputs against a weight of `codes` `[..., rows, out]`
    and `scale` `[..., in / block, out]` (arrays or their shapes) here: whole groups of
    `INT8_TILE` columns, and packed codes, or int8 ones in sub-blocks of whole runs of 32
    inputs or (int8 sub-scales, symmetric: Q6_K's) of 16."""
    if not int8_kernel() or codes.shape[-1] % INT8_TILE:
        return False
    if codes.dtype == jnp.uint8:  # packed or narrow
        return True
    block = codes.shape[-2] // scale.shape[-2]
    return codes.dtype == jnp.int8 and (
        block % RUN == 0 or (block == RUN // 2 and scale.dtype == jnp.int8 and not affine)
    )


# `tile`'s order of a run's codes `[rows, out]` (16 rows packed, 32 int8): [column / 8, word
# (4 rows), column % 8, row % 4] (packed: byte j of a column's 16 values j and j + 16)
_TILED = (2, 0, 3, 1)


def _run_rows(codes: Any) -> int:
    return RUN // 2 if codes.dtype == jnp.uint8 else RUN


def tile(codes: jax.Array) -> jax.Array:
    """Codes `[..., rows, out]` (packed or int8) in the order the kernels read with `int8`
    inputs (`qdot.cc`'s `Tile`, `Run8`): a permutation within each run of 32 inputs' rows,
    the shape unchanged."""
    *lead, rows, out = codes.shape
    r = _run_rows(codes)
    runs = codes.reshape(*lead, rows // r, r // 4, 4, out // 8, 8)
    n = len(lead) + 1
    return runs.transpose(*range(n), *(n + a for a in _TILED)).reshape(codes.shape)


def untile(codes: jax.Array, values: int | None = None, affine: bool = False) -> jax.Array:
    """`tile`'s inverse: the codes as every other reader takes them; narrow ones (`narrow`:
    with `values` along the contraction axis and whether the weight is `affine`) as int8."""
    if values is not None and bits(codes, values) in NARROW:
        codes = widen(codes, values, affine)
    *lead, rows, out = codes.shape
    r = _run_rows(codes)
    runs = codes.reshape(*lead, rows // r, out // 8, r // 4, 8, 4)
    n = len(lead) + 1
    back = sorted(range(4), key=_TILED.__getitem__)
    return runs.transpose(*range(n), *(n + a for a in back)).reshape(codes.shape)


# Narrow codes (`narrow`): a run's 32 codes of a column in 4 x bits bytes (Q6_K's six bits,
# Q5_*'s five), unsigned, a symmetric weight's 2^(bits - 1) above the value (`centre`). Of
# each 8 columns' 32 x bits bytes, words (4 rows of 8 columns) of their low 4 bits as
# packed ones' tile lays them (rows 4i..4i + 3 in low nibbles, 16 + 4i.. in high), then
# bits - 4 words of the rest: word j's at bits e * (j // e) of top word j % e (e = bits - 4).
NARROW = (5, 6)


def bits(codes: Any, values: int) -> int:
    """Bits a code of `codes` `[..., rows, out]` (an array or its shape) over `values` inputs
    takes: 8 (int8 or fp8), 4 (packed) or narrow ones' (`NARROW`)."""
    return codes.shape[-2] * 8 // values if codes.dtype == jnp.uint8 else 8


def ordered(codes: Any, values: int, int8: bool = False, tiled: bool = False) -> bool:
    """Whether codes `[..., rows, out]` over `values` inputs lie in `tile`'s order: with
    `int8` inputs, narrow ones always, others where the loader laid them so (`tiled`)."""
    return int8 or tiled or bits(codes, values) in NARROW


def centre(bits: int, affine: bool) -> int:
    """What narrow codes of `bits` hold above their values."""
    return 0 if affine else 1 << (bits - 1)


def narrow(codes: Any, bits: int, affine: bool) -> jax.Array:
    """int8 codes of `bits` `[..., rows, out]` in `tile`'s order (-2^(bits - 1).. when
    symmetric, 0.. when `affine`) as narrow ones: uint8 `[..., rows / 32 * 4 * bits, out]`,
    the int8 kernel's (`jpaged_qdot_narrow`). The loader's is `models.hostcopy.narrow`."""
    *lead, rows, out = codes.shape
    u = (jnp.asarray(codes, jnp.int32) + centre(bits, affine)).astype(jnp.uint8)
    words = u.reshape(*lead, rows // RUN, out // 8, 8, 32)
    e = bits - 4
    low = words[..., :4, :] & 15 | (words[..., 4:, :] & 15) << 4
    tops = [
        sum((words[..., j, :] >> 4) << (e * (j // e)) for j in range(m, 8, e)) for m in range(e)
    ]
    held = jnp.concatenate([low, jnp.stack(tops, axis=-2).astype(jnp.uint8)], axis=-2)
    return held.reshape(*lead, rows // RUN * 4 * bits, out)


def widen(codes: jax.Array, values: int, affine: bool) -> jax.Array:
    """`narrow`'s inverse: int8 codes in `tile`'s order."""
    n = bits(codes, values)
    *lead, held, out = codes.shape
    runs, e = values // RUN, n - 4
    parts = codes.reshape(*lead, runs, out // 8, n, 32)
    low, top = parts[..., :4, :], parts[..., 4:, :]
    nibbles = jnp.concatenate([low & 15, low >> 4], axis=-2)
    shift = jnp.asarray([e * (j // e) for j in range(8)], jnp.uint8)[:, None]
    high = (top[..., [j % e for j in range(8)], :] >> shift) & ((1 << e) - 1)
    words = (nibbles | high << 4).astype(jnp.int32) - centre(n, affine)
    return words.astype(jnp.int8).reshape(*lead, runs * RUN, out)


def int8_kernel() -> bool:
    """Whether the kernels take `dot`'s `int8` here: the library says it was built with
    AVX2's integer multiply-adds (what its C++ checks, so never an error mid-request)."""
    return available() and "avx2" in cpu.isa(SOURCE)


def usable_t(x: jax.Array, parts: tuple[jax.Array, ...]) -> bool:
    """Whether `dot_t` takes `x [tokens, in]` against a table `parts` here: sub-blocks of
    whole vectors (16 values, packed 32), at most `TABLE_TOKENS` tokens."""
    codes, scale = parts[:2] if len(parts) > 1 else (parts[0], None)
    return (
        scale is not None
        and codes.dtype in KERNEL_CODES
        and stacks()
        and x.shape[0] <= TABLE_TOKENS
        and (x.shape[-1] // scale.shape[-1]) % (32 if codes.dtype == jnp.uint8 else 16) == 0
    )


def takes_int8_t(codes: Any, scale: Any, affine: bool, group: int = 0) -> bool:
    """Whether the table kernel takes `int8` inputs against a table of `codes` `[rows, in]`
    and `scale` `[rows, in / block]` (arrays or their shapes; `group`: sub-scales a float16
    super-scale, 0 for float ones) here: symmetric int8 codes (a tied Q6_K or Q8_0 head) in
    sub-blocks of 16 or of whole runs of 32 inputs, or two-level as Q6_K's (16 sub-scales
    of 16 a super-scale), the codes as every reader takes them."""
    block = codes.shape[-1] // scale.shape[-1]
    shape = block == RUN // 2 if group else block == RUN // 2 or block % RUN == 0
    return (
        int8_kernel()
        and codes.dtype == jnp.int8
        and not affine
        and group in (0, TABLE_SUPERS)
        and shape
    )


def stacks() -> bool:
    """Whether the model being traced reads its layers' quantized weights where they lie in
    their stacks (`dot`'s `layer`): where the kernels may serve them."""
    return cpu.serves() and available()


def dot(
    x: jax.Array,
    parts: tuple[jax.Array, ...],
    layer: jax.Array | None = None,
    int8: bool = False,
    tiled: bool = False,
) -> jax.Array:
    """float32 `x [..., in] @ w [in, out]`, `w` as `models.quant.held` gives it (codes
    int8, packed uint8 or narrow (`narrow`, in `tile`'s order), scale and optional offset,
    sub-blocks along `in`, and int8 ones' float16 super-scales); with `layer`, each of them a
    stack `[layers, ...]` of which `w` is that layer. `int8`: `x` rounded to int8 per run of
    32 inputs and dotted in integers (`usable(..., int8=True)`), the codes in `tile`'s
    order. `tiled`: packed codes in `tile`'s order with float inputs too."""
    if parts[0].dtype not in KERNEL_CODES:
        raise ValueError(f"qdot.dot reads int8 or packed uint8 codes, not {parts[0].dtype}")
    if int8 and not takes_int8(parts[0], parts[1], levels(parts)[2] is not None):
        raise ValueError(
            f"qdot.dot does not round inputs to int8 for {parts[0].dtype} codes "
            f"{parts[0].shape[-2:]} with {parts[1].dtype} scales {parts[1].shape[-2:]}"
        )
    if layer is None:
        parts, layer = tuple(p[None] for p in parts), jnp.zeros((), jnp.int32)
    codes, scale, offset, supers = levels(parts)
    name = {4: "jpaged_qdot_packed", 8: "jpaged_qdot_int8"}.get(
        bits(codes, x.shape[-1]), "jpaged_qdot_narrow"
    )
    tiled = ordered(codes, x.shape[-1], int8, tiled)
    xs = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call: Any = jax.ffi.ffi_call(
        name, jax.ShapeDtypeStruct((xs.shape[0], codes.shape[-1]), jnp.float32),
        vmap_method="sequential",
    )  # fmt: skip
    # without offsets (super-scales) the scale (super-scale, or scale) stands in for them:
    # never read
    supers = supers or (scale, scale)
    y = call(
        xs, codes, scale, scale if offset is None else offset, supers[0],
        supers[0] if supers[1] is None else supers[1], jnp.asarray(layer, jnp.int32),
        affine=offset is not None, int8=int8, tiled=tiled,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], codes.shape[-1])


def levels(
    parts: tuple[jax.Array, ...],
) -> tuple[jax.Array, jax.Array, jax.Array | None, tuple[jax.Array, jax.Array | None] | None]:
    """A quantized weight's parts as `models.quant.QuantWeight.held` lays them out: codes,
    scale, offset (or None) and super-scales (int8 scales' float16 scale and offset (or
    None); None for float scales)."""
    codes, scale, *rest = parts
    if scale.dtype != jnp.int8:
        return codes, scale, rest[0] if rest else None, None
    if len(rest) == 3:
        return codes, scale, rest[0], (rest[1], rest[2])
    return codes, scale, None, (rest[0], None)


def dot_t(x: jax.Array, parts: tuple[jax.Array, ...], int8: bool = False) -> jax.Array:
    """float32 scores `x [tokens, in] @ w.T` of a table `w [rows, in]` as
    `models.quant.held` gives it (sub-blocks along `in`; int8 sub-scales' float16 super-
    scales `[rows, in / block / group]`): a tied LM head. `int8`: `x` rounded to int8 per run
    of 32 inputs and dotted in integers (`takes_int8_t`)."""
    codes, scale, offset, supers = levels(parts)
    if codes.dtype not in KERNEL_CODES:
        raise ValueError(f"qdot.dot_t reads int8 or packed uint8 codes, not {codes.dtype}")
    group = 0 if supers is None else scale.shape[-1] // supers[0].shape[-1]
    if int8 and not takes_int8_t(codes, scale, offset is not None, group):
        raise ValueError(
            f"qdot.dot_t does not round inputs to int8 for {codes.dtype} codes with "
            f"{scale.dtype} scales" + (f" in groups of {group}" if group else "")
        )
    name = "jpaged_qdot_t_packed" if codes.dtype == jnp.uint8 else "jpaged_qdot_t_int8"
    call: Any = jax.ffi.ffi_call(
        name, jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32),
        vmap_method="sequential",
    )  # fmt: skip
    supers = supers or (scale, scale)  # as `dot`'s: stand-ins never read
    return call(
        x.astype(jnp.float32), codes, scale, scale if offset is None else offset, supers[0],
        supers[0] if supers[1] is None else supers[1], affine=offset is not None, int8=int8,
    )  # fmt: skip


def _experts(parts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Stacks `[layers, E, ...]` as `[layers * E, ...]` (each expert a layer of `dot`'s)."""
    return tuple(p.reshape(-1, *p.shape[2:]) for p in parts)


def usable_id(
    rows: int, values: int, parts: tuple[jax.Array, ...], int8: bool = False, tiled: bool = False
) -> bool:
    """Whether `dot_id` takes `rows` inputs of `values` against expert stacks `parts`
    `[layers, E, ...]` here: as `usable` takes inputs `[rows, values]` against each expert's
    matrix."""
    x = cast(jax.Array, jax.ShapeDtypeStruct((rows, values), jnp.float32))  # its shape alone
    return parts[0].ndim == 4 and usable(x, _experts(parts), int8, tiled)


def dot_id(
    x: jax.Array,
    ids: jax.Array,
    parts: tuple[jax.Array, ...],
    layer: jax.Array,
    int8: bool = False,
    tiled: bool = False,
) -> jax.Array:
    """float32 `[T, k, out]`: each (token t, expert ids[t, j]) pair's input, `x [T, in]` (a
    token's for all its experts) or `[T, k, in]` (a pair's own), times its expert's matrix
    in stacks `parts` `[layers, E, ...]` (as `dot`'s `parts`, each expert's a weight) at
    `layer`: only the routed pairs' products, an expert's pairs together (its codes read
    once for all of them), experts no pair chose never read (llama.cpp's `mul_mat_id`).
    `int8`, `tiled`: as `dot`'s (`usable_id`)."""
    codes = parts[0]
    t, k = ids.shape
    values = x.shape[-1]
    if codes.dtype not in KERNEL_CODES:
        raise ValueError(f"qdot.dot_id reads int8 or packed uint8 codes, not {codes.dtype}")
    if int8 and not takes_int8(codes, parts[1], levels(parts)[2] is not None):
        raise ValueError(f"qdot.dot_id does not round inputs to int8 for {codes.dtype} codes")
    codes, scale, offset, supers = levels(parts)
    name = {4: "jpaged_qdot_id_packed", 8: "jpaged_qdot_id_int8"}.get(
        bits(codes, values), "jpaged_qdot_id_narrow"
    )
    xs = x.reshape(-1, values).astype(jnp.float32)
    call: Any = jax.ffi.ffi_call(
        name, jax.ShapeDtypeStruct((t * k, codes.shape[-1]), jnp.float32),
        vmap_method="sequential",
    )  # fmt: skip
    supers = supers or (scale, scale)  # as `dot`'s: stand-ins never read
    y = call(
        xs, ids.astype(jnp.int32), codes, scale, scale if offset is None else offset, supers[0],
        supers[0] if supers[1] is None else supers[1], jnp.asarray(layer, jnp.int32),
        affine=offset is not None, int8=int8, tiled=ordered(codes, values, int8, tiled),
    )  # fmt: skip
    return y.reshape(t, k, codes.shape[-1])
