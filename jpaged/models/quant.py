"""Weights held quantized on the device: int8 codes plus a float32 scale (and, for affine
types, offset) per sub-block along the contraction axis, `value = code * scale + offset`;
float16 scales (`half`) where a GGUF type's own are (one float16 a block: exact, and a
4-bit matrix then holds 4.5 bits a weight, as its file does, not 5). A K-quant's scales
come in two levels, as its file holds them (`group`): an int8 sub-scale a sub-block and a
float16 a super-block of `group` sub-blocks, the scale their product (exact in float32):
Q4_K 4.625 bits a weight rather than 6 with float32 scales and offsets.
4-bit types keep their codes packed, two a byte (`packed`: uint8, half as many along the
contraction axis; symmetric ones centred on 8, as Q4_0's); Q6_K's and Q5_*'s codes, where
the CPU kernels read them (AVX2), at their own bits (`narrow`: uint8, six or five bits each,
`qdot.narrow`'s order);
`quantization="fp8"` holds float8_e4m3 codes instead of int8 (a GPU's dot converts them
as it reads them).

One form for every family: a `QuantWeight` module takes the place of a float `nnx.Param`
(a `Linear`'s kernel, the embedding table, hence the tied LM head), built by the loader
when the checkpoint's tensor is quantized (`models.gguf_blocks` for GGUF). It is
dequantized inside the jitted step, one layer at a time inside the layer scan (or only
the rows a step looks up, for the embedding): never a resident float copy.

The matmul dequantizes a slice of the weight at a time and dots it (`benchmarks/bench_quant.py`:
on XLA:CPU the converted slice stays in cache, 2-3x faster than float32 weights and than
converting a whole layer's matrix, per-sub-block dots or int8 activations with int32 dots).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from jpaged.dtypes import KV_QUANT
from jpaged.models import fused, qdot, sharding

# Weights dequantized at a time on a CPU (measured, benchmarks/bench_quant.py): a kernel's
# 256 KiB as float32 (within a core's L2); a tied LM head's 4 MiB slices of its vocabulary
# (Gemma 3's 262K rows would be 4096 small dots of 64 rows otherwise).
CHUNK, HEAD_CHUNK = 1 << 16, 1 << 20
NIBBLES = 32  # packed codes: byte j of each 16 holds values j (low nibble) and j + 16
FP8 = KV_QUANT["fp8_e4m3"][0]  # fp8 weight codes: the KV cache's e4m3


class Form(NamedTuple):
    """How a weight is held: codes in sub-blocks of `block` along the contraction axis, an
    offset per sub-block when `affine`, two 4-bit codes a byte when `packed`, float8_e4m3
    codes rather than int8 when `fp8`, scales (and offsets) float16 rather than float32
    when `half`; with `group`, int8 sub-scales (and sub-offsets) times a float16 each
    `group` sub-blocks (a K-quant's super-block; on a CPU with one device); `bits` the
    codes' own (a GGUF type's: Q6_K's 6, Q5_*'s 5), held at those bits in the int8 kernel's
    order when `narrow` (a kernel's whose inputs are rounded to int8, `narrow_takes`). A
    table `[rows, in]` is held as the kernel `[in, rows]` when `transposed` (a tied head
    whose codes are to be narrow: `table_as_kernel`). `tiled`: a kernel's codes lie in the
    CPU kernels' order (`qdot.tile`; narrow ones always, packed ones where `tiled_takes`,
    any with int8 inputs)."""

    block: int
    affine: bool
    packed: bool = False
    fp8: bool = False
    half: bool = False
    group: int = 0
    narrow: bool = False
    bits: int = 8
    transposed: bool = False
    tiled: bool = False

    @property
    def scale(self) -> np.dtype:
        """The scales' (and offsets') dtype: with `group`, the sub-scales'."""
        return np.dtype(np.int8 if self.group else np.float16 if self.half else np.float32)

    def one_level(self) -> Form:
        """The same values with one float32 scale (and offset) a sub-block: what a GPU's
        or a mesh's weights hold."""
        return self._replace(group=0, narrow=False, transposed=False, tiled=False)

    @property
    def code(self) -> np.dtype:
        """The codes' dtype."""
        return np.dtype(np.uint8 if self.packed or self.narrow else FP8 if self.fp8 else np.int8)

    def code_rows(self, values: int) -> int:
        """Codes held for `values` along the contraction axis."""
        return (
            values // 2
            if self.packed
            else values // qdot.RUN * 4 * self.bits
            if self.narrow
            else values
        )


