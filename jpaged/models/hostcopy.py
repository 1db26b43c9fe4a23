"""The loaders' host arrays: `empty` (aligned, so a CPU device takes them without a copy)
and `assign`, writing a checkpoint's tensor into one; `blocks_into`, a GGUF's quantized
blocks decoded straight into the module's arrays.

The module's kernels are the checkpoint's `[out, in]` matrices transposed, so most writes
are transposes of a few hundred MB each (an 8B model's 4-bit codes: 4.4 GB). NumPy's copy
of a transposed view reads or writes one element a cache line; `hostcopy.cc` copies 64 x 64
tiles over every core. Where it cannot serve (no compiler, a cast, other ranks) NumPy
copies a few columns at a time, the best of its own orders.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jpaged.kernels import cpu

SOURCE = Path(__file__).with_name("hostcopy.cc")
STEP = 16  # NumPy's columns a copy
# XLA:CPU adopts a host array as a device buffer, no copy, when it starts on this boundary
# (`jax.device_put`); NumPy's own arrays start 16 bytes past a page. Copied, the largest
# weight (an 8B model's gate_up codes: 1.9 GB) was held twice at the load's peak.
ALIGN = 64


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """`np.empty(shape, dtype)` starting on a page (so on an `ALIGN`-byte boundary), in
    small pages.

    NumPy asks for transparent huge pages on every large array; each first write of one
    then zeroes 2 MB, after compacting memory to find them. Loading an 8B file into such
    arrays took 6.6-8.7 s (system time 7.5-12 s of it), into small pages 3.6-3.8 s, with
    decode steps as fast (RESULTS, "Loading in small pages")."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not size:
        return np.empty(shape, dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where the system gives huge ones unasked too
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, np.uint8).view(dtype).reshape(shape)


def aligned(value: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """`value.astype(dtype)` in an `empty` array."""
    out = empty(value.shape, dtype)
    assign(out, value)
    return out


def assign(dest: np.ndarray, value: np.ndarray) -> None:
    """`dest[...] = value` (casting on assignment, no temporary)."""
    if dest.ndim == value.ndim == 3 and dest.shape == value.shape:
        # a 2-D copy along the axis that holds neither array's contiguous one (a fused
        # matrix's part `[in, devices' shares, columns]`: a share; a stack of experts
        # `[E, in, out]`: an expert); along any other, each copy reads one element a line
        inner = {
            min((i for i in range(3) if a.shape[i] > 1), key=lambda i: abs(a.strides[i]), default=2)
            for a in (dest, value)
        }  # (an axis of one element may have any stride: never the contiguous one)
        axis = max(set(range(3)) - inner, key=lambda a: abs(dest.strides[a]))
        parts = zip(np.moveaxis(dest, axis, 0), np.moveaxis(value, axis, 0), strict=True)
        if all(_native(d, v) for d, v in parts):
            return
    elif _native(dest, value):
        return
    for c in range(0, value.shape[-1], STEP):
        dest[..., c : c + STEP] = value[..., c : c + STEP]


class Into(NamedTuple):
    """Where `blocks_into` writes a matrix's arrays (`models.quant.ARRAYS`' order), and how."""

    arrays: tuple[np.ndarray | None, ...]  # codes, scale, offset, scale_super, offset_super
    order: int  # 0: as the file's rows lie; 1: transposed; 2: transposed, codes tiled
    col0: int = 0  # transposed: the file's first row's column


def blocks_into(
    data: np.ndarray,  # uint8 [rows * per_row * type_size]: a GGUF matrix's blocks
    rows: int,
    per_row: int,
    qtype: int,  # GGML's id: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K
    into: Into,
    heads: int = 0,
) -> bool:
    """Decode the blocks straight into `into.arrays` (as `models.gguf_blocks.Blocks` holds
    them; transposed: each `[per_row * n, width]`, its rows contiguous, the file's rows its
    columns from `col0`; `order` 2: the codes in `models.qdot.tile`'s order) in one pass
    (`hostcopy.cc`); False without a compiler. `heads`: the rows are a Llama's Q or K rows
    of that many heads in llama.cpp's rotary interleaving (`models.gguf_blocks.unpermute`),
    put back in order as they are read."""
    from jpaged.models.qdot import RUN  # the int8 kernels' runs, which order 2 tiles

    lib = cpu.library(SOURCE)
    if lib is None:
        return False
    codes = into.arrays[0]
    assert data.dtype == np.uint8 and codes is not None and codes.flags.c_contiguous
    assert into.order == 0 or codes.ndim == 2
    run = RUN // (2 if codes.dtype == np.uint8 else 1)
    data = np.ascontiguousarray(data)

    def at(a: np.ndarray | None) -> ctypes.c_void_p:
        return ctypes.c_void_p(None if a is None else a.ctypes.data)

    i64 = ctypes.c_int64
    done = lib.jpaged_blocks_into(
        at(data), i64(rows), i64(per_row), i64(qtype), i64(into.order),
        i64(codes.shape[-1]), i64(into.col0), i64(run), *map(at, into.arrays), i64(heads),
    )  # fmt: skip
    assert done == 0
    return True


def tile(codes: np.ndarray) -> None:
    """Codes `[..., rows, out]` (packed or int8) put in place in `models.qdot.tile`'s order
    (the int8 kernels'), a run of 32 inputs' rows at a time: no second copy of the matrix at
    any point."""
    from jpaged.models import qdot  # its permutation, which NumPy's arrays take as JAX's do

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


def narrow(
    codes: np.ndarray, bits: int, affine: bool, into: np.ndarray | None = None
) -> np.ndarray:
    """int8 codes of `bits` `[..., rows, out]` in `models.qdot.tile`'s order as narrow ones
    (`models.qdot.narrow`) in `into` (uint8 `[..., rows / 32 * 4 * bits, out]`), over the
    cores; without `into`, in place: a view of the first bits / 8 of their bytes, the rest
    handed back to the system (no second copy of the matrix at any point; `codes` is not to
    be read after). ValueError if any lay outside what `bits` hold."""
    from jpaged.models import qdot

    *lead, rows, out = codes.shape
    assert codes.dtype == np.int8 and codes.flags.c_contiguous and rows % qdot.RUN == 0
    centre = qdot.centre(bits, affine)
    shape = (*lead, rows // qdot.RUN * 4 * bits, out)
    if into is None:
        into = codes.reshape(-1).view(np.uint8)[: codes.size // qdot.RUN * 4 * bits].reshape(shape)
    assert into.shape == shape and into.dtype == np.uint8 and into.flags.c_contiguous
    lib = cpu.library(SOURCE)
    fits = f"{bits}-bit codes are {-centre}..{(1 << bits) - 1 - centre}"
    if lib is None:
        if codes.size and not -centre <= codes.min() <= codes.max() < (1 << bits) - centre:
            raise ValueError(fits)
        into[...] = np.asarray(qdot.narrow(codes, bits, affine))
        return into
    runs, i64, at = codes.size // (qdot.RUN * out), ctypes.c_int64, ctypes.c_void_p
    if lib.jpaged_narrow(
        at(codes.ctypes.data), at(into.ctypes.data), i64(runs), i64(out), bits, centre
    ):
        raise ValueError(fits)
    return into


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
