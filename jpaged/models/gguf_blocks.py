"""GGUF quantized blocks -> int8 codes, a scale per sub-block and (affine types) an offset
per sub-block: `value = code * scale + offset`. The scales (and offsets) are the file's own
float16 for the types that hold one a block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the K-quants'
are the file's two levels, an int8 (6-bit in the file) scale a sub-block times a float16 a
256-value super-block (`Blocks.supers`), or, held with one level, their float32 products
(a float16 times a 6-bit scale needs more bits than a float16).

For Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (sub-blocks of 32), Q4_K, Q5_K (32) and Q6_K (16) this is
exactly the file's value: the scale and offset are the products llama.cpp (and the `gguf`
package) compute per sub-block before the last multiply-add, so `code * scale + offset` in
float32 is bit for bit `gguf.quants.dequantize` (the unit tests check it per type). Every
other type is dequantized by `gguf` and requantized to symmetric int8 per 32 values: close,
not exact. The 4-bit types (Q4_0, Q4_1, Q4_K) stay two codes a byte (`pack`); Q4_0 and
Q4_1 lie in the file that way already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from jpaged.dtypes import KV_QUANT
from jpaged.models import hostcopy
from jpaged.models.hostcopy import Into
from jpaged.models.quant import NIBBLES, Form

Q = GGMLQuantizationType
REQUANT_BLOCK = 32  # the sub-block of the types requantized to int8


class Blocks(NamedTuple):
    """A quantized matrix `[rows, cols]`, the sub-blocks along `cols`."""

    # int8 [rows, cols], or uint8 [rows, cols // 2]: two 4-bit codes a byte (`pack`)
    codes: np.ndarray
    scale: np.ndarray  # float32 or float16 [rows, cols // block]; int8 with `supers`
    offset: np.ndarray | None  # like scale; None: symmetric (offset 0)
    # two levels: float16 [rows, cols // (block * group)] each `group` sub-scales (and
    # sub-offsets) are times; None: one level
    supers: tuple[np.ndarray, np.ndarray | None] | None = None

    @property
    def packed(self) -> bool:
        return self.codes.dtype == np.uint8

    @property
    def block(self) -> int:
        return self.codes.shape[-1] * (2 if self.packed else 1) // self.scale.shape[-1]

    @property
    def group(self) -> int:
        """Sub-blocks a super-scale covers (0: one level)."""
        return 0 if self.supers is None else self.scale.shape[-1] // self.supers[0].shape[-1]

    def one_level(self) -> Blocks:
        """The same values with a float32 scale (and offset) a sub-block: each sub-scale
        times its super-scale, exact in float32."""
        if self.supers is None:
            return self

        def times(sub: np.ndarray | None, sup: np.ndarray | None) -> np.ndarray | None:
            if sub is None or sup is None:
                return None
            return sub.astype(np.float32) * np.repeat(sup.astype(np.float32), self.group, -1)

        scale = times(self.scale, self.supers[0])
        assert scale is not None
        return Blocks(self.codes, scale, times(self.offset, self.supers[1]))

    def regrouped(self, form: Form) -> Blocks:
        """The same values held as `form` says: sub-blocks of `form.block` (dividing this
        one's: each scale repeated), an offset array when `form.affine` (zeros where this one
        has none), codes packed (only if they are) or not, scales of `form.scale`'s dtype;
        two levels (`form.group`) only as this one holds them."""
        if form.group:
            held = (self.block, self.group, self.offset is not None, self.packed)
            if held != (form.block, form.group, form.affine, form.packed):
                raise ValueError(
                    f"blocks of {self.block} in groups of {self.group} are not held as {form}"
                )
            return self
        if self.supers is not None:
            return self.one_level().regrouped(form)
        block, affine, packed = form.block, form.affine, form.packed
        if self.block % block:
            raise ValueError(f"sub-block {block} does not divide {self.block}")
        if packed and not self.packed:
            raise ValueError("only 4-bit types' codes stay packed")
        if form.code != (self.codes.dtype if packed else self.unpacked().dtype):
            raise ValueError(f"codes of {self.codes.dtype} are not held as {form.code}")
        codes = self.codes if packed else self.unpacked()

        if form.half and self.scale.dtype != np.float16:
            raise ValueError(f"scales of {self.scale.dtype} are not held as float16")

        def each(a: np.ndarray) -> np.ndarray:
            a = a.astype(form.scale, copy=False)  # float16 widens exactly
            return a if self.block == block else np.repeat(a, self.block // block, axis=-1)

        scale = each(self.scale)
        offset = None if self.offset is None else each(self.offset)
        if affine and offset is None:
            # symmetric packed codes read as unsigned next to affine ones: their centre moves
            # into the offset
            offset = -8 * scale if packed else np.zeros_like(scale)
        return Blocks(codes, scale, offset)

    def unpacked(self) -> np.ndarray:
        """int8 codes `[rows, cols]`."""
        if not self.packed:
            return self.codes
        rows = self.codes.shape[0]
        pairs = self.codes.reshape(rows, -1, 1, NIBBLES // 2)
        codes = np.concatenate([pairs & 15, pairs >> 4], axis=2).astype(np.int8).reshape(rows, -1)
        return codes if self.offset is not None else codes - 8

    def dense(self) -> np.ndarray:
        """float32 `[rows, cols]`."""
        if self.supers is not None:
            return self.one_level().dense()
        codes = self.unpacked()
        rows, cols = codes.shape
        shape = (rows, cols // self.block, self.block)
        w = codes.reshape(shape).astype(np.float32) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 `[n, 1]` of little-endian float16 byte pairs `[n, 2]`."""
    return _half(raw).astype(np.float32)


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 `[n, 1]` of little-endian float16 byte pairs `[n, 2]`."""
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """`[n, k * group // 2]` bytes -> `[n, k * group]` 4-bit values: each run of `group // 2`
    bytes holds `group` values, the low nibbles first, then the high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group // 2)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, -1)