class Mixed(NamedTuple):
    """A stacked weight whose layers' types want different forms (a Q4_K_M file's FFN down:
    Q4_K in some layers, Q6_K in others): each form a stack of its own layers, layer l in
    `forms[of_layer[l]]`. One form for all would hold every layer at the widest of both (a
    Q4_K layer as int8 codes with float32 scales and offsets a 16: 12 bits a weight, not 6)."""

    forms: tuple[Form, ...]
    of_layer: tuple[int, ...]

    def slots(self) -> tuple[int, ...]:
        """Each layer's place in its form's stack."""
        return tuple(self.of_layer[:layer].count(i) for layer, i in enumerate(self.of_layer))

    def count(self, i: int) -> int:
        """Layers held in form i."""
        return self.of_layer.count(i)


# a QuantWeight's arrays, as `held` gives them
ARRAYS = ("codes", "scale", "offset", "scale_super", "offset_super")
# state path of a weight (`layers.attn.q.kernel`) -> its form
Layout = Mapping[str, Form | Mixed]


class QuantWeight(nnx.Module):
    """A matrix `[..., rows, cols]` as int8 `codes` (uint8, two a byte: `packed`; or
    float8_e4m3), float32 (or float16) `scale` `[..., rows, cols / block]` (blocks along
    `axis`, the contraction axis: -2 for a kernel `[in, out]`, -1 for an embedding table
    `[vocab, hidden]`) and optional `offset` like `scale`; it reads as `dtype`. With
    `supers` (a `Form.group` weight's), `scale` and `offset` are int8 and each is times its
    float16 super-scale, `group` sub-blocks along `axis` a super-block (a kernel's `[...,
    rows / group, cols]`). `bits`, `narrow`, `transposed` (a table held as its kernel,
    `axis` -2), `tiled`: as `Form`'s. They lie on the mesh as the float weight it replaces would."""

    def __init__(
        self,
        codes: Any,
        scale: Any,
        offset: Any | None,
        *,
        axis: int,
        dtype: Any,
        metadata: Mapping[str, Any],
        supers: tuple[Any, Any | None] | None = None,
        narrow: bool = False,
        bits: int = 8,
        transposed: bool = False,
        tiled: bool = False,
    ) -> None:
        keep = (
            "eager_sharding",
            "out_sharding",
            "kv_heads",
            "whole",
        )  # placement, as the float weight's
        meta = {k: v for k, v in metadata.items() if k in keep}
        self.codes = nnx.Param(codes, **meta)
        self.scale = nnx.Param(scale, **meta)
        self.offset = None if offset is None else nnx.Param(offset, **meta)
        scale_super, offset_super = supers or (None, None)
        self.scale_super = None if scale_super is None else nnx.Param(scale_super, **meta)
        self.offset_super = None if offset_super is None else nnx.Param(offset_super, **meta)
        self.axis, self.dtype = axis, jnp.dtype(dtype)
        self.narrow, self.bits, self.transposed, self.tiled = narrow, bits, transposed, tiled
        # set while a scan over a stack of layers reads this weight where it lies in the
        # stack (`read_in_place`): which layer of it this is
        self.layer: jax.Array | None = None
        # its inputs rounded to int8 where the CPU kernels take them (`round_inputs`)
        self.int8_inputs = False

    @property
    def packed(self) -> bool:
        return self.codes.dtype == jnp.uint8 and not self.narrow

    @property
    def rows(self) -> int:
        """Values along the contraction axis."""
        held = self.codes.shape[self.axis]
        return held * 8 // (4 if self.packed else self.bits if self.narrow else 8)

    @property
    def values(self) -> int:
        """How many weights it holds."""
        return self.codes.size // self.codes.shape[self.axis] * self.rows

    @property
    def form(self) -> Form:
        block = self.rows // self.scale.shape[self.axis]
        fp8, half = self.codes.dtype == FP8, self.scale.dtype == np.float16
        supers = self.scale_super
        group = 0 if supers is None else self.rows // block // supers.shape[self.axis]
        affine = self.offset is not None
        return Form(
            block, affine, self.packed, fp8, half, group, self.narrow, self.bits,
            self.transposed, self.tiled,
        )  # fmt: skip

    def arrays(self) -> tuple[jax.Array, ...]:
        """codes, float scale (and offset): what `dense` reads (narrow codes as int8)."""
        codes, *rest = one_level(at_layer(*self.held()), self.axis)
        affine = self.offset is not None
        return (qdot.untile(codes, self.rows, affine) if self.tiled else codes, *rest)

    def held(self) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
        """codes, scale (and offset) as they lie, then any super-scales (and super-offsets),
        and which layer of them this weight is (None: all of them)."""
        held = (self.codes, self.scale, self.offset, self.scale_super, self.offset_super)
        return tuple(p[...] for p in held if p is not None), self.layer

    def specs(self) -> tuple[PartitionSpec, ...]:
        return tuple(
            sharding.spec_of(p) for p in (self.codes, self.scale, self.offset) if p is not None
        )


