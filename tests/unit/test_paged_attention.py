"""Paged decode attention: every implementation (the XLA and Pallas paths of
`paged_decode_attention`, and both of `ragged_paged_attention` given one token per
sequence) against the dense reference, and the Pallas kernel against JAX's own."""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from jpaged.kernels import common as kc
from jpaged.kernels import paged_attention as pa
from jpaged.kernels import ragged_attention as ra
from jpaged.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)

IMPLS = ["xla", "pallas", "ragged-xla", "ragged-pallas"]
DTYPES = [jnp.float32, jnp.bfloat16]
MIXED_LENS = [1, 15, 16, 17, 100, 200]  # one token, partial/aligned/just-past a block, multi-block


def _tol(dtype: Any) -> float:
    return 1e-5 if dtype == jnp.float32 else 2e-2


def _case(lens: list[int], **kw: Any) -> dict[str, Any]:
    """Shared between the two impls' tests (and so is each reference output); do not mutate."""
    return _cached_case(tuple(lens), **kw)


@functools.cache
def _cached_case(
    lens: tuple[int, ...],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: Any = jnp.float32,
    width: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Random pool with shuffled, non-contiguous page tables plus the same K/V made dense."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    need = [-(-n // block_size) for n in lens]
    width = width or max(max(need), 1)
    num_blocks = max(1 + sum(need) + 3, width + 1)  # null block + a few never referenced
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_pool = rng.standard_normal(shape).astype(np.float32)
    v_pool = rng.standard_normal(shape).astype(np.float32)
    # Garbage in the null block and unused slots must be masked out, not averaged in.
    k_pool[0] = 30.0
    v_pool[0] = 1e3
    ids = iter(1 + rng.permutation(num_blocks - 1))
    tables = np.zeros((batch, width), np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = [next(ids) for _ in range(n)]
    # Round through the dtype first so the dense copy holds exactly the pool's values.
    k_pool = np.asarray(k_pool.astype(dtype))
    v_pool = np.asarray(v_pool.astype(dtype))
    # [B, W, Hkv, bs, D] -> [B, W * bs, Hkv, D]
    dense = lambda pool: np.swapaxes(pool[tables], 2, 3).reshape(
        batch, width * block_size, num_kv_heads, head_dim
    )
    q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(dtype)
    return dict(
        q=jnp.asarray(q),
        k_pool=jnp.asarray(k_pool),
        v_pool=jnp.asarray(v_pool),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(lens, jnp.int32),
        k=jnp.asarray(dense(k_pool)),
        v=jnp.asarray(dense(v_pool)),
        scale=float(head_dim) ** -0.5,
        refs={},
    )


def _run(c: dict[str, Any], impl: Any, **kw: Any) -> jax.Array:
    if impl.startswith("ragged-"):  # each row a sequence of one new token
        tables, lens = np.asarray(c["block_tables"]), np.asarray(c["context_lens"])
        # an empty row is no sequence: its query rides as a padding token, which sees nothing
        order = np.concatenate([np.flatnonzero(lens), np.flatnonzero(lens == 0)])
        live = order[: np.count_nonzero(lens)]
        impl = impl.removeprefix("ragged-")
        meta = ra.plan(
            np.ones(len(live), np.int32), lens[live], tables[live], num_tokens=len(lens),
            num_seqs=len(lens), width=tables.shape[1], block_size=c["k_pool"].shape[2], impl=impl,
        )  # fmt: skip
        out, _ = ra.ragged_paged_attention(
            c["q"][order], c["k_pool"], c["v_pool"], meta, scale=c["scale"], impl=impl, **kw
        )
        return jnp.zeros_like(out).at[order].set(out)
    return paged_decode_attention(
        c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["context_lens"],
        scale=c["scale"], impl=impl, **kw,
    )  # fmt: skip


def _ref(c: dict[str, Any], **kw: Any) -> jax.Array:
    key = (c["scale"], *sorted(kw.items()))
    if key not in c["refs"]:
        c["refs"][key] = paged_decode_attention_reference(
            c["q"], c["k"], c["v"], c["context_lens"], scale=c["scale"], **kw
        )
    return c["refs"][key]


def _check(out: jax.Array, ref: jax.Array, dtype: Any) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tol = _tol(dtype)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol
    )


# ------------------------------------------------------------------- correctness vs reference


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads",
    [(4, 4), (4, 2), (8, 2), (16, 2), (4, 1)],
    ids=["mha", "gqa2", "gqa4", "gqa8", "mqa"],
)
def test_head_layouts_mixed_lengths(
    impl: str, dtype: Any, num_q_heads: int, num_kv_heads: int
) -> None:
    c = _case(MIXED_LENS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    _check(_run(c, impl), _ref(c), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_dims(impl: str, dtype: Any, head_dim: int) -> None:
    c = _case([3, 40, 64], num_q_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    _check(_run(c, impl), _ref(c), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "lens,block_size",
    [
        ([32, 64, 96], 32),  # exactly block-aligned
        ([16, 48], 16),
        ([5], 16),  # a single partial block
        ([1, 31], 32),
    ],
)
def test_block_boundaries(impl: str, lens: list[int], block_size: int) -> None:
    c = _case(lens, block_size=block_size)
    _check(_run(c, impl), _ref(c), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_padded_table(impl: str) -> None:
    """A table bucketed wider than needed: the padded tail points at the null block."""
    c = _case([3, 70], width=11, seed=3)
    _check(_run(c, impl), _ref(c), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_length_rows(impl: str) -> None:
    c = _case([0, 17, 0, 1], seed=1)
    out = _run(c, impl)
    _check(out, _ref(c), jnp.float32)
    np.testing.assert_array_equal(np.asarray(out)[[0, 2]], 0.0)
    all_pad = _case([0, 0], width=2)
    assert not np.asarray(_run(all_pad, impl)).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 16, 100, 300])  # <, =, > the rows' contexts
def test_sliding_window(impl: str, window: int) -> None:
    c = _case(MIXED_LENS, seed=2)
    _check(_run(c, impl, sliding_window=window), _ref(c, sliding_window=window), jnp.float32)


def test_window_convention_matches_transformers() -> None:
    """HF Gemma: the query at p sees j with p - window < j <= p, i.e. the last `window` keys."""
    c = _case([40])
    window = 7
    out = _run(c, "xla", sliding_window=window)
    only_last = dict(
        c, k=c["k"][:, 33:40], v=c["v"][:, 33:40], context_lens=jnp.array([7]), refs={}
    )
    np.testing.assert_allclose(out, _ref(only_last), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_window_in_layer_loop(impl: str) -> None:
    """Per-layer windows as traced scalars inside fori_loop, as the Gemma 3 model runs them."""
    c = _case(MIXED_LENS, seed=4)
    windows = jnp.array([16, 1_000_000, 5], jnp.int32)

    @jax.jit
    def run_layers(windows: jax.Array) -> jax.Array:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            out = _run(c, impl, sliding_window=windows[i])
            return acc.at[i].set(out)

        return jax.lax.fori_loop(0, 3, body, jnp.zeros((3, *c["q"].shape), c["q"].dtype))

    outs = run_layers(windows)
    for i, w in enumerate([16, 1_000_000, 5]):
        _check(outs[i], _ref(c, sliding_window=w), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 20])
def test_soft_cap(impl: str, window: int | None) -> None:
    c = dict(_case(MIXED_LENS, seed=5), scale=1.0)  # large logits so the cap bites
    kw = dict(soft_cap=5.0, sliding_window=window)
    out = _run(c, impl, **kw)
    _check(out, _ref(c, **kw), jnp.float32)
    assert np.abs(np.asarray(out) - np.asarray(_ref(c, sliding_window=window))).max() > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_uint16_pool_holds_bf16_bits(impl: str) -> None:
    c = _case([5, 40], dtype=jnp.bfloat16, seed=7)
    bits = {
        name: jax.lax.bitcast_convert_type(c[name], jnp.uint16) for name in ("k_pool", "v_pool")
    }
    out = _run(dict(c, **bits), impl)
    np.testing.assert_array_equal(out, _run(c, impl))


@pytest.mark.parametrize("max_chunks", [16, 5])  # one page per chunk; uneven chunks
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 20, "soft_cap": 5.0}])
def test_xla_chunked_path(
    monkeypatch: pytest.MonkeyPatch, max_chunks: int, kw: dict[str, Any]
) -> None:
    """Big batches split the XLA path into chunks merged by log-sum-exp; force it small."""
    monkeypatch.setattr(pa, "_XLA_CHUNK_BYTES", 1)
    monkeypatch.setattr(pa, "_XLA_MAX_CHUNKS", max_chunks)
    c = _case([0, 1, 15, 16, 17, 100, 200], seed=8)  # 13 pages
    _check(_run(c, "xla", **kw), _ref(c, **kw), jnp.float32)


