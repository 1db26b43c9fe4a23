"""Quantized weights: GGUF blocks unpacked exactly, and the matmul / row gather the step runs
on them against a float64 reference of the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from models import gguf_blocks

Q = GGMLQuantizationType


def _random_blocks(qtype: GGMLQuantizationType, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` blocks of random bytes whose float16 fields are finite (scales of either sign)."""
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = {
        Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2],
        Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    }[qtype]  # fmt: skip
    for at in halves:
        f16 = rng.uniform(-0.05, 0.05, (n, 1)).astype(np.float16)
        raw[:, at : at + 2] = f16.view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", list(gguf_blocks.EXACT))
def test_unpack_is_bitwise_gguf_dequantize(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    elems = GGML_QUANT_SIZES[qtype][0]
    rows, cols = 6, 2 * elems
    raw = _random_blocks(qtype, rows * 2, rng).reshape(rows, -1)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # gguf quantizes these itself
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = np.concatenate([raw, gguf_quants.quantize(w, qtype)])
        rows *= 2
    ref = gguf_quants.dequantize(raw, qtype).reshape(rows, cols)
    b = gguf_blocks.unpack(raw, qtype, (rows, cols))
    block, affine = gguf_blocks.layout(qtype)  # type: ignore[misc]
    assert b.codes.dtype == np.int8 and b.scale.dtype == np.float32 and b.block == block
    assert (b.offset is not None) == affine
    np.testing.assert_array_equal(b.dense(), ref)  # bit for bit, float32
    # regrouped to a smaller sub-block (a name whose layers mix types) still exact
    np.testing.assert_array_equal(b.regrouped(16, True).dense(), ref)


def test_other_types_requantize_to_int8() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    b = gguf_blocks.requantize(w)
    assert gguf_blocks.layout(Q.Q2_K) == (32, False) and gguf_blocks.layout(Q.F16) is None
    assert np.abs(b.dense() - w).max() <= np.abs(w).max() / 127