class MixedWeight(nnx.Module):
    """A stacked matrix held as `Mixed` says: a QuantWeight stack a form (`stacks`, each
    only its layers), and per layer (`which`, `slot`: int32 `[layers]`, scanned with the
    layers' state, so a layer's body sees its own two numbers) the stack holding it and its
    place there. A layer's matmul is a switch between the stacks' (`matmul`): each branch
    hands the CPU kernels its stack whole, as `read_in_place` does."""

    def __init__(self, stacks: list[QuantWeight], which: Any, slot: Any) -> None:
        self.stacks = nnx.List(stacks)
        self.which, self.slot = nnx.Variable(which), nnx.Variable(slot)
        self.dtype = stacks[0].dtype

    @property
    def mixed(self) -> Mixed:
        return Mixed(
            tuple(w.form for w in self.stacks), tuple(np.asarray(self.which[...]).tolist())
        )


Weight = nnx.Param | QuantWeight | MixedWeight


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """`x [..., in] @ w`: `dot` on the weight's arrays (in a layer scan, a `MixedWeight`'s
    layer from the stack holding it)."""
    if isinstance(w, MixedWeight):
        branches = [functools.partial(matmul, w=stack) for stack in w.stacks]
        return lax.switch(w.which[...], branches, x)
    parts, layer = held(w)
    return dot(x, parts, w.dtype, layer, int8_inputs(w), isinstance(w, QuantWeight) and w.tiled)


def arrays(w: nnx.Param | QuantWeight) -> tuple[jax.Array, ...]:
    """A weight as the arrays `dense` takes: a float one alone, or a QuantWeight's codes,
    scale (and offset); `specs`: where each lies on the mesh."""
    return w.arrays() if isinstance(w, QuantWeight) else (w[...],)


def specs(w: nnx.Param | QuantWeight) -> tuple[PartitionSpec, ...]:
    return w.specs() if isinstance(w, QuantWeight) else (sharding.spec_of(w),)


def held(w: nnx.Param | QuantWeight) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
    """`arrays(w)` as they lie and the layer of them `w` is (`QuantWeight.held`): what `dot`,
    `dot_t` and `take_rows` take."""
    return w.held() if isinstance(w, QuantWeight) else ((w[...],), None)


def int8_inputs(w: nnx.Param | QuantWeight) -> bool:
    """Whether `dot` may round `w`'s inputs to int8 (`round_inputs`)."""
    return isinstance(w, QuantWeight) and w.int8_inputs


def int8_takes(w: QuantWeight) -> bool:
    """Whether `activations="int8"` rounds the inputs of `w`'s matmuls to int8: a kernel
    `[in, out]` whose codes and scales `qdot.takes_int8` (`qdot.dot`'s `int8`, its codes
    then `tiled`), or a table `[rows, in]` (a tied head's) that `qdot.takes_int8_t`."""
    if w.axis == -2:
        return qdot.takes_int8(w.codes, w.scale, w.offset is not None)
    return qdot.takes_int8_t(w.codes, w.scale, w.offset is not None, w.form.group)


def narrow_takes(w: QuantWeight) -> bool:
    """Whether `w`'s codes may be held at their own bits (`Form.narrow`): int8 codes of a
    kernel `[in, out]` narrower than a byte where they may be `tiled` (`tiled_takes`)."""
    return _narrower(w) and tiled_takes(w)