def _bits(raw: np.ndarray, count: int) -> np.ndarray:
    """`[n, count]` bits 0..count-1 of the little-endian integer in each row's bytes."""
    bits = np.unpackbits(np.ascontiguousarray(raw), axis=-1, bitorder="little")
    return bits[:, :count]


def _q8_0(b: np.ndarray) -> Blocks:
    return Blocks(b[:, 2:].view(np.int8), _half(b[:, :2]), None)


# Q4_0 and Q4_1 blocks hold 32 codes in 16 bytes as `pack` does: kept as they are
def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(np.ascontiguousarray(b[:, 2:]), _half(b[:, :2]), None)


def _q4_1(b: np.ndarray) -> Blocks:
    return Blocks(np.ascontiguousarray(b[:, 4:]), _half(b[:, :2]), _half(b[:, 2:4]))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return (_nibbles(qs, 32) | (_bits(qh, 32) << 4)).astype(np.int8)


def _q5_0(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 2:6], b[:, 6:]) - 16, _half(b[:, :2]), None)


def _q5_1(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 4:8], b[:, 8:]), _half(b[:, :2]), _half(b[:, 2:4]))


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's
    get_scale_min_k4): the first four in bytes 0-3 / 4-7, the last four split between
    bytes 8-11 (low four bits) and the top two bits of bytes 0-3 / 4-7."""
    lo, hi, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales.astype(np.int8), mins.astype(np.int8)


def _k_levels(b: np.ndarray, qtype: GGMLQuantizationType) -> Blocks:
    """A K-quant's scales as its blocks `[n, type_size]` hold them (no codes): int8 sub-scales
    `[n, 8]` (Q6_K's `[n, 16]`) and (Q4_K, Q5_K) sub-minimums, times the block's float16
    scale and its negated float16 minimum (the offset is -(dmin x min))."""
    empty = np.zeros((b.shape[0], 0), np.int8)
    if qtype == Q.Q6_K:
        return Blocks(empty, b[:, 192:208].view(np.int8), None, (_half(b[:, 208:210]), None))
    scales, mins = _k_scales(b[:, 4:16])
    return Blocks(empty, scales, mins, (_half(b[:, 0:2]), -_half(b[:, 2:4])))


def _k_affine(b: np.ndarray, codes: np.ndarray) -> Blocks:
    return _k_levels(b, Q.Q4_K)._replace(codes=codes)


def _q4_k(b: np.ndarray) -> Blocks:  # its bytes pair values j and j + 32 of 64: repacked
    return _k_affine(b, pack(_nibbles(b[:, 16:144], 64), symmetric=False))


def _q5_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    low = _nibbles(b[:, 48:176], 64).reshape(n, 8, 32)
    # bit i of byte l of qh is the fifth bit of value l of sub-block i
    high = _bits(b[:, 16:48].reshape(n * 32, 1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
    return _k_affine(b, (low | (high << 4)).astype(np.int8).reshape(n, 256))


def _q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    # per half of 128 values: low nibbles of 64 bytes then their high nibbles, and two bits
    # of each of 32 bytes at shifts 0, 2, 4, 6
    low = _nibbles(ql, 128).reshape(n, 2, 128)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128)
    codes = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, 256)
    return _k_levels(b, Q.Q6_K)._replace(codes=codes)


EXACT: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], Blocks], Form]] = {
    Q.Q8_0: (_q8_0, Form(32, False, half=True)),
    Q.Q4_0: (_q4_0, Form(32, False, packed=True, half=True)),
    Q.Q4_1: (_q4_1, Form(32, True, packed=True, half=True)),
    Q.Q5_0: (_q5_0, Form(32, False, half=True, bits=5)),
    Q.Q5_1: (_q5_1, Form(32, True, half=True, bits=5)),
    Q.Q4_K: (_q4_k, Form(32, True, packed=True, group=8)),
    Q.Q5_K: (_q5_k, Form(32, True, group=8, bits=5)),
    Q.Q6_K: (_q6_k, Form(16, False, group=16, bits=6)),
}
FLOAT = (Q.F32, Q.F16, Q.BF16, Q.F64)


def layout(qtype: GGMLQuantizationType) -> Form | None:
    """How a tensor of `qtype` is held; None: as float."""
    if qtype in FLOAT:
        return None
    if qtype in EXACT:
        return EXACT[qtype][1]
    return Form(REQUANT_BLOCK, False)


def pack(codes: np.ndarray, symmetric: bool) -> np.ndarray:
    """4-bit codes `[rows, cols]` (symmetric ones in -8..7, else 0..15) two a byte:
    uint8 `[rows, cols // 2]`, byte j of each 16 holding values j and j + 16 of a run of 32
    (the low nibble, the high one)."""
    rows, cols = codes.shape
    if cols % NIBBLES:
        raise ValueError(f"{cols} columns do not split into runs of {NIBBLES} to pack")
    q = (codes.astype(np.int16) + (8 if symmetric else 0)).reshape(rows, -1, 2, NIBBLES // 2)
    if q.min(initial=0) < 0 or q.max(initial=0) > 15:
        raise ValueError("codes out of the 4-bit range")
    q = q.astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, cols // 2)


def requantize(w: np.ndarray, block: int = REQUANT_BLOCK, fp8: bool = False) -> Blocks:
    """Symmetric int8 (`fp8`: float8_e4m3 codes) per `block` values along the last axis of
    float `w` `[rows, cols]`, each sub-block scaled to the codes' largest magnitude."""
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{cols} columns do not split into sub-blocks of {block}")
    code, most = KV_QUANT["fp8_e4m3" if fp8 else "int8"]
    blocks = w.reshape(rows, cols // block, block).astype(np.float32)
    scale = np.abs(blocks).max(-1) / np.float32(most)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    scaled = np.clip(blocks / safe, -most, most)
    codes = (scaled if fp8 else np.rint(scaled)).astype(code)
    return Blocks(codes.reshape(rows, cols), scale, None)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows `[rows, ...]` of a Llama's Q or K projection of `heads` heads in their order,
    from llama.cpp's, which interleaves each head's rotary halves (row 2b + a of a head is
    its half a's row b)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


class Encoded(NamedTuple):
    """A matrix `[rows, cols]`, or a stack of experts' `[E, rows, cols]`, as its file holds
    it, decoded when read: into `Blocks`, or (an `EXACT` type's) straight into a loader's
    arrays (`into`)."""

    data: np.ndarray  # uint8: its blocks, row after row (an expert's after another's)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # [rows, cols] or [E, rows, cols]
    heads: int = 0  # the rows in llama.cpp's order of that many heads' (`unpermute`)

    @property
    def form(self) -> Form:
        return EXACT[self.qtype][1]

    def blocks(self) -> Blocks:
        *lead, rows, cols = self.shape
        b = unpack(self.data, self.qtype, (int(np.prod(lead)) * rows, cols), self.heads)
        if not lead:
            return b

        def stack(a: np.ndarray) -> np.ndarray:
            return a.reshape(*lead, rows, a.shape[-1])

        offset = None if b.offset is None else stack(b.offset)
        supers = None
        if b.supers is not None:
            supers = (stack(b.supers[0]), None if b.supers[1] is None else stack(b.supers[1]))
        return Blocks(stack(b.codes), stack(b.scale), offset, supers)

    def into(self, into: Into) -> bool:
        """Decode into `into`'s arrays (`hostcopy.blocks_into`; a stack's: each with the
        experts first, an expert at a time); False without a compiler."""
        *lead, rows, cols = self.shape
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        assert cols % block == 0
        data = self.data.view(np.uint8).reshape(-1, rows * cols // block * type_size)
        parts = [into]
        if lead:
            parts = [
                into._replace(arrays=tuple(None if a is None else a[i] for a in into.arrays))
                for i in range(len(data))
            ]
        return all(
            hostcopy.blocks_into(matrix, rows, cols // block, self.qtype, part, self.heads)
            for matrix, part in zip(data, parts, strict=True)
        )


def unpack(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], heads: int = 0
) -> Blocks:
    """The quantized matrix of `shape` (`[rows, cols]`, GGUF's innermost dimension last)
    stored as `data` (its raw bytes, as `GGUFReader` maps them; `heads`: its rows in
    llama.cpp's order, `unpermute`)."""
    rows, cols = shape
    if qtype not in EXACT:
        dense = np.asarray(gguf_quants.dequantize(data, qtype), np.float32).reshape(shape)
        return requantize(unpermute(dense, heads) if heads else dense)
    block, type_size = GGML_QUANT_SIZES[qtype]
    form = EXACT[qtype][1]
    small = cols // form.block
    scale = np.empty((rows, small), form.scale)
    supers = None
    if form.group:
        sup = np.empty((rows, small // form.group), np.float16)
        supers = (sup, np.empty_like(sup) if form.affine else None)
    codes = np.empty((rows, cols // 2 if form.packed else cols), form.code)
    arrays = (codes, scale, np.empty_like(scale) if form.affine else None, *(supers or (None,) * 2))
    if hostcopy.blocks_into(
        data.view(np.uint8), rows, cols // block, qtype, Into(arrays, 0), heads
    ):
        return Blocks(codes, scale, arrays[2], supers)
    if heads:  # whole rows of blocks: the bytes move as the values would
        data = unpermute(data.view(np.uint8).reshape(rows, -1), heads).reshape(-1)
    b = EXACT[qtype][0](np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size))

    def per_row(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.reshape(rows, -1)

    supers = None if b.supers is None else (b.supers[0].reshape(rows, -1), per_row(b.supers[1]))
    return Blocks(b.codes.reshape(rows, -1), b.scale.reshape(rows, -1), per_row(b.offset), supers)
