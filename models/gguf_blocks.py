"""GGUF quantized blocks -> int8 codes, a float32 scale per sub-block and (affine types) a
float32 offset per sub-block: `value = code * scale + offset`.

For Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (sub-blocks of 32), Q4_K, Q5_K (32) and Q6_K (16) this is
exactly the file's value: the scale and offset are the products llama.cpp (and the `gguf`
package) compute per sub-block before the last multiply-add, so `code * scale + offset` in
float32 is bit for bit `gguf.quants.dequantize` (the unit tests check it per type). Every
other type is dequantized by `gguf` and requantized to symmetric int8 per 32 values: close,
not exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

Q = GGMLQuantizationType
REQUANT_BLOCK = 32  # the sub-block of the types requantized to int8


class Blocks(NamedTuple):
    """A quantized matrix `[rows, cols]`, the sub-blocks along `cols`."""

    codes: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // block]
    offset: np.ndarray | None  # float32 like scale; None: symmetric (offset 0)

    @property
    def block(self) -> int:
        return self.codes.shape[-1] // self.scale.shape[-1]

    def regrouped(self, block: int, affine: bool) -> Blocks:
        """The same values with sub-blocks of `block` (dividing this one's: each scale
        repeated) and an offset array when `affine` (zeros where this one has none)."""
        if self.block % block:
            raise ValueError(f"sub-block {block} does not divide {self.block}")
        scale = np.repeat(self.scale, self.block // block, axis=-1)
        offset = None if self.offset is None else np.repeat(self.offset, self.block // block, -1)
        if affine and offset is None:
            offset = np.zeros_like(scale)
        return Blocks(self.codes, scale, offset)

    def dense(self) -> np.ndarray:
        """float32 `[rows, cols]`."""
        rows, cols = self.codes.shape
        shape = (rows, cols // self.block, self.block)
        w = self.codes.reshape(shape).astype(np.float32) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 `[n, 1]` of little-endian float16 byte pairs `[n, 2]`."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


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
    return Blocks(b[:, 2:].view(np.int8), _f16(b[:, :2]), None)


def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(_nibbles(b[:, 2:], 32).astype(np.int8) - 8, _f16(b[:, :2]), None)


def _q4_1(b: np.ndarray) -> Blocks:
    return Blocks(_nibbles(b[:, 4:], 32).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return (_nibbles(qs, 32) | (_bits(qh, 32) << 4)).astype(np.int8)


def _q5_0(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 2:6], b[:, 6:]) - 16, _f16(b[:, :2]), None)


def _q5_1(b: np.ndarray) -> Blocks:
    return Blocks(_five_bits(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's
    get_scale_min_k4): the first four in bytes 0-3 / 4-7, the last four split between
    bytes 8-11 (low four bits) and the top two bits of bytes 0-3 / 4-7."""
    lo, hi, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_affine(b: np.ndarray, codes: np.ndarray) -> Blocks:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _k_scales(b[:, 4:16])
    return Blocks(codes, d * scales, -(dmin * mins))


def _q4_k(b: np.ndarray) -> Blocks:
    return _k_affine(b, _nibbles(b[:, 16:144], 64).astype(np.int8))


def _q5_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    low = _nibbles(b[:, 48:176], 64).reshape(n, 8, 32)
    # bit i of byte l of qh is the fifth bit of value l of sub-block i
    high = _bits(b[:, 16:48].reshape(n * 32, 1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
    return _k_affine(b, (low | (high << 4)).astype(np.int8).reshape(n, 256))


def _q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    # per half of 128 values: low nibbles of 64 bytes then their high nibbles, and two bits
    # of each of 32 bytes at shifts 0, 2, 4, 6
    low = _nibbles(ql, 128).reshape(n, 2, 128)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128)
    codes = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, 256)
    return Blocks(codes, d * sc.view(np.int8).astype(np.float32), None)


EXACT: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], Blocks], int, bool]] = {
    # type: (unpack, sub-block, affine)
    Q.Q8_0: (_q8_0, 32, False),
    Q.Q4_0: (_q4_0, 32, False),
    Q.Q4_1: (_q4_1, 32, True),
    Q.Q5_0: (_q5_0, 32, False),
    Q.Q5_1: (_q5_1, 32, True),
    Q.Q4_K: (_q4_k, 32, True),
    Q.Q5_K: (_q5_k, 32, True),
    Q.Q6_K: (_q6_k, 16, False),
}
FLOAT = (Q.F32, Q.F16, Q.BF16, Q.F64)


def layout(qtype: GGMLQuantizationType) -> tuple[int, bool] | None:
    """(sub-block, affine) a tensor of `qtype` is held with; None: held as float."""
    if qtype in FLOAT:
        return None
    if qtype in EXACT:
        return EXACT[qtype][1:]
    return REQUANT_BLOCK, False


def requantize(w: np.ndarray, block: int = REQUANT_BLOCK) -> Blocks:
    """Symmetric int8 per `block` values along the last axis of float `w` `[rows, cols]`."""
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"{cols} columns do not split into sub-blocks of {block}")
    blocks = w.reshape(rows, cols // block, block).astype(np.float32)
    scale = np.abs(blocks).max(-1) / np.float32(127)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    codes = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    return Blocks(codes.reshape(rows, cols), scale, None)


def unpack(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Blocks:
    """The quantized matrix of `shape` (`[rows, cols]`, GGUF's innermost dimension last)
    stored as `data` (its raw bytes, as `GGUFReader` maps them)."""
    if qtype not in EXACT:
        dense = gguf_quants.dequantize(data, qtype)
        return requantize(np.asarray(dense, np.float32).reshape(shape))
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    b = EXACT[qtype][0](blocks)
    rows, cols = shape
    per_row = cols // b.block
    return Blocks(
        b.codes.reshape(rows, cols),
        b.scale.reshape(rows, per_row),
        None if b.offset is None else b.offset.reshape(rows, per_row),
    )
