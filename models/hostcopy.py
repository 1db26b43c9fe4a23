"""The loaders' host arrays: `empty` (aligned, so a CPU device takes them without a copy)
and `assign`, writing a checkpoint's tensor into one.

The module's kernels are the checkpoint's `[out, in]` matrices transposed, so most writes
are transposes of a few hundred MB each (an 8B model's 4-bit codes: 4.4 GB). NumPy's copy
of a transposed view reads or writes one element a cache line; `hostcopy.cc` copies 64 x 64
tiles over every core. Where it cannot serve (no compiler, a cast, other ranks) NumPy
copies a few columns at a time, the best of its own orders.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import numpy as np

from jpaged.kernels import cpu

SOURCE = Path(__file__).with_name("hostcopy.cc")
STEP = 16  # NumPy's columns a copy
# XLA:CPU adopts a host array as a device buffer, no copy, when it starts on this boundary
# (`jax.device_put`); NumPy's own arrays start 16 bytes past a page. Copied, the largest
# weight (an 8B model's gate_up codes: 1.9 GB) was held twice at the load's peak.
ALIGN = 64


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """`np.empty(shape, dtype)` starting on an `ALIGN`-byte boundary."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size].view(dtype).reshape(shape)


def aligned(value: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """`value.astype(dtype)` in an `empty` array."""
    out = empty(value.shape, dtype)
    assign(out, value)
    return out


def assign(dest: np.ndarray, value: np.ndarray) -> None:
    """`dest[...] = value` (casting on assignment, no temporary)."""
    if dest.ndim == value.ndim == 3 and dest.shape == value.shape:
        # a fused matrix's part: `[in, devices' shares, columns]`, a 2-D copy a share
        if all(_native(dest[:, i], value[:, i]) for i in range(dest.shape[1])):
            return
    elif _native(dest, value):
        return
    for c in range(0, value.shape[-1], STEP):
        dest[..., c : c + STEP] = value[..., c : c + STEP]


class Scratch:
    """Host buffers reused from one tensor's read to the next. A fresh page costs its first
    write (~0.8 s a GB in this project's VMs: as much as the copy into it), and a loader
    reads gigabytes a tensor at a time, each copied on at once. A buffer is handed out again
    only once no array reads it any more, so an array kept longer is never overwritten."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """`np.empty(shape, dtype)`, in a buffer nothing else reads."""
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        with self._lock:
            # three references to a buffer no array reads: the list's, the loop's, the call's
            free = [b for b in self._buffers if b.size >= size and sys.getrefcount(b) == 3]
            if free:
                buffer = min(free, key=len)
            else:
                buffer = np.empty(size, np.uint8)
                self._buffers.append(buffer)
            return buffer[:size].view(dtype).reshape(shape)


def blocks_t(
    data: np.ndarray,  # uint8 [rows * per_row * type_size]: a GGUF matrix's blocks
    rows: int,
    per_row: int,
    kind: tuple[int, int, int, int, int],  # type_size, code_at, code_bytes, scale_at, offset_at
    scratch: Scratch | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """The blocks' codes uint8 `[per_row * code_bytes, rows]` and float16 scales (and offsets,
    `offset_at` >= 0) `[per_row, rows]`: transposed, as the module holds them, in one pass
    (`hostcopy.cc`), in `scratch`'s buffers if given; None without a compiler."""
    lib = cpu.library(SOURCE)
    if lib is None:
        return None
    type_size, code_at, code_bytes, scale_at, offset_at = kind
    assert data.dtype == np.uint8 and data.size == rows * per_row * type_size
    data = np.ascontiguousarray(data)
    new = np.empty if scratch is None else scratch.empty
    codes = new((per_row * code_bytes, rows), np.uint8)
    scale = new((per_row, rows), np.float16)
    offset = new((per_row, rows), np.float16) if offset_at >= 0 else None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.jpaged_blocks_t(
        ptr(data.ctypes.data), i64(rows), i64(per_row), *map(i64, kind),
        ptr(codes.ctypes.data), i64(rows), ptr(scale.ctypes.data),
        ptr(None if offset is None else offset.ctypes.data), i64(rows),
    )  # fmt: skip
    return codes, scale, offset


