"""Ragged paged attention: mixed steps (decodes beside prompt chunks over cached pages)
through both implementations against the dense reference, the Pallas kernel's context
splits and JAX's own paged kernel as a second oracle, the host plan's layout, bad input,
the Triton tile sizes, and the Pallas kernel's lowering for cuda, bucket by bucket; the
same kernel under Mosaic GPU, interpreted (GPU interpret mode) and lowered."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from jpaged.cache import kv_pool
from jpaged.config import EngineConfig
from jpaged.dtypes import KV_QUANT
from jpaged.engine import buckets
from jpaged.kernels import common as kc
from jpaged.kernels import cpu, ragged_mosaic, ragged_plan
from jpaged.kernels import ragged_attention as ra

# "cpu": the XLA path, its decoding tokens through attention.cc (in a whole model on a CPU);
# skipped where attention.cc cannot be built (no compiler), as the matmul kernels' tests are
CPU_KERNEL = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        not cpu.register(ra.ATTENTION, ("jpaged_attend",)), reason="no C++ compiler here"
    ),
)
IMPLS = ["xla", CPU_KERNEL, "pallas"]
# (new tokens, tokens stored after the step) per sequence: decodes, a prompt from scratch,
# chunks over cached pages, a chunk crossing several XLA and Pallas tiles, block edges
MIXED = [(1, 30), (40, 60), (1, 1), (5, 5), (70, 100), (1, 17), (16, 16), (33, 48)]
# Long decodes beside a prompt chunk: 1 to 5 of the Pallas kernel's 128-token chunks (f32,
# head_dim 64), for context splits to divide.
LONG = ((1, 600), (1, 1), (30, 330), (1, 129), (5, 5))


@functools.cache
def _case(
    seqs: tuple[tuple[int, int], ...] = tuple(MIXED),
    *,
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: Any = jnp.float32,
    pad_tokens: int = 5,
    pad_seqs: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    query = np.array([q for q, _ in seqs])
    context = np.array([c for _, c in seqs])
    need = -(-context // block_size)
    width = int(need.max()) + 2  # wider than any sequence needs
    num_blocks = 1 + int(need.sum()) + 3
    ids = iter(1 + rng.permutation(num_blocks - 1))
    tables = np.zeros((len(seqs), width), np.int32)
    for i, n in enumerate(need):
        tables[i, :n] = [next(ids) for _ in range(n)]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_pool = rng.standard_normal(shape).astype(np.float32)
    v_pool = rng.standard_normal(shape).astype(np.float32)
    k_pool[0], v_pool[0] = 30.0, 1e3  # the null block's garbage must never count
    num_tokens = int(query.sum()) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
    return dict(
        query=query,
        context=context,
        tables=tables,
        num_tokens=num_tokens,
        num_seqs=len(seqs) + pad_seqs,
        width=width,
        block_size=block_size,
        q=jnp.asarray(q, dtype),
        k_pool=jnp.asarray(k_pool, dtype),
        v_pool=jnp.asarray(v_pool, dtype),
        scale=head_dim**-0.5,
    )


def _plan(c: dict[str, Any], impl: str) -> ragged_plan.Ragged:
    return ragged_plan.plan(
        c["query"],
        c["context"],
        c["tables"],
        num_tokens=c["num_tokens"],
        num_seqs=c["num_seqs"],
        width=c["width"],
        block_size=c["block_size"],
        impl=impl,
    )


def _run(c: dict[str, Any], impl: str, **kw: Any) -> jax.Array:
    if impl == "cpu":
        with cpu.unsplit(True):
            return _run(c, "xla", **kw)
    out, pools = ra.ragged_paged_attention(
        c["q"], c["k_pool"], c["v_pool"], _plan(c, impl), scale=c["scale"], impl=impl, **kw
    )
    assert pools[0] is not None and pools[1] is not None
    return out


def test_cpu_kernel_where_it_serves() -> None:
    """The XLA path takes attention.cc only in a whole model's trace, float32 queries over
    float32 or int8 pools."""

    def traced(c: dict[str, Any], kv_dtype: str | None = None) -> str:
        f = functools.partial(ra.ragged_paged_attention, scale=c["scale"], impl="xla")
        k, v, ks, vs = c["k_pool"], c["v_pool"], None, None
        if kv_dtype is not None:
            values = KV_QUANT[kv_dtype][0]
            (k, ks), (v, vs) = (kv_pool.quantize(x, values, jnp.float32) for x in (k, v))
        jaxpr = jax.make_jaxpr(lambda *a: f(*a[:4], k_scale=a[4], v_scale=a[5]))
        return str(jaxpr(c["q"], k, v, _plan(c, "xla"), ks, vs))

    f32, bf16 = _case(), _case(dtype=jnp.bfloat16)
    assert "jpaged_attend" not in traced(f32)
    with cpu.unsplit(True):
        assert "jpaged_attend" in traced(f32)
        assert "jpaged_attend" in traced(f32, "int8")
        assert "jpaged_attend" not in traced(f32, "fp8_e4m3")
        assert "jpaged_attend" not in traced(bf16)


def _rotated(work: np.ndarray, live: int) -> np.ndarray:
    """The list with its first live item moved behind the others: that token's items no
    longer lie together."""
    work = np.array(work)
    work[:, :live] = np.roll(work[:, :live], -1, axis=1)
    return work


def _with_block(work: np.ndarray, block: int) -> np.ndarray:
    work = np.array(work)
    work[0, 0] = block
    return work


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda m: m._replace(single=_with_block(m.single, 10**6)), "out of the pool"),
        (lambda m: m._replace(tiled=_with_block(m.tiled, -1)), "out of the pool"),
        (lambda m: m._replace(single=_rotated(m.single, m.num_work[0])), "not together"),
    ],
    ids=["decode-block", "tile-block", "split-token"],
)
def test_cpu_kernel_rejects_corrupt_work_lists(corrupt: Any, match: str) -> None:
    """attention.cc reads the pool where the lists say: a block past the pool, or a token
    whose items are split (it would take only one run), is an error, never a read."""
    c = _case()
    meta = corrupt(_plan(c, "xla"))
    with cpu.unsplit(True), pytest.raises(jax.errors.JaxRuntimeError, match=match):
        out, _ = ra.ragged_paged_attention(
            c["q"], c["k_pool"], c["v_pool"], meta, scale=c["scale"], impl="xla"
        )
        out.block_until_ready()


def _ref(c: dict[str, Any], **kw: Any) -> jax.Array:
    m = _plan(c, "xla")
    return ra.ragged_paged_attention_reference(
        c["q"],
        c["k_pool"],
        c["v_pool"],
        jnp.asarray(m.seq_of),
        jnp.asarray(m.positions),
        jnp.asarray(m.block_tables),
        scale=c["scale"],
        **kw,
    )


def _check(c: dict[str, Any], out: jax.Array, ref: jax.Array) -> None:
    dtype = c["q"].dtype
    assert out.dtype == dtype and out.shape == c["q"].shape
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol
    )
    real = int(c["query"].sum())
    assert not np.asarray(out[real:], np.float32).any(), "padding tokens must see nothing"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2), (4, 1)], ids=["mha", "gqa3", "gqa4", "mqa"]
)
def test_mixed_step(impl: str, dtype: Any, num_q_heads: int, num_kv_heads: int) -> None:
    c = _case(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    _check(c, _run(c, impl), _ref(c))


# how far a 1-byte cache may move a step's output, relative (norm of the error over the
# output's): int8 keeps ~7 bits of each value, e4m3 3 mantissa bits, e5m2 2
QUANT_TOLERANCE = {"int8": 0.01, "fp8_e4m3": 0.05, "fp8_e5m2": 0.1}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv_dtype", sorted(QUANT_TOLERANCE))
def test_quantized_pools(impl: str, kv_dtype: str) -> None:
    """1-byte pools with a scale per token and head: the kernels equal the reference over
    the same dequantized pages, and stay near the unquantized result."""
    c = _case(num_q_heads=6, num_kv_heads=2, seed=3)
    values = KV_QUANT[kv_dtype][0]
    (k, ks), (v, vs) = (
        kv_pool.quantize(c[name], values, jnp.float32) for name in ("k_pool", "v_pool")
    )
    quantized = dict(c, k_pool=k, v_pool=v)
    out = _run(quantized, impl, k_scale=ks, v_scale=vs)
    _check(c, out, _ref(quantized, k_scale=ks, v_scale=vs))
    error = float(jnp.linalg.norm(out - _ref(c)) / jnp.linalg.norm(_ref(c)))
    print(f"{kv_dtype} {impl}: relative error {error:.4f}")
    assert 0 < error <= QUANT_TOLERANCE[kv_dtype]  # > 0: it really was quantized


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 7, 16, 50, 1000])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_window_and_soft_cap(impl: str, window: int, soft_cap: float | None) -> None:
    c = dict(_case(seed=1), scale=1.0)  # large logits, so the cap bites
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    _check(c, _run(c, impl, **kw), _ref(c, **kw))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_block_sizes_and_head_dims(impl: str, block_size: int, head_dim: int) -> None:
    c = _case(block_size=block_size, head_dim=head_dim, seed=2)
    _check(c, _run(c, impl), _ref(c))


@pytest.mark.parametrize("impl", IMPLS)
def test_decodes_only_and_one_prompt_only(impl: str) -> None:
    # one user's long context: attention.cc splits its pages over the threads, then merges
    for seqs in ([(1, 5), (1, 40), (1, 16)], [(1, 600)], [(100, 100)]):
        c = _case(tuple(seqs), pad_tokens=0, pad_seqs=0, seed=3)
        _check(c, _run(c, impl), _ref(c))


@pytest.mark.parametrize("splits", [1, 2, 3, 8])  # unsplit; even; uneven; more than chunks
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 200, "soft_cap": 5.0}])
def test_pallas_forced_splits(splits: int, kw: dict[str, Any]) -> None:
    """Each tile's chunks cut into `splits` runs, merged by log-sum-exp: runs past a short
    tile's chunks, before a window, of padding tiles and of padding tokens see nothing."""
    c = _case(LONG, seed=7)
    assert kc.choose_tiles(64, 4, 16, ragged_plan.PALLAS_TILE * 4).chunk_tokens == 128
    c = dict(c, scale=1.0) if kw else c  # large logits, so the cap bites
    _check(c, _run(c, "pallas", splits=splits, **kw), _ref(c, **kw))