def tiled_takes(w: QuantWeight) -> bool:
    """Whether `w`'s codes lie in the CPU kernels' order (`Form.tiled`) whatever its inputs:
    those of a kernel `[in, out]`, packed or narrow (`narrow_takes`), in a shape the int8
    kernels take (`int8_takes`), on a CPU. Read as they lie in the packed order, a thread's
    codes come as 16 streams `out` bytes apart: an 8B step's float-input matmuls of Q4_K codes
    took 134 ms, 107 tiled (benchmarks/RESULTS.md, 2026-11-29)."""
    kinds = w.packed or _narrower(w)
    return w.axis == -2 and kinds and jax.default_backend() == "cpu" and int8_takes(w)


def _narrower(w: QuantWeight) -> bool:
    """int8 codes of a type narrower than a byte (Q6_K's, Q5_*'s)."""
    return 4 < w.bits < 8 and w.codes.dtype == jnp.int8


def round_inputs(module: nnx.Module) -> int:
    """`activations="int8"`: mark `module`'s weights that `int8_takes`, a kernel's codes laid
    in `qdot.tile`'s order (by the loader, `models.loader.assemble`); how many weights that is.
    A static attribute of each weight, hence of the traced step."""
    held = [
        w for _, w in nnx.iter_modules(module)
        if isinstance(w, QuantWeight) and not w.int8_inputs and int8_takes(w)
    ]  # fmt: skip
    for w in held:
        w.int8_inputs = True
    return len(held)


def one_level(parts: tuple[jax.Array, ...], axis: int = -2) -> tuple[jax.Array, ...]:
    """`held` parts with one float32 scale (and offset) a sub-block: two-level ones' sub-
    scales times their super-scales (exact: a float16 times a small integer; groups of
    sub-blocks along `axis`, the contraction axis), others as they are."""
    if len(parts) < 3:
        return parts
    codes, scale, offset, supers = qdot.levels(parts)
    if supers is None:
        return parts
    group = scale.shape[axis] // supers[0].shape[axis]

    def times(sub: jax.Array, sup: jax.Array | None) -> jax.Array:
        assert sup is not None
        return sub.astype(jnp.float32) * jnp.repeat(sup.astype(jnp.float32), group, axis=axis)

    return codes, times(scale, supers[0]), *(() if offset is None else (times(offset, supers[1]),))


def at_layer(parts: tuple[jax.Array, ...], layer: jax.Array | None) -> tuple[jax.Array, ...]:
    """Layer `layer` of stacks `parts` (None: `parts` as they are)."""
    if layer is None:
        return parts
    return tuple(lax.dynamic_index_in_dim(p, layer, keepdims=False) for p in parts)


def in_place(stack: nnx.Module, also: nnx.filterlib.Filter | None = None) -> nnx.filterlib.Filter:
    """The state of `stack`'s quantized weights, as an `nnx.split` filter: what a scan over
    its layers leaves whole for `read_in_place`; `also`: a filter of more (`whole`)."""
    paths = {path for path, m in nnx.iter_modules(stack) if isinstance(m, QuantWeight)}
    if also is None:
        return lambda path, _: path[:-1] in paths
    return nnx.Any(lambda path, _: path[:-1] in paths, also)


def whole(stack: nnx.Module) -> nnx.filterlib.Filter | None:
    """The state of `stack`'s weights marked `whole` (a mixture's experts, `models.moe`), as
    an `nnx.split` filter: what a scan over its layers leaves whole; None: there are none."""
    marked = [
        path for path, v in nnx.to_flat_state(nnx.state(stack)) if v.get_metadata().get("whole")
    ]
    if not marked:
        return None
    paths = set(marked)
    return lambda path, _: tuple(path) in paths


def has_mixed(stack: nnx.Module) -> bool:
    """Whether `stack` holds a MixedWeight."""
    return any(isinstance(m, MixedWeight) for _, m in nnx.iter_modules(stack))


def read_in_place(layer: nnx.Module, index: jax.Array, whole_only: bool = False) -> None:
    """Mark `layer`'s quantized weights, merged whole from their stacks, as layer `index` of
    them: `dot` hands the CPU kernels the stack and the index (the slice XLA would cut out
    for them is a copy, as many bytes a step as the weights); every other reader gets the
    slice (`QuantWeight.arrays`)."""
    mixed = [m for _, m in nnx.iter_modules(layer) if isinstance(m, MixedWeight)]
    if whole_only:  # only those held whole (`whole`): the others the scan sliced
        mixed = [m for m in mixed if m.stacks[0].codes.get_metadata().get("whole")]
    for m in mixed:
        for stack in m.stacks:
            stack.layer = m.slot[...]
    inside = {id(stack) for m in mixed for stack in m.stacks}
    for _, w in nnx.iter_modules(layer):
        if not isinstance(w, QuantWeight) or id(w) in inside:
            continue
        if not whole_only or w.codes.get_metadata().get("whole"):
            w.layer = index