@pytest.mark.parametrize("splits", [1, 2, 3, 100])  # unsplit; even; uneven; a chunk each
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 20, "soft_cap": 5.0}])
def test_pallas_forced_splits(
    monkeypatch: pytest.MonkeyPatch, splits: int, kw: dict[str, Any]
) -> None:
    """28 pages = 7 chunks of 64 tokens. Short rows and the window leave splits with
    nothing visible; zero-length rows have none at all."""
    monkeypatch.setattr(pa, "_PALLAS_SPLITS", splits)
    c = _case([0, 1, 15, 100, 300, 440], width=28, seed=10)
    _check(_run(c, "pallas", **kw), _ref(c, **kw), jnp.float32)


def test_pallas_f32_head_dim_256_block_32() -> None:
    """Gemma 3's head size in float32 with the block size that overflowed shared memory."""
    c = _case([5, 70, 128], num_q_heads=4, num_kv_heads=1, head_dim=256, block_size=32, seed=11)
    assert kc.choose_tiles(256, 4, 32, 16) == kc.Tiles(chunk_tokens=32, num_stages=2)
    _check(_run(c, "pallas"), _ref(c), jnp.float32)


@pytest.mark.parametrize("group_tile", [16, 32, 64])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("itemsize", [2, 4], ids=["16bit", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiles_fit_shared_memory(
    head_dim: int, itemsize: int, block_size: int, group_tile: int
) -> None:
    chunk, stages = kc.choose_tiles(head_dim, itemsize, block_size, group_tile)
    assert kc.smem_bytes(head_dim, itemsize, group_tile, chunk, stages) <= 232448
    assert chunk >= max(16, block_size) and chunk & (chunk - 1) == 0
    # The largest chunk that fits, up to the preferred one, and pipelined.
    assert stages == 2
    if chunk < max(64, 8192 // head_dim):
        assert kc.smem_bytes(head_dim, itemsize, group_tile, 2 * chunk, 2) > 232448


def test_tiles_calibration_and_choices() -> None:
    # The measured failure: f32, head_dim 256, 64-token chunks, 2 stages, group tile 16.
    assert kc.smem_bytes(256, 4, 16, 64, 2) == 278528
    assert kc.choose_tiles(128, 2, 16, 16) == (64, 2)  # the measured bf16 config, unchanged
    assert kc.choose_tiles(64, 2, 16, 16) == (128, 2)
    assert kc.choose_tiles(256, 4, 16, 16) == (32, 2)
    assert kc.choose_tiles(256, 2, 32, 16) == (64, 2)


def test_num_splits() -> None:
    # One row, 8 KV heads on 132 SMs: ~2 waves, capped by the chunks in the table.
    assert pa.num_splits(1, 8, 128, 132) == 33
    assert pa.num_splits(1, 8, 4, 132) == 4
    assert pa.num_splits(8, 8, 128, 132) == 5
    assert pa.num_splits(16, 8, 128, 132) == 3
    assert pa.num_splits(17, 8, 128, 132) == 1  # rows x heads fill the SMs
    assert pa.num_splits(128, 8, 512, 132) == 1
    assert pa.num_splits(1, 1, 1, 132) == 1
    if jax.default_backend() != "gpu":
        assert kc.sm_count() == 132


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_contiguous_baseline(num_chunks: int) -> None:
    c = _case(MIXED_LENS, seed=9)
    out = pa.contiguous_decode_attention(
        c["q"], jnp.swapaxes(c["k"], 1, 2), jnp.swapaxes(c["v"], 1, 2), c["context_lens"],
        scale=c["scale"], sliding_window=50, num_chunks=num_chunks,
    )  # fmt: skip
    _check(out, _ref(c, sliding_window=50), jnp.float32)


def test_auto_is_xla_on_cpu() -> None:
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks pallas on GPU")
    c = _case([5, 40])
    np.testing.assert_array_equal(_run(c, "auto"), _run(c, "xla"))


# ------------------------------------------------------------------- independent oracle


@pytest.mark.parametrize(
    "dtype,num_q_heads,num_kv_heads",
    [(jnp.float32, 4, 4), (jnp.float32, 8, 2), (jnp.bfloat16, 8, 1)],
    ids=["f32-mha", "f32-gqa4", "bf16-mqa"],
)
def test_pallas_matches_jax_paged_attention(
    dtype: Any, num_q_heads: int, num_kv_heads: int
) -> None:
    c = _case(
        [17, 64, 100], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype,
        width=8, seed=6,
    )  # fmt: skip
    # JAX's kernel wants pages as [num_kv_heads, pages, page_size, head_dim] and no scale.
    # Interpreted, its dots are XLA dots: on a GPU, TF32 unless asked for IEEE float32,
    # as ours are.
    with jax.default_matmul_precision("highest"):
        theirs = jax_paged.paged_attention(
            c["q"] * jnp.asarray(c["scale"], dtype),
            jnp.swapaxes(c["k_pool"], 0, 1),
            jnp.swapaxes(c["v_pool"], 0, 1),
            c["block_tables"],
            c["context_lens"],
            pages_per_compute_block=2,
            k_splits=2,
            interpret=True,
        )
    c_unscaled = dict(c, q=c["q"] * jnp.asarray(c["scale"], dtype), scale=1.0, refs={})
    _check(_run(c_unscaled, "pallas"), theirs, dtype)


# ------------------------------------------------------------------- bad input


def _bad(**overrides: Any) -> None:
    c = _case([3, 20])
    args = dict(
        q=c["q"], k_pool=c["k_pool"], v_pool=c["v_pool"], block_tables=c["block_tables"],
        context_lens=c["context_lens"], scale=0.1,
    )  # fmt: skip
    args.update(overrides)
    paged_decode_attention(**args)


@pytest.mark.parametrize(
    "overrides,name",
    [
        (dict(q=jnp.zeros((2, 4))), "q"),
        (dict(k_pool=jnp.zeros((6, 2, 16))), "k_pool"),
        (dict(v_pool=jnp.zeros((6, 2, 16, 64))), "v_pool"),
        (dict(q=jnp.zeros((2, 3, 64))), "num_q_heads"),
        (dict(q=jnp.zeros((2, 4, 64), jnp.int32)), "q"),
        (dict(v_pool=jnp.zeros((7, 2, 16, 64), jnp.bfloat16)), "v_pool"),
        (
            dict(
                k_pool=jnp.zeros((7, 2, 16, 64), jnp.int8),
                v_pool=jnp.zeros((7, 2, 16, 64), jnp.int8),
            ),
            "k_pool",
        ),
        (dict(q=jnp.zeros((2, 4, 32))), "head_dim"),
        (dict(block_tables=jnp.zeros((3, 2), jnp.int32)), "block_tables"),
        (dict(block_tables=jnp.zeros((2, 2), jnp.float32)), "block_tables"),
        (dict(block_tables=jnp.zeros((2, 99), jnp.int32)), "block_tables"),
        (dict(context_lens=jnp.zeros((3,), jnp.int32)), "context_lens"),
        (dict(context_lens=jnp.array([3, -1], jnp.int32)), "context_lens"),
        (dict(context_lens=np.array([3, -1], np.int32)), "context_lens"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=jnp.array([4, 4])), "sliding_window"),
        (dict(sliding_window=jnp.float32(4)), "sliding_window"),
        (dict(soft_cap=-1.0), "soft_cap"),
        (dict(scale=jnp.float32(0.1)), "scale"),
        (dict(impl="triton"), "impl"),
    ],
)
def test_bad_input_raises_value_error(overrides: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _bad(**overrides)


def test_validation_needs_only_shapes() -> None:
    """Checks run on abstract shapes, so bad input fails at the model's trace with a clear error."""
    c = _case([3])
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="num_q_heads"):
        jax.eval_shape(
            functools.partial(paged_decode_attention, scale=0.1),
            sds((1, 3, 64), jnp.float32), c["k_pool"], c["v_pool"], c["block_tables"],
            c["context_lens"],
        )  # fmt: skip


# ------------------------------------------------------------------- GPU lowering (no GPU needed)


@functools.cache
def _export_text(
    dtype: Any, head_dim: int, group: int, block_size: int, window: bool, splits: int | None
) -> str:
    batch, num_kv_heads, num_blocks, width = 2, 2, 64, 12
    sds = jax.ShapeDtypeStruct
    pool = sds((num_blocks, num_kv_heads, block_size, head_dim), dtype)
    args = [
        sds((batch, num_kv_heads * group, head_dim), dtype),
        pool,
        pool,
        sds((batch, width), jnp.int32),
        sds((batch,), jnp.int32),
        sds((), jnp.int32),
    ]

    def f(q: jax.Array, k: jax.Array, v: jax.Array, bt: jax.Array, lens: jax.Array,
          w: jax.Array) -> jax.Array:  # fmt: skip
        return paged_decode_attention(
            q, k, v, bt, lens, scale=0.125, impl="pallas", interpret=False,
            sliding_window=w if window else None, soft_cap=50.0 if window else None,
        )  # fmt: skip

    with mock.patch.object(pa, "_PALLAS_SPLITS", splits):
        exported = jax.export.export(
            jax.jit(f),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_pallas_lowers_to_triton(dtype: Any, head_dim: int, group: int, block_size: int) -> None:
    """The split program (4 programs on 132 SMs: a split per chunk) and, for a few
    shapes, the unsplit one."""
    for splits in (None, 1) if group in (1, 4) else (None,):
        text = _export_text(dtype, head_dim, group, block_size, group in (1, 8), splits)
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert "jpaged_paged_decode_attention" in text