def test_num_splits() -> None:
    # one tile, 8 KV heads on 132 SMs: ~2 waves, capped by the chunks of the table
    assert ragged_plan.num_splits(1, 8, 128, 132) == 33
    assert ragged_plan.num_splits(1, 8, 4, 132) == 4
    assert ragged_plan.num_splits(8, 8, 128, 132) == 5
    assert ragged_plan.num_splits(16, 8, 128, 132) == 3
    assert ragged_plan.num_splits(17, 8, 128, 132) == 1  # tiles x heads fill the SMs
    assert ragged_plan.num_splits(1, 1, 1, 132) == 1
    if jax.default_backend() != "gpu":
        assert kc.sm_count() == kc.DEFAULT_SM_COUNT == 132


def test_window_keeps_the_last_keys() -> None:
    """transformers' convention: the query at position p sees keys p - window < j <= p."""
    c = _case(((1, 40),), pad_tokens=0, pad_seqs=0, seed=8)
    table = c["tables"][0, :3]
    k, v = (
        np.asarray(c[n])[table].transpose(1, 0, 2, 3).reshape(2, 48, 64)[:, 33:40]
        for n in ("k_pool", "v_pool")
    )
    q = np.asarray(c["q"][0]).reshape(2, 3, 64)  # [Hkv, G, D]
    logits = np.einsum("hgd,hsd->hgs", q, k) * c["scale"]
    w = np.exp(logits - logits.max(-1, keepdims=True))
    expect = np.einsum("hgs,hsd->hgd", w / w.sum(-1, keepdims=True), v).reshape(1, 6, 64)
    for out in (_run(c, "xla", sliding_window=7), _ref(c, sliding_window=7)):
        np.testing.assert_allclose(out, expect, atol=1e-5, rtol=1e-5)