def unpacked(codes: jax.Array, axis: int, symmetric: bool) -> jax.Array:
    """int8 codes of packed ones (uint8, two a byte along `axis`); the others as they are."""
    if codes.dtype != jnp.uint8:
        return codes
    axis %= codes.ndim
    split = (*codes.shape[:axis], -1, 1, NIBBLES // 2, *codes.shape[axis + 1 :])
    pairs = codes.reshape(split)
    both = jnp.concatenate([pairs & 15, pairs >> 4], axis=axis + 1).astype(jnp.int8)
    shape = list(codes.shape)
    shape[axis] *= 2
    return (both - 8 if symmetric else both).reshape(shape)


def dense(parts: tuple[jax.Array, ...], axis: int, dtype: Any) -> jax.Array:
    """The float matrix of `arrays(w)`: `codes * scale + offset`, each scale/offset spread
    over its sub-block of `axis`, computed in float32 (in the scan: one layer's)."""
    if len(parts) == 1:
        return parts[0]
    codes, scale, *offset = parts
    codes = unpacked(codes, axis, symmetric=not offset)
    # Sub-blocks as an axis of their own, the scales broadcast along it: XLA:CPU vectorises
    # that; a `jnp.repeat` of the scales along `axis` made the Q8_0 LM head of SmolLM2 3.7x
    # slower (30 vs 8 ms a step at one token).
    axis %= codes.ndim
    blocks = scale.shape[axis]
    split = (*codes.shape[:axis], blocks, codes.shape[axis] // blocks, *codes.shape[axis + 1 :])
    w = codes.reshape(split).astype(jnp.float32) * jnp.expand_dims(scale, axis + 1)
    if offset:
        w = w + jnp.expand_dims(offset[0], axis + 1)
    return w.reshape(codes.shape).astype(dtype)


def _chunk(rows: int, cols: int, unit: int, limit: int) -> int:
    """Rows of a `[rows, cols]` matrix to dequantize at a time: a multiple of `unit` (a
    sub-block, when the rows are the contraction axis) dividing `rows`, as many as keep the
    float slice within `limit` values. Off a CPU all rows at once: XLA GPU fuses the
    conversion into the dot, and a scan of small dots would leave the GPU idle."""
    if jax.default_backend() != "cpu":
        return rows
    units = rows // unit
    fits = [k for k in range(1, units + 1) if units % k == 0 and k * unit * cols <= limit]
    return unit * max(fits, default=1)


def dot(
    x: jax.Array,
    parts: tuple[jax.Array, ...],
    dtype: Any,
    layer: jax.Array | None = None,
    int8: bool = False,
    tiled: bool = False,
) -> jax.Array:
    """`x [..., in] @ w [in, out]`, `w` given as `arrays(w)` (quantized: sub-blocks along
    `in`; with `layer`, as `held(w)`: stacks of which `w` is that layer): a scan over slices
    of `in`, each dequantized (`codes * scale`) and dotted, the products summed; the offsets'
    share is one small dot of `x`'s sub-block sums. Packed codes are dotted as they lie:
    their low nibbles with the inputs they hold, then the high. Where the CPU kernels serve
    (`qdot.usable`), theirs; `int8` (the codes in `qdot.tile`'s order): theirs with `x`
    rounded to int8 where they can. `tiled`: the codes in `qdot.tile`'s order (as they are
    with `int8`, and narrow ones always)."""
    tiled = qdot.ordered(parts[0], x.shape[-1], int8, tiled)
    if qdot.usable(x, parts, int8, tiled):
        return qdot.dot(x, parts, layer, int8, tiled).astype(x.dtype)
    parts = one_level(at_layer(parts, layer))
    if tiled:
        parts = (qdot.untile(parts[0], x.shape[-1], len(parts) > 2), *parts[1:])
    if len(parts) == 1:
        return x @ parts[0]
    codes, scale, *offset = parts
    packed = codes.dtype == jnp.uint8
    held, o = codes.shape
    i = held * (2 if packed else 1)
    # One symmetric scale per output column (int8's per channel) factors out of the sum:
    # the slices are the codes alone, the scale multiplies the product once.
    channel = not offset and scale.shape[0] == 1
    per_block = held // scale.shape[0]  # rows of codes a scale covers
    rows = _chunk(held, o, 1 if channel else per_block, CHUNK)
    n = held // rows
    xs = x.reshape(-1, i)
    if packed:  # the inputs of the low nibbles, then those of the high ones
        pairs = xs.reshape(-1, i // NIBBLES, 2, NIBBLES // 2)
        halves = [pairs[:, :, k].reshape(-1, held) for k in (0, 1)]
    else:
        halves = [xs]
    xcs = [h.reshape(-1, n, rows).swapaxes(0, 1) for h in halves]  # [n, tokens, rows]
    chunks = (codes.reshape(n, rows, o), *(() if channel else (scale.reshape(n, -1, o),)))

    def one(acc: jax.Array, c: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        *xc, w = c[: len(xcs) + 1]
        # symmetric packed codes are centred on 8 (the offsets' share is added apart)
        nibbles = (w & 15, w >> 4) if packed else (w,)
        for xk, q in zip(xc, nibbles, strict=True):
            q = q.astype(jnp.int8) - (0 if offset else 8) if packed else q
            wc = q.astype(dtype) if channel else dense((q, c[-1]), -2, dtype)
            acc = acc + jnp.dot(xk, wc, preferred_element_type=acc.dtype)
        return acc, None

    acc = jnp.zeros((xs.shape[0], o), jnp.float32)
    if offset:  # its share of the sum is each sub-block's sum of `x` times its offset
        sums = xs.reshape(-1, scale.shape[0], i // scale.shape[0]).sum(-1, dtype=jnp.float32)
        acc = jnp.dot(sums, offset[0], preferred_element_type=acc.dtype)
    y, _ = lax.scan(one, acc, (*xcs, *chunks))
    if channel:
        y = y * scale
    return y.astype(x.dtype).reshape(*x.shape[:-1], o)


def dot_t(x: jax.Array, parts: tuple[jax.Array, ...], dtype: Any, int8: bool = False) -> jax.Array:
    """float32 `x [b, in] @ w.T` for `w [rows, in]` given as `held(w)`'s arrays (quantized:
    sub-blocks along `in`), as a tied LM head scores: a map over slices of `rows`. `int8`:
    the table kernel's with `x` rounded to int8 (a table that `qdot.takes_int8_t`), where it
    serves."""
    if len(parts) == 1:
        return jnp.einsum("bh,vh->bv", x, parts[0], preferred_element_type=jnp.float32)
    if qdot.usable_t(x, parts):
        return qdot.dot_t(x, parts, int8)
    v, h = parts[0].shape
    rows = _chunk(v, h, 1, HEAD_CHUNK)
    chunks = tuple(p.reshape(v // rows, rows, -1) for p in parts)

    def one(c: tuple[jax.Array, ...]) -> jax.Array:
        w = dense(one_level(c, -1), -1, dtype)
        return jnp.einsum("bh,vh->bv", x, w, preferred_element_type=jnp.float32)

    return lax.map(one, chunks).transpose(1, 0, 2).reshape(x.shape[0], v)


def take_rows(parts: tuple[jax.Array, ...], ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows `ids` of a table `[rows, cols]` given as `held(w)`'s arrays (quantized: blocks
    along its cols): only those rows dequantized (and their scales' two levels multiplied)."""
    return dense(one_level(tuple(p[ids] for p in parts), -1), -1, dtype)


def take_columns(w: QuantWeight, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a table held as its kernel (`Form.transposed`: `[in, rows]`, the codes
    in `qdot.tile`'s order, narrow or int8), as `take_rows` gives a table's: of the codes
    only each id's group of 8 columns read (a run's bytes of a group lie together), those
    widened, its column picked."""
    (codes, *scales), _ = w.held()
    runs, groups = w.rows // qdot.RUN, codes.shape[-1] // 8
    picked = codes.reshape(runs, groups, -1)[:, ids // 8]  # [runs, T, a group's bytes a run]
    picked = picked.transpose(1, 0, 2).reshape(ids.shape[0], -1, 8)  # T kernels [in', 8]
    values = qdot.untile(picked, w.rows, w.offset is not None)  # [T, in, 8] int8
    column = jnp.take_along_axis(values, (ids % 8)[:, None, None], axis=-1)[..., 0]
    return dense(one_level((column, *(p[:, ids].T for p in scales)), -1), -1, w.dtype)


def table_as_kernel(form: Form, rows: int) -> bool:
    """Whether a tied head's table of `rows` held in `form` goes to the device as its kernel
    (`Form.transposed`) on a CPU: codes narrower than a byte (Q6_K's) lie at their own bits
    only in the kernels' order, which the head's matmul then reads (the table kernels read
    int8 codes: 8 bits a weight for 6)."""
    held = max(qdot.RUN, form.block)  # values along the contraction axis, any will do
    codes = jax.ShapeDtypeStruct((held, rows), jnp.int8)
    scale = jax.ShapeDtypeStruct((held // form.block, rows), form.scale)
    on_cpu = jax.default_backend() == "cpu"
    return 4 < form.bits < 8 and on_cpu and qdot.takes_int8(codes, scale, form.affine)


def quantize(module: nnx.Module, layout: Layout, devices: int) -> None:
    """Replace the (abstract) float weights of `module` at `layout`'s paths with abstract
    QuantWeights (MixedWeights) of the same shape and placement. ValueError when a weight
    split over `devices` along its sub-block axis would split a sub-block."""
    for path, form in layout.items():
        *parents, name = path.split(".")
        owner = module
        for p in parents:
            owner = getattr(owner, p)
        w = getattr(owner, name)
        shape = tuple(w.shape)
        forms = form.forms if isinstance(form, Mixed) else (form,)
        if devices > 1 and (isinstance(form, Mixed) or any(f.group for f in forms)):
            why = (
                f"its layers are held in {len(forms)} forms"
                if isinstance(form, Mixed)
                else "its scales are held in two levels"
            )
            raise ValueError(
                f"{path}: {why}, which tensor parallelism does not split: load the model "
                "with models.load(..., tensor_parallel=N), which holds one form of one level "
                "a weight"
            )
        if isinstance(form, Mixed):
            stacks = [
                _abstract(path, w, f, devices, (form.count(i), *shape[1:]))
                for i, f in enumerate(form.forms)
            ]
            layers = jax.ShapeDtypeStruct((len(form.of_layer),), jnp.int32)
            setattr(owner, name, MixedWeight(stacks, layers, layers))
        else:
            setattr(owner, name, _abstract(path, w, form, devices, shape))


def _abstract(
    path: str, w: nnx.Param, form: Form, devices: int, shape: tuple[int, ...]
) -> QuantWeight:
    """An abstract QuantWeight of `shape` in `form`, placed as float weight `w` is."""
    block, affine, packed = form.block, form.affine, form.packed
    axis = -2 if path.endswith(".kernel") or form.transposed else -1
    if form.transposed:
        shape = shape[::-1]
    if shape[axis] % block or (packed and block % NIBBLES):
        raise ValueError(
            f"{path}: {shape[axis]} values do not split into sub-blocks of {block}"
            + (f" (packed: of a multiple of {NIBBLES})" if packed else "")
        )
    scale_shape = list(shape)
    scale_shape[axis] //= block
    meta = w.get_metadata()
    split = meta.get("out_sharding") or ()
    split_here = len(split) == len(shape) and split[axis] == sharding.AXIS
    if devices > 1 and split_here and scale_shape[axis] % devices:
        raise ValueError(
            f"{path}: {scale_shape[axis]} sub-blocks of {block} do not split over "
            f"tensor_parallel={devices} devices (a sub-block would straddle two); "
            "load it with quantization='none'"
        )
    s = jax.ShapeDtypeStruct(tuple(scale_shape), form.scale)
    supers = None
    if form.group:
        if scale_shape[axis] % form.group:
            raise ValueError(f"{path}: two-level scales are for whole super-blocks")
        scale_shape[axis] //= form.group
        u = jax.ShapeDtypeStruct(tuple(scale_shape), np.float16)
        supers = (u, u if affine else None)
    code_shape = list(shape)
    code_shape[axis] = form.code_rows(shape[axis])
    codes = jax.ShapeDtypeStruct(tuple(code_shape), form.code)
    return QuantWeight(
        codes, s, s if affine else None, axis=axis, dtype=w.dtype, metadata=meta, supers=supers,
        narrow=form.narrow, bits=form.bits, transposed=form.transposed, tiled=form.tiled,
    )  # fmt: skip


def quantized(module: nnx.Module) -> list[tuple[str, QuantWeight | MixedWeight]]:
    """`module`'s quantized weights by state path (a MixedWeight's stacks within it)."""
    found = [
        (p, w) for p, w in nnx.iter_modules(module) if isinstance(w, QuantWeight | MixedWeight)
    ]
    mixed = [p for p, w in found if isinstance(w, MixedWeight)]
    return [
        (".".join(map(str, p)), w)
        for p, w in found
        if not any(p[: len(m)] == m and p != m for m in mixed)
    ]


def layout_of(module: nnx.Module) -> dict[str, Form | Mixed]:
    """The layout `quantize` would give `module` the quantized weights it has."""
    return {
        path: w.mixed if isinstance(w, MixedWeight) else w.form for path, w in quantized(module)
    }


def footprint(module: nnx.Module) -> tuple[int, int]:
    """(bytes, values) of `module`'s weights: what they occupy on the devices (all shards)
    and the weight values they stand for (a QuantWeight's scales and offsets not counted)."""
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(module)))
    held = [w for _, w in nnx.iter_modules(module) if isinstance(w, QuantWeight)]
    arrays = sum(a.size for w in held for a in w.held()[0])
    values = sum(x.size for x in jax.tree.leaves(nnx.state(module))) - arrays
    return nbytes, values + sum(w.values for w in held)


def describe(module: nnx.Module) -> str:
    """One line for a start-up log: how the weights are held and their bytes."""
    layout = layout_of(module)
    held = [f for m in layout.values() for f in (m.forms if isinstance(m, Mixed) else (m,))]
    nbytes, values = footprint(module)
    kinds = {"4-bit codes two a byte": sum(f.packed for f in held)}
    for n in qdot.NARROW:
        kinds[f"{n}-bit codes"] = sum(f.narrow and f.bits == n for f in held)
    kinds["fp8 (e4m3) codes"] = sum(f.fp8 for f in held)
    kinds["int8 codes"] = len(held) - sum(kinds.values())
    codes = ", ".join(f"{n} as {kind}" for kind, n in kinds.items() if n)
    scales = " or ".join(sorted({"int8 x float16" if f.group else str(f.scale) for f in held}))
    how = (
        f"{len(layout)} matrices quantized ({codes}; {scales} scales per sub-block of "
        f"{', '.join(map(str, sorted({f.block for f in held})))}), the rest float"
        if held
        else "float"
    )
    if groups := sorted({f.group for f in held if f.group}):
        how += f"; int8 x float16: a float16 each {' or '.join(map(str, groups))} sub-blocks"
    if mixed := sum(isinstance(m, Mixed) for m in layout.values()):
        how += f"; {mixed} of them in a form a type, by layer"
    rounded = sum(w.int8_inputs for _, w in nnx.iter_modules(module) if isinstance(w, QuantWeight))
    if rounded:
        how += f"; inputs of {rounded} rounded to int8 (a scale per 32, the CPU kernels)"
    return f"{how}: {nbytes / 1e6:.1f} MB, {8 * nbytes / values:.2f} bits per weight"


def dequantized(module: nnx.Module) -> dict:
    """`nnx.to_pure_dict` of `module`'s state, each QuantWeight's arrays replaced by the float
    matrix they hold and fused projections apart (the weights as a float checkpoint has
    them: for checks and export)."""
    pure: dict[Any, Any] = nnx.to_pure_dict(nnx.state(module))
    for path, w in quantized(module):
        *parents, name = path.split(".")
        node = pure
        for p in parents:
            node = node[p]
        if isinstance(w, MixedWeight):
            stacks = [stack.arrays() for stack in w.stacks]
            node[name] = jnp.stack(
                [
                    dense(at_layer(stacks[i], jnp.int32(slot)), w.stacks[i].axis, w.dtype)
                    for i, slot in zip(w.mixed.of_layer, w.mixed.slots(), strict=True)
                ]
            )
        else:
            node[name] = dense(w.arrays(), w.axis, w.dtype)
            if w.transposed:  # as the checkpoint's table
                node[name] = node[name].T
    config = getattr(module, "config", None)
    if config is None or "layers" not in pure:
        return pure
    # (every weight lies on the devices the fused ones are split over)
    return fused.apart(pure, config, fused.ways(jax.tree.leaves(nnx.state(module))[0]))