# GGML type id -> bytes a block, code bytes a block (`jpaged_kquants`)
K_QUANTS = {12: (144, 128), 13: (176, 256), 14: (210, 256)}


def kquants(
    data: np.ndarray,  # uint8 [blocks * type_size]: a GGUF tensor's K-quant blocks
    qtype: int,  # GGML's id: 12 Q4_K, 13 Q5_K, 14 Q6_K
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None] | None:
    """The blocks' codes uint8 `[blocks * code_bytes]` (Q4_K: two a byte; Q5_K, Q6_K: one),
    int8 sub-scales `[blocks, 8]` (Q6_K: 16) and sub-minimums `[blocks, 8]`, float16 scales
    and negated minimums `[blocks, 1]` (Q6_K: no minimums), in the blocks' order, as
    `models.gguf_blocks` holds them (`hostcopy.cc`); None without a compiler. (Not in a
    `Scratch`: an 8B Q4_K_M file loaded no faster with one, 39 vs 40 s, and these free at
    once after the loader's transposed copies.)"""
    lib = cpu.library(SOURCE)
    if lib is None:
        return None
    size, code_bytes = K_QUANTS[qtype]
    assert data.dtype == np.uint8 and data.size % size == 0
    data = np.ascontiguousarray(data)
    blocks = data.size // size
    six = qtype == 14
    codes = np.empty(blocks * code_bytes, np.uint8)
    scales = np.empty((blocks, 16 if six else 8), np.int8)
    mins = None if six else np.empty((blocks, 8), np.int8)
    d = np.empty((blocks, 1), np.float16)
    dmin = None if six else np.empty((blocks, 1), np.float16)
    ptr = ctypes.c_void_p

    def at(a: np.ndarray | None) -> ctypes.c_void_p:
        return ptr(None if a is None else a.ctypes.data)

    done = lib.jpaged_kquants(
        ptr(data.ctypes.data), ctypes.c_int64(blocks), ctypes.c_int64(qtype),
        *map(at, (codes, scales, mins, d, dmin)),
    )  # fmt: skip
    assert done == 0
    return codes, scales, mins, d, dmin


def tile(codes: np.ndarray) -> None:
    """Codes `[..., rows, out]` (packed or int8) put in place in `models.qdot.tile`'s order
    (the int8 kernels'), a run of 32 inputs' rows at a time: no second copy of the matrix at
    any point."""
    from models import qdot  # its permutation, which NumPy's arrays take as JAX's do

    rows, out = qdot.RUN // (2 if codes.dtype == np.uint8 else 1), codes.shape[-1]
    assert codes.itemsize == 1 and codes.flags.c_contiguous and codes.shape[-2] % rows == 0
    lib = cpu.library(SOURCE)
    if lib is not None:
        i64 = ctypes.c_int64
        runs = i64(codes.size // (rows * out))
        lib.jpaged_tile(ctypes.c_void_p(codes.ctypes.data), runs, i64(rows), i64(out))
        return
    held = codes.reshape(-1, rows, out)
    for k in range(held.shape[0]):
        held[k] = qdot.tile(held[k])


def _native(dest: np.ndarray, value: np.ndarray) -> bool:
    """`hostcopy.cc` copies 2-D arrays of one dtype of 1, 2 or 4 bytes; True when it did."""
    size = dest.itemsize
    if not (
        dest.ndim == value.ndim == 2
        and dest.shape == value.shape
        and dest.dtype == value.dtype
        and size in (1, 2, 4)
        and all(s % size == 0 for s in (*dest.strides, *value.strides))
    ):
        return False
    lib = cpu.library(SOURCE)
    if lib is None:
        return False
    (s0, s1), (d0, d1) = (np.array(value.strides) // size), (np.array(dest.strides) // size)
    i64 = ctypes.c_int64
    done = lib.jpaged_copy2d(
        ctypes.c_void_p(value.ctypes.data), i64(s0), i64(s1),
        ctypes.c_void_p(dest.ctypes.data), i64(d0), i64(d1),
        i64(dest.shape[0]), i64(dest.shape[1]), i64(size),
    )  # fmt: skip
    return done == 0