# A decode over cached pages, a 40-token chunk over 20 cached positions (3 Pallas tiles, the
# first partial page shared with cached keys), a first token, a chunk from a page's middle
NEW_KV = ((1, 30), (40, 60), (1, 1), (33, 48))


@pytest.mark.parametrize(
    "impl,dtype,kw",
    [
        # splits, a window, a soft cap, image spans (tokens that see later new ones)
        ("pallas", jnp.float32, {"splits": 3, "sliding_window": 7, "soft_cap": 5.0, "spans": 1}),
        ("pallas", "bf16 bits", {"splits": 1}),  # uint16 pools (XLA CPU), written as bits
        ("xla", jnp.float32, {"sliding_window": 7}),  # the scatter, then the walk
        # the scatter, then the Mosaic kernel
        ("pallas", jnp.bfloat16, {"lowering": "mosaic", "splits": 2, "sliding_window": 7}),
    ],
    ids=["pallas-split-window", "pallas-bf16-bits", "xla", "mosaic"],
)
def test_new_kv_written_and_seen(impl: str, dtype: Any, kw: dict[str, Any]) -> None:
    """The step's K/V handed in (`new_kv`): the Pallas kernel writes them into the pools
    itself and attends to them from its inputs, the other paths scatter them first; both
    equal the reference over pools the K/V were scattered into, and return those pools.
    The pools' stale values at the new slots must never be seen."""
    bits, kw = dtype == "bf16 bits", dict(kw)
    c = _case(NEW_KV, dtype=jnp.bfloat16 if bits else dtype, seed=11)
    spans = {1: [(3, 10), (20, 16)], 3: [(0, 33)]} if kw.pop("spans", 0) else {}
    m = ragged_plan.plan(
        c["query"], c["context"], c["tables"], num_tokens=c["num_tokens"],
        num_seqs=c["num_seqs"], width=c["width"], block_size=c["block_size"], impl=impl,
        extents=_extents(c["query"], spans) if spans else None,
    )  # fmt: skip
    rng = np.random.default_rng(12)
    k, v = (jnp.asarray(rng.standard_normal((c["num_tokens"], 2, 64)), c["q"].dtype) for _ in "kv")
    slots = kv_pool.slot_mapping(m.block_tables, m.seq_of, m.positions, c["block_size"])
    scattered = kv_pool.write(kv_pool.KVPool(c["k_pool"][None], c["v_pool"][None]), 0, slots, k, v)
    ref = ra.ragged_paged_attention_reference(
        c["q"],
        scattered.k[0],
        scattered.v[0],
        jnp.asarray(m.seq_of),
        jnp.asarray(m.positions),
        jnp.asarray(m.block_tables),
        scale=c["scale"],
        sliding_window=kw.get("sliding_window"),
        soft_cap=kw.get("soft_cap"),
        limits=jnp.asarray(m.limits) if spans else None,
    )
    pools = (c["k_pool"], c["v_pool"])
    if bits:
        pools = tuple(jax.lax.bitcast_convert_type(p, jnp.uint16) for p in pools)
    out, (k_out, v_out, _, _) = ra.ragged_paged_attention(
        c["q"], *pools, m, scale=c["scale"], impl=impl, new_kv=(k, v), **kw
    )
    _check(c, out, ref)
    if bits:
        k_out, v_out = (jax.lax.bitcast_convert_type(p, jnp.bfloat16) for p in (k_out, v_out))
    # (block 0, the null block: padding tokens' rows land there only by the scatter)
    for got, want in ((k_out, scattered.k[0]), (v_out, scattered.v[0])):
        np.testing.assert_array_equal(
            np.asarray(got[1:], np.float32), np.asarray(want[1:], np.float32)
        )


@pytest.mark.parametrize(
    "dtype,num_q_heads,num_kv_heads",
    [(jnp.float32, 8, 2), (jnp.bfloat16, 8, 1)],
    ids=["f32-gqa4", "bf16-mqa"],
)
def test_decodes_match_jax_paged_attention(dtype: Any, num_q_heads: int, num_kv_heads: int) -> None:
    """A decode-only step through the Pallas kernel (split, as small steps are: the longest
    context over two programs) against JAX's own paged decode kernel, interpreted: an oracle
    written apart from ours."""
    seqs = ((1, 17), (1, 64), (1, 200))
    c = _case(
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        pad_tokens=0,
        pad_seqs=0,
        seed=9,
    )
    q = c["q"] * jnp.asarray(c["scale"], dtype)  # JAX's kernel takes no scale
    # Interpreted, its dots are XLA dots: on a GPU TF32 unless asked for IEEE float32, as ours.
    with jax.default_matmul_precision("highest"):
        theirs = jax_paged.paged_attention(
            q,
            jnp.swapaxes(c["k_pool"], 0, 1),
            jnp.swapaxes(c["v_pool"], 0, 1),
            # 16 pages, a multiple of k_splits x pages_per_compute_block as JAX's kernel wants
            jnp.asarray(np.pad(c["tables"], ((0, 0), (0, 1)))),
            jnp.asarray(c["context"], jnp.int32),
            pages_per_compute_block=2,
            k_splits=2,
            interpret=True,
        )
    _check(c, _run(dict(c, q=q, scale=1.0), "pallas"), theirs)


def test_auto_is_xla_on_cpu() -> None:
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks pallas on GPU")
    c = _case(seed=3)
    auto = EngineConfig(attention_impl="auto").attention_impl  # the one owner of "auto"
    np.testing.assert_array_equal(_run(c, auto), _run(c, "xla"))


@pytest.mark.parametrize("chunk_items", [1, 3])
def test_xla_loop_over_many_chunks(monkeypatch: pytest.MonkeyPatch, chunk_items: int) -> None:
    """Tiny chunks: many loop iterations, items of one token split across them."""
    c = _case(seed=4)
    page_bytes = 2 * 16 * 64 * 4
    monkeypatch.setattr(ra, "_CHUNK_BYTES", chunk_items * page_bytes)
    ra._ragged_jit.clear_cache()
    try:
        _check(c, _run(c, "xla", sliding_window=20), _ref(c, sliding_window=20))
    finally:
        ra._ragged_jit.clear_cache()


def test_pools_live_in_storage_dtype() -> None:
    """uint16 pools holding bfloat16 bits (XLA CPU) give exactly the bfloat16 results."""
    c = _case(dtype=jnp.bfloat16, seed=5)
    bits = {n: jax.lax.bitcast_convert_type(c[n], jnp.uint16) for n in ("k_pool", "v_pool")}
    for impl in ("xla", "cpu", "pallas"):  # ("cpu" is XLA's path without a compiler)
        np.testing.assert_array_equal(_run(dict(c, **bits), impl), _run(c, impl))


def test_traced_window_in_layer_loop_over_the_whole_pool() -> None:
    """As the model runs it: every layer's pool as one `[L, N, ...]` array threaded through
    a loop over layers, block ids offset to the layer, windows traced."""
    c = _case(seed=6)
    m = _plan(c, "xla")
    num_blocks = c["k_pool"].shape[0]
    k_all = jnp.stack([c["k_pool"] * 0, c["k_pool"]])  # layer 1 holds the case's pool
    v_all = jnp.stack([c["v_pool"] * 0, c["v_pool"]])
    shifted = m._replace(
        single=m.single + np.array([[num_blocks], [0], [0]]) * (m.single[1] < c["num_tokens"]),
        tiled=m.tiled + np.array([[num_blocks], [0], [0]]) * (m.tiled[1] < c["num_tokens"]),
    )

    @jax.jit
    def run(window: jax.Array) -> jax.Array:
        out, _ = ra.ragged_paged_attention(
            c["q"], k_all, v_all, shifted, scale=c["scale"], sliding_window=window, impl="xla"
        )
        return out

    _check(c, run(jnp.int32(9)), _ref(c, sliding_window=9))


def test_plan_layout() -> None:
    """Two sequences: a decode at position 20, a 3-token chunk at 14..16 (block size 8)."""
    tables = np.array([[5, 6, 7], [9, 4, 0]], np.int32)
    m = ragged_plan.plan(
        np.array([1, 3]),
        np.array([21, 17]),
        tables,
        num_tokens=6,
        num_seqs=3,
        width=3,
        block_size=8,
        impl="xla",
    )
    np.testing.assert_array_equal(m.seq_of, [0, 1, 1, 1, 3, 3])
    np.testing.assert_array_equal(m.positions, [20, 14, 15, 16, 0, 0])
    np.testing.assert_array_equal(m.block_tables, [[5, 6, 7], [9, 4, 0], [0, 0, 0]])
    assert m.num_work.tolist() == [3, 3]
    # the decode: each of its 3 pages; padding (0, T, 0)
    np.testing.assert_array_equal(m.single[:, :4], [[5, 6, 7, 0], [0, 0, 0, 6], [0, 8, 16, 0]])
    # the chunk: one tile from token 1, pages up to its last token's (position 16: page 2)
    np.testing.assert_array_equal(m.tiled[:, :3], [[9, 4, 0], [1, 1, 1], [0, 8, 16]])
    p = ragged_plan.plan(
        np.array([1, 3]),
        np.array([21, 17]),
        tables,
        num_tokens=6,
        num_seqs=3,
        width=3,
        block_size=8,
        impl="pallas",
    )
    assert p.single.shape == p.tiled.shape == (3, 0)
    # ceil(6 / PALLAS_TILE) + 3 tiles, padded with (S, T); padding tokens point past them
    np.testing.assert_array_equal(p.tiles, [[0, 1, 3, 3], [0, 1, 6, 6]])
    tile = ragged_plan.PALLAS_TILE
    np.testing.assert_array_equal(p.token_tile, [0, tile, tile + 1, tile + 2, 4 * tile, 4 * tile])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_tokens=3), "exceed the bucket"),
        (dict(num_seqs=1), "exceed the bucket"),
        (dict(query=[1, 30], num_tokens=40), "query_lens"),
        (dict(query=[0, 3]), "query_lens"),
        (dict(context=[21, 40]), "pages"),
    ],
)
def test_plan_rejects(kw: dict[str, Any], match: str) -> None:
    args = dict(query=[1, 3], context=[21, 17], num_tokens=6, num_seqs=3)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ragged_plan.plan(
            np.array(args.pop("query")),
            np.array(args.pop("context")),
            np.array([[5, 6, 7], [9, 4, 0]]),
            width=3,
            block_size=8,
            impl="xla",
            **args,
        )


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c, m: dict(q=c["q"][0]), "q must be"),
        (lambda c, m: dict(q=c["q"][:, :5]), "KV heads"),
        (lambda c, m: dict(v_pool=c["v_pool"][:-1]), "alike"),
        (lambda c, m: dict(v_pool=c["v_pool"].astype(jnp.bfloat16)), "dtype"),
        (lambda c, m: dict(meta=tuple(m)), "Ragged"),
        (lambda c, m: dict(meta=m._replace(positions=m.positions[:-1])), "positions"),
        (lambda c, m: dict(meta=m._replace(single=m.single[:2])), "single"),
        (lambda c, m: dict(impl="cuda"), "impl"),
        (lambda c, m: dict(soft_cap=-1.0), "soft_cap"),
        (lambda c, m: dict(sliding_window=0), "sliding_window"),
        (
            lambda c, m: dict(
                k_pool=c["k_pool"].astype(jnp.int8), v_pool=c["v_pool"].astype(jnp.int8)
            ),
            "k_scale",
        ),
        (lambda c, m: dict(k_scale=c["k_pool"][..., 0]), "1-byte pools only"),
        (lambda c, m: dict(impl="pallas", splits=0), "splits"),
    ],
)
def test_bad_input_names_the_argument(change: Any, match: str) -> None:
    c = _case()
    m = _plan(c, "xla")
    args = dict(q=c["q"], k_pool=c["k_pool"], v_pool=c["v_pool"], meta=m, impl="xla")
    args.update(change(c, m))
    with pytest.raises(ValueError, match=match):
        ra.ragged_paged_attention(**args, scale=0.1)


# ------------------------------------------------------------------- Triton tiles


@pytest.mark.parametrize("rows", [16, 32, 64])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("itemsize", [2, 4], ids=["16bit", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiles_fit_shared_memory(head_dim: int, itemsize: int, block_size: int, rows: int) -> None:
    chunk, stages = kc.choose_tiles(head_dim, itemsize, block_size, rows)
    assert kc.smem_bytes(head_dim, itemsize, rows, chunk, stages) <= kc.SMEM_BUDGET
    assert chunk >= max(16, block_size) and chunk & (chunk - 1) == 0
    # the largest chunk that fits, up to the preferred one, and pipelined
    assert stages == 2
    if chunk < max(64, 8192 // head_dim):
        assert kc.smem_bytes(head_dim, itemsize, rows, 2 * chunk, 2) > kc.SMEM_BUDGET


def test_tiles_calibration_and_choices() -> None:
    # the measured failure: f32, head_dim 256, 64-token chunks, 2 stages, 16 rows
    assert kc.smem_bytes(256, 4, 16, 64, 2) == 278528
    assert kc.choose_tiles(128, 2, 16, 16) == (64, 2)  # the measured bf16 config, unchanged
    assert kc.choose_tiles(64, 2, 16, 16) == (128, 2)
    assert kc.choose_tiles(256, 4, 16, 16) == (32, 2)
    assert kc.choose_tiles(256, 2, 32, 16) == (64, 2)


# ------------------------------------------------------------------- GPU lowering (no GPU needed)


def _export(
    num_tokens: int,
    num_seqs: int,
    width: int,
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: Any,
    kv_dtype: str | None = None,
    lowering: str = "triton",
) -> str:
    """The Pallas kernel's StableHLO for cuda (Triton IR inside, or Mosaic GPU's), for
    abstract inputs of a bucket's shapes, over every layer's pool with a traced window and
    a soft cap (1-byte pages with their scales for a `kv_dtype`), the step's K/V handed in
    to be written."""
    block_size = 16
    sds = jax.ShapeDtypeStruct
    i32 = functools.partial(sds, dtype=jnp.int32)
    tiles = ragged_plan.sizes(num_tokens, num_seqs, width, "pallas")[0]
    meta = ragged_plan.Ragged(
        i32((num_tokens,)),
        i32((num_tokens,)),
        i32((num_seqs, width)),
        i32((2, tiles)),
        i32((num_tokens,)),
        i32((3, 0)),
        i32((3, 0)),
        i32((2,)),
    )
    blocks = (3, 40, num_kv_heads, block_size)  # layers x blocks x heads x tokens
    pool = sds((*blocks, head_dim), dtype if kv_dtype is None else KV_QUANT[kv_dtype][0])
    scales = None if kv_dtype is None else sds(blocks, dtype)

    def f(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        meta: ragged_plan.Ragged,
        w: jax.Array,
        ks: jax.Array | None,
        vs: jax.Array | None,
        new_k: jax.Array,
        new_v: jax.Array,
    ) -> Any:
        return ra.ragged_paged_attention(
            q,
            k,
            v,
            meta,
            scale=0.125,
            k_scale=ks,
            v_scale=vs,
            sliding_window=w,
            soft_cap=50.0,
            impl="pallas",
            interpret=False,
            new_kv=(new_k, new_v),
            lowering=lowering,
        )

    new = sds((num_tokens, num_kv_heads, head_dim), dtype)
    target = {"triton": "__gpu$xla.gpu.triton", "mosaic": "mosaic_gpu_v2"}[lowering]
    exported = jax.export.export(
        jax.jit(f),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
    )(
        sds((num_tokens, num_kv_heads * group, head_dim), dtype),
        pool,
        pool,
        meta,
        sds((), jnp.int32),
        scales,
        scales,
        new,
        new,
    )
    text = exported.mlir_module()
    assert text.count(target) == 1
    assert lowering == "mosaic" or "jpaged_ragged_paged_attention" in text
    return text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_pallas_lowers_to_triton(dtype: Any, head_dim: int, group: int) -> None:
    text = _export(64, 8, 16, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    # float pools: written by the kernel, in place (its outputs alias the pools), no scatter
    assert "output_operand_aliases" in text and "stablehlo.scatter" not in text


# Llama-3-8B-like on an H100 (132 SMs), the default budget of 512 tokens and 16 sequences,
# 2048-token tables: 128 pages, 32 chunks of 64 bf16 tokens. Below 16 tokens a bucket's
# tiles x 8 KV heads underfill the SMs, so its pages are split.
BUCKET_SPLITS = {
    1: 17,
    4: 7,
    8: 4,
    16: 1,
    32: 1,
    48: 1,
    64: 1,
    96: 1,
    128: 1,
    192: 1,
    256: 1,
    384: 1,
    512: 1,
}


@pytest.mark.parametrize("tokens", buckets.token_ladder(512))
def test_each_bucket_exports_its_splits(tokens: int) -> None:
    text = _export(
        tokens, min(tokens, 16), 128, num_kv_heads=8, group=4, head_dim=128, dtype=jnp.bfloat16
    )
    tiles = ragged_plan.sizes(tokens, min(tokens, 16), 128, "pallas")[0]
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)
    assert grid and tuple(map(int, grid.groups())) == (tiles, 8, BUCKET_SPLITS[tokens])


@pytest.mark.parametrize("kv_dtype", sorted(KV_QUANT))
def test_quantized_pallas_lowers_to_triton(kv_dtype: str) -> None:
    """1-byte pages and their scales go into the Triton kernel as they are stored."""
    text = _export(
        64, 8, 16, num_kv_heads=2, group=4, head_dim=128, dtype=jnp.bfloat16, kv_dtype=kv_dtype
    )
    stored = {"int8": "i8", "fp8_e4m3": "f8E4M3FN", "fp8_e5m2": "f8E5M2"}[kv_dtype]
    assert f"tensor<3x40x2x16x128x{stored}>" in text  # no dequantized copy before the kernel
    assert "stablehlo.scatter" in text  # the step's K/V quantized and scattered first


def _extents(query: np.ndarray, spans: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """Per new token, the keys past it it sees: within each (start, length) span of a
    sequence's new tokens (an image), every token sees to the span's end."""
    out = [np.zeros(int(n), np.int64) for n in query]
    for seq, runs in spans.items():
        for start, length in runs:
            out[seq][start : start + length] = np.arange(length)[::-1]
    return np.concatenate(out)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
def test_bidirectional_spans(impl: str, window: int | None) -> None:
    """Spans of tokens that see each other (Gemma 3's images): across XLA tiles (32) and
    Pallas tiles (16) and page edges, windowed or not, against the reference's limits."""
    c = _case()
    # sequence 1: 40 new tokens; 4: 70 new over 30 cached; 7: 33 new over 15 cached
    spans = {1: [(3, 10), (20, 16)], 4: [(25, 20)], 7: [(0, 33)]}
    extents = _extents(c["query"], spans)
    m = ragged_plan.plan(
        c["query"], c["context"], c["tables"], num_tokens=c["num_tokens"],
        num_seqs=c["num_seqs"], width=c["width"], block_size=c["block_size"], impl=impl,
        extents=extents,
    )  # fmt: skip
    assert m.limits.shape == (c["num_tokens"],)
    kw: dict[str, Any] = {} if window is None else {"sliding_window": window}
    out, _ = ra.ragged_paged_attention(
        c["q"], c["k_pool"], c["v_pool"], m, scale=c["scale"], impl=impl, **kw
    )
    ref = ra.ragged_paged_attention_reference(
        c["q"], c["k_pool"], c["v_pool"], jnp.asarray(m.seq_of), jnp.asarray(m.positions),
        jnp.asarray(m.block_tables), scale=c["scale"], limits=jnp.asarray(m.limits), **kw,
    )  # fmt: skip
    _check(c, out, ref)
    causal = _ref(c, **kw)
    assert np.abs(np.asarray(ref) - np.asarray(causal)).max() > 1e-2  # the spans matter
    with pytest.raises(ValueError, match="extents"):
        ragged_plan.plan(
            c["query"], c["context"], c["tables"], num_tokens=c["num_tokens"],
            num_seqs=c["num_seqs"], width=c["width"], block_size=c["block_size"], impl=impl,
            extents=extents + 1,
        )  # fmt: skip


# Mosaic GPU's kernel (interpreted on a CPU, compiled on a GPU): a mixed step of decodes and
# prompt chunks over cached pages (GQA, MQA, MHA), a window and a soft cap, context splits
# over long decodes, and head_dim 256 (one K/V slot fits shared memory:
# `ragged_mosaic.kv_slots`)
MOSAIC = {
    "gqa4": ({"num_q_heads": 8, "num_kv_heads": 2}, {}),
    "mqa-window-cap": ({"num_q_heads": 4, "num_kv_heads": 1, "seed": 1},
                       {"sliding_window": 50, "soft_cap": 5.0}),
    "mha-splits": ({"seqs": LONG, "num_q_heads": 2, "num_kv_heads": 2, "seed": 7}, {"splits": 3}),
    "head-dim-256": ({"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 256, "block_size": 32},
                     {}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MOSAIC))
def test_mosaic_kernel(case: str) -> None:
    kw, attend = MOSAIC[case]
    c = _case(**{"dtype": jnp.bfloat16, **kw})
    if "soft_cap" in attend:
        c = dict(c, scale=1.0)  # large logits, so the cap bites
    if case == "head-dim-256":
        assert ragged_mosaic.kv_slots(ragged_mosaic.ROWS, 64, 256) == 1
    ref = _ref(c, **{k: v for k, v in attend.items() if k != "splits"})
    _check(c, _run(c, "pallas", lowering="mosaic", **attend), ref)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"dtype": jnp.float32}, "bfloat16 or float16"),
        ({"kv_dtype": "int8"}, "bfloat16 or float16"),
        ({"head_dim": 32}, "whole 64s"),
        ({"spans": True}, "image spans"),
        ({"lowering": "cuda"}, "lowering must be one of"),
    ],
    ids=["f32", "int8", "head-dim-32", "spans", "name"],
)
def test_mosaic_names_what_it_leaves_out(change: dict[str, Any], match: str) -> None:
    c = _case(dtype=change.get("dtype", jnp.bfloat16), head_dim=change.get("head_dim", 64))
    extents = _extents(c["query"], {1: [(3, 10)]}) if "spans" in change else None
    m = ragged_plan.plan(
        c["query"], c["context"], c["tables"], num_tokens=c["num_tokens"],
        num_seqs=c["num_seqs"], width=c["width"], block_size=c["block_size"], impl="pallas",
        extents=extents,
    )  # fmt: skip
    pools: dict[str, Any] = {"k_pool": c["k_pool"], "v_pool": c["v_pool"]}
    if "kv_dtype" in change:
        (k, ks), (v, vs) = (
            kv_pool.quantize(c[name], KV_QUANT["int8"][0], jnp.bfloat16)
            for name in ("k_pool", "v_pool")
        )
        pools = {"k_pool": k, "v_pool": v, "k_scale": ks, "v_scale": vs}
    lowering = change.get("lowering", "mosaic")
    with pytest.raises((NotImplementedError, ValueError), match=match):
        ra.ragged_paged_attention(
            c["q"], meta=m, scale=c["scale"], impl="pallas", lowering=lowering, **pools
        )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_pallas_lowers_to_mosaic(head_dim: int, group: int) -> None:
    """One Mosaic GPU kernel, the step's K/V scattered before it (it writes no pool).
    128 rows of head_dim 256 fit no shared memory (no model has 8 query heads a KV head
    of 256)."""
    if (group, head_dim) == (8, 256):
        with pytest.raises(NotImplementedError, match="128 query rows"):
            _export(64, 8, 16, num_kv_heads=2, group=8, head_dim=256, dtype=jnp.bfloat16,
                    lowering="mosaic")  # fmt: skip
        return
    text = _export(
        64, 8, 16, num_kv_heads=2, group=group, head_dim=head_dim, dtype=jnp.bfloat16,
        lowering="mosaic",
    )  # fmt: skip
    assert "stablehlo.scatter" in text and "__gpu$xla.gpu.triton" not in text


def test_the_lowering_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JPAGED_PALLAS_LOWERING", raising=False)
    assert ra.pallas_lowering() == "triton"
    monkeypatch.setenv("JPAGED_PALLAS_LOWERING", "mosaic")
    assert ra.pallas_lowering() == "mosaic"
    c = _case(num_q_heads=8, num_kv_heads=2, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):  # Mosaic's check
        _run(c, "pallas")
