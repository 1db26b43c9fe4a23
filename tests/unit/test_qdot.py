"""The CPU quantized-matmul kernels (`jpaged/models/qdot.cc`) against a float64 reference of the
dequantized weights, in every form the loader holds, and the XLA path they stand in for."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from jpaged.kernels import cpu
from jpaged.models import gguf_blocks, hostcopy, loader, qdot, quant, sharding
from tests.unit.test_quant import FORMS, _quantized

pytestmark = pytest.mark.skipif(not qdot.available(), reason="no C++ compiler here")
KERNEL_FORMS = [f for f in FORMS if not f.fp8]  # fp8 codes: XLA's path


def _run(x: np.ndarray, parts: tuple, kernel: bool) -> np.ndarray:
    """`x @ w` by the kernel (whether or not `quant.dot` would take it here) or by XLA."""

    def f(x: jax.Array, parts: tuple) -> jax.Array:
        if kernel:
            return qdot.dot(x, parts)
        with qdot.unsplit(False):
            return quant.dot(x, parts, jnp.float32)

    return np.asarray(jax.jit(f)(jnp.asarray(x), parts))


@pytest.mark.parametrize("form", KERNEL_FORMS, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 11, 20])
def test_kernel_matches_float64_reference(form: quant.Form, tokens: int) -> None:
    # out 272, in 640: a thread's columns end in a part narrower than the kernel's widest
    parts, w = _quantized(272, 640, form, seed=tokens)
    kernel = tuple(p.T for p in parts)
    x = np.random.default_rng(tokens).standard_normal((tokens, 640)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    ours, xla = _run(x, kernel, True), _run(x, kernel, False)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-4)


TABLE_FORMS = [*KERNEL_FORMS, quant.Form(16, False, group=qdot.TABLE_SUPERS)]  # + Q6_K's


def _width(form: quant.Form) -> int:
    """A table's hidden size that whole super-blocks of `form` fit."""
    return 768 if form.block * form.group == 256 else 640


@pytest.mark.parametrize("form", TABLE_FORMS, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 11])
def test_table_kernel_matches_float64_reference(form: quant.Form, tokens: int) -> None:
    """A tied LM head's scores: `x @ table.T`, sub-blocks along the table's rows (two-level
    scales' super-blocks along them too); 1, 5 and 11 (8 + 3) tokens: each count of the
    kernel's chains of sums (qdot.cc's FloatChains: 4, 1 and 2)."""
    hidden = _width(form)
    parts, w = _quantized(1000, hidden, form, seed=tokens)  # [vocab, hidden]
    x = np.random.default_rng(tokens).standard_normal((tokens, hidden)).astype(np.float32)
    with qdot.unsplit(True):  # 11 tokens: the kernel's two passes, which XLA's path serves
        assert qdot.usable_t(jnp.asarray(x), parts) == (tokens <= qdot.TABLE_TOKENS)
    ours = np.asarray(jax.jit(qdot.dot_t)(jnp.asarray(x), parts))
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("form", [quant.Form(32, True, True), quant.Form(32, False)], ids=str)
def test_kernel_tiles_of_columns(form: quant.Form) -> None:
    """Outputs wider than a cache-sized tile of columns (qdot.cc's kTileBytes: 128 KiB of
    codes, 128 columns of 2048 packed inputs, 64 of int8 ones), a thread's part in several
    tiles, each read for three chunks of tokens."""
    parts, w = _quantized(1040, 2048, form, seed=7)
    kernel = tuple(p.T for p in parts)
    x = np.random.default_rng(7).standard_normal((20, 2048)).astype(np.float32)
    ours = _run(x, kernel, True)
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("tokens", [1, 16])
def test_one_scale_a_column_reads_as_fast_as_sub_blocks(tokens: int) -> None:
    """Per-channel int8 (one sub-block of every row) is cut into 32-row sub-blocks, its
    scale repeated: before, each column group walked all 2048 rows down a stride of the
    row (8x slower than 32-row sub-blocks at one token, 7x at 16) on one thread. A ratio
    within one process: each form's best of 7 runs of 10 calls, the forms' runs alternated
    (so that load beside the suite falls on both); under 4x (the cut path ran 1.84x on one
    AVX2 EPYC, 2026-11-27, and 3.3x once with the forms timed one after the other while the
    suite's multidevice run shared the cores: the bound is for the old walk's 7-8x)."""
    import time

    x = jnp.asarray(np.random.default_rng(0).standard_normal((tokens, 2048)), jnp.float32)
    calls = []
    for form in (quant.Form(2048, False), quant.Form(32, False)):
        kernel = tuple(p.T for p in _quantized(4096, 2048, form, seed=1)[0])
        f = jax.jit(lambda x, kernel=kernel: qdot.dot(x, kernel))
        f(x).block_until_ready()
        calls.append(f)
    times = [float("inf")] * 2
    for _ in range(7):
        for i, f in enumerate(calls):
            start = time.perf_counter()
            for _ in range(10):
                y = f(x)
            y.block_until_ready()
            times[i] = min(times[i], time.perf_counter() - start)
    assert times[0] < 4 * times[1], times


def _rounded(x: np.ndarray) -> np.ndarray:
    """`x` as the int8 path rounds it: a scale per run of 32 (its largest magnitude over
    127), ties to even; in float64."""
    runs = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    step = np.abs(runs).max(-1, keepdims=True) / 127
    return (np.round(runs / np.where(step > 0, step, 1)) * step).reshape(x.shape)


def _full_range(parts: tuple, form: quant.Form, seed: int) -> tuple:
    """`_quantized`'s table `parts` of int8 codes with codes at int8's extremes (-128, -127,
    0, 127) instead, and its values in float64."""
    extremes = np.array([-128, -127, 0, 127], np.int8)
    codes = np.random.default_rng(seed).choice(extremes, parts[0].shape)
    scale, *offset = (np.asarray(p, np.float64) for p in parts[1:])
    w = codes.astype(np.float64).reshape(*codes.shape[:-1], -1, form.block) * scale[..., None]
    if offset:
        w = w + offset[0][..., None]
    return (jnp.asarray(codes), *parts[1:]), w.reshape(codes.shape)


INT8_FORMS = [  # the forms whose codes `qdot.takes_int8` (packed; int8 in whole runs, or Q6_K's)
    f for f in KERNEL_FORMS if f.packed or f.block % qdot.RUN == 0 or (f.group and not f.affine)
]


@pytest.mark.skipif(not qdot.int8_kernel(), reason="no AVX2")
@pytest.mark.parametrize("form", INT8_FORMS, ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 4, 13, 302])
def test_int8_inputs_match_a_float64_reference_of_the_rounded_inputs(
    form: quant.Form, tokens: int
) -> None:
    """`int8=True`: the inputs rounded to int8 and multiplied in integers, every weight
    (offsets and the symmetric codes' centre too) meeting the rounded inputs (1 to 4
    tokens: each run as it is read, the runs split over the threads, and so packed codes'
    13 with AVX-512, in chunks of 8 and 5; 13 otherwise and 302: each strip of columns
    read once, the columns split, tokens in passes of 4, 2 and 1); packed
    codes in that order with float inputs too (`F4Run`, then the same strips). The
    third layer of a stack of three, 288 outputs (9 groups of 32 columns, split unevenly
    over the threads), past the float path's `TOKENS`; int8 codes at int8's extremes too
    (-128 and 127: a pair of products at the most 16 bits hold)."""
    stack = [_quantized(288, 640, form, seed=tokens + k) for k in range(3)]
    if not form.packed and not form.group:  # full-range codes (a Q8_0's, per-channel int8's)
        stack = [_full_range(parts, form, seed=tokens + k) for k, (parts, _) in enumerate(stack)]
    parts = tuple(jnp.stack([layer[0][i].T for layer in stack]) for i in range(len(stack[0][0])))
    parts = (qdot.tile(parts[0]), *parts[1:])  # as `quant.round_inputs` lays them
    w = stack[2][1]
    x = np.random.default_rng(tokens).standard_normal((tokens, 640)).astype(np.float32)
    x[:, 5] *= 30  # an outlier: its run's other inputs keep few bits
    two = jnp.asarray(2, jnp.int32)
    ours = np.asarray(jax.jit(qdot.dot, static_argnums=3)(jnp.asarray(x), parts, two, True))
    exact = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(ours, _rounded(x) @ w.T, rtol=1e-5, atol=1e-4)
    # and it is the rounding: off the exact product by about its bound
    bound = (np.abs(_rounded(x) - x) @ np.abs(w.T)).max()
    assert 0.05 * bound < np.abs(ours - exact).max() <= bound
    if form.packed:  # float inputs against the same codes (`tiled`: as the loader lays them)
        floats = jax.jit(qdot.dot, static_argnums=(3, 4))(jnp.asarray(x), parts, two, False, True)
        np.testing.assert_allclose(np.asarray(floats), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not qdot.int8_kernel(), reason="no AVX2")
@pytest.mark.parametrize(
    "form",
    [quant.Form(16, False), quant.Form(640, False), quant.Form(16, False, group=16)],
    ids=str,
)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_table_kernel_with_int8_inputs(form: quant.Form, tokens: int) -> None:
    """A tied head of int8 codes (a Q6_K table's sub-blocks of 16, float32 scales or its two
    levels; per-row int8, at int8's extremes) scoring inputs rounded to int8: against a
    float64 reference of the rounded inputs, up to a pass's `TABLE_TOKENS`."""
    hidden = _width(form)
    parts, w = _quantized(1000, hidden, form, seed=tokens)  # [vocab, hidden]
    if form.block == 640:
        parts, w = _full_range(parts, form, seed=tokens)
    assert qdot.takes_int8_t(parts[0], parts[1], False, form.group)
    assert tokens <= qdot.TABLE_TOKENS
    x = np.random.default_rng(tokens).standard_normal((tokens, hidden)).astype(np.float32)
    x[:, 5] *= 30  # an outlier: its run's other inputs keep few bits
    ours = np.asarray(jax.jit(qdot.dot_t, static_argnums=2)(jnp.asarray(x), parts, True))
    np.testing.assert_allclose(ours, _rounded(x) @ w.T, rtol=1e-5, atol=1e-4)
    bound = (np.abs(_rounded(x) - x) @ np.abs(w.T)).max()
    assert 0.05 * bound < np.abs(ours - x.astype(np.float64) @ w.T).max() <= bound


def test_kernel_only_where_it_applies() -> None:
    parts, _ = _quantized(256, 640, quant.Form(32, False, True), seed=0)
    kernel = tuple(jnp.asarray(p.T) for p in parts)
    int8, _ = _quantized(256, 640, quant.Form(32, False), seed=0)
    int8 = tuple(jnp.asarray(p.T) for p in int8)
    few, most, many = (jnp.zeros((n, 640)) for n in (2, qdot.TOKENS, qdot.TOKENS + 1))
    fp8 = (int8[0].astype(quant.FP8), int8[1])
    with qdot.unsplit(True):
        assert qdot.usable(few, kernel) and not qdot.usable(many, kernel)
        assert qdot.usable(most, int8) and not qdot.usable(many, int8)
        assert not qdot.usable(few, fp8)
        with pytest.raises(ValueError, match="not float8_e4m3fn"):
            qdot.dot(few, fp8)
        odd = tuple(p[:, :40] for p in kernel)  # 40 output columns: not whole lanes
        assert not qdot.usable(few, odd)
        # int8 inputs: whole groups of 32 columns, any number of tokens; packed codes, int8
        # ones in sub-blocks of whole runs of 32 inputs, or of 16 two-level (Q6_K's)
        q6_k, _ = _quantized(256, 640, quant.Form(16, False, group=8), seed=0)
        q6_k = tuple(jnp.asarray(p.T) for p in q6_k)
        for held in (kernel, int8, q6_k):
            assert qdot.usable(many, held, int8=True) == qdot.int8_kernel()
        rows, _ = _quantized(256, 640, quant.Form(16, False), seed=0)  # float scales
        sixteen = tuple(jnp.asarray(p.T) for p in rows)
        for held in (sixteen, fp8, tuple(p[:, :48] for p in kernel)):
            assert not qdot.usable(few, held, int8=True)
        with pytest.raises(ValueError, match="not round inputs to int8 for int8 codes"):
            qdot.dot(few, sixteen, int8=True)
        table = tuple(jnp.asarray(p) for p in parts)
        # int8 inputs against a table: symmetric int8 codes, not packed or affine ones
        assert qdot.takes_int8_t(*rows, affine=False) == qdot.int8_kernel()
        assert not qdot.takes_int8_t(*table[:2], affine=False)
        assert not qdot.takes_int8_t(*rows, affine=True)
        # two levels: Q6_K's 16 sub-scales a super-scale only
        assert not qdot.takes_int8_t(*rows, affine=False, group=8)
        q6_k_table, _ = _quantized(256, 640, quant.Form(16, False, group=8), seed=0)
        with pytest.raises(ValueError, match="int8 scales in groups of 8"):
            qdot.dot_t(few, q6_k_table, int8=True)
        with pytest.raises(ValueError, match="not round inputs to int8 for uint8 codes"):
            qdot.dot_t(few, table, int8=True)
        nine = jnp.zeros((qdot.TABLE_TOKENS + 1, 640))
        assert qdot.usable_t(few, table) and not qdot.usable_t(nine, table)
        assert not qdot.usable_t(few, (table[0], table[1][:, :-1]))  # sub-blocks of 640 / 19
    assert not qdot.usable(few, kernel)  # a model split over devices: XLA's dot
    assert not qdot.usable_t(few, table)


def test_without_a_compiler_xla_serves(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert not cpu.register.__wrapped__(qdot.SOURCE, qdot.NAMES)
    assert "no C++ compiler" in caplog.text
    monkeypatch.setenv("JPAGED_CPU_KERNELS", "0")
    assert not cpu.register.__wrapped__(qdot.SOURCE, qdot.NAMES)


def test_smollm2_logits_through_the_kernels_match_xla(demo_model, monkeypatch) -> None:
    """The demo model's Q4_1 layers at 12 tokens (a decode step's size): the kernels'
    logits against XLA's path on the same weights."""
    from jpaged import models

    smol = demo_model("smollm2-135m").model
    ids = jnp.asarray([[1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2723, 30, 216]], jnp.int32)
    # the kernels' calls in the traced step: a layer's 4 matmuls (qkv, o, gate_up, down)
    traced: list[int] = []
    monkeypatch.setattr(qdot, "dot", lambda *a, _real=qdot.dot: traced.append(1) or _real(*a))
    ours = np.asarray(jax.jit(models.logits)(smol, ids))
    assert len(traced) == 4
    monkeypatch.setattr(qdot, "usable", lambda *a, **k: False)
    ref = np.asarray(jax.jit(models.logits)(smol, ids))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=2e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


TEXT = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
    "disliked it, but it soon became the symbol of the city, and today millions of people "
    "climb its stairs or ride its lifts every year to look out over the river Seine."
)


@pytest.mark.skipif(not qdot.int8_kernel(), reason="no AVX2")
def test_smollm2_with_int8_inputs(demo_model, monkeypatch) -> None:
    """`activations="int8"` on the demo model: its layers' 4-bit matmuls and its tied head
    (a Q8_0 table, read as it lies) round their inputs; the logits stay near the float ones
    (perplexity on a fixed text within 2%), at one token too (a lone decode rounds as a
    batch does)."""
    from jpaged import models

    smol = demo_model("smollm2-135m")
    rounded = models.load("smollm2-135m", activations="int8")
    held = [w for _, w in nnx.iter_modules(rounded.model) if isinstance(w, quant.QuantWeight)]
    # a layer's 4 (qkv, o, gate_up, down), stacked, and the table; only the 4 tiled
    assert sum(w.int8_inputs for w in held) == 5 == len(held)
    assert sum(w.tiled for w in held) == 4
    assert "inputs of 5 rounded to int8" in quant.describe(rounded.model)
    assert "rounded" not in quant.describe(smol.model)
    ids = jnp.asarray([smol.tokenizer(TEXT)["input_ids"]], jnp.int32)
    run = jax.jit(lambda m, ids: models.logits(m, ids))
    ours, ref = run(rounded.model, ids), run(smol.model, ids)

    def perplexity(logits: jax.Array) -> float:
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        return float(jnp.exp(-jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()))

    ratio = perplexity(ours) / perplexity(ref)
    agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    print(f"SmolLM2 int8 inputs: perplexity ratio {ratio:.4f}, argmax agreement {agree:.2f}")
    assert abs(ratio - 1) <= 0.02 and agree >= 0.85
    assert not np.allclose(ours, ref, atol=1e-3)  # rounded indeed
    one, alone = ids[:, :1], np.asarray(run(smol.model, ids[:, :1]))
    rounded_alone = np.asarray(run(rounded.model, one))
    assert not np.allclose(rounded_alone, alone, atol=1e-3)
    assert np.abs(rounded_alone - alone).max() <= 0.1 * np.abs(alone).max()
    # the codes lie in the int8 kernel's order; every other reader gets them as they were
    assert quant.round_inputs(rounded.model) == 0  # laid once
    # a data-parallel replica's device: the codes as they lie, still read as tiled
    replica = loader.shard_model(rounded, sharding.make_mesh(1)).model
    assert (
        sum(w.int8_inputs for _, w in nnx.iter_modules(replica) if isinstance(w, quant.QuantWeight))
        == 5
    )
    np.testing.assert_allclose(run(replica, one), rounded_alone, atol=1e-5)
    for name in ("usable", "usable_t"):  # XLA's path alone
        monkeypatch.setattr(qdot, name, lambda *a, **k: False)
    xla = jax.jit(lambda m, ids: models.logits(m, ids))
    np.testing.assert_allclose(xla(rounded.model, one), xla(smol.model, one), atol=1e-5)
    pairs = zip(quant.quantized(rounded.model), quant.quantized(smol.model), strict=True)
    for (path, a), (_, b) in pairs:
        if isinstance(a, quant.QuantWeight) and a.int8_inputs:
            np.testing.assert_array_equal(a.arrays()[0], b.arrays()[0], err_msg=path)


@pytest.mark.skipif(not qdot.int8_kernel(), reason="no AVX2")
@pytest.mark.parametrize(
    ("kind", "tied", "calls"),
    # Q4_0: the layer's qkv, o, gate_up and down, then the head; Q4_K_M: q, k, v, o, gate,
    # up and down, v and down in both forms (its second layer's Q6_K: a switch's two
    # branches), then the head (tied: its table held as a kernel); Q5_K_M's as Q4_K_M's;
    # all Q5_K (a kind of this test's own): qkv, o, gate_up and down, then the tied head
    [
        ("q4_0", False, 5), ("q4_k_m", False, 10), ("q4_k_m", True, 10), ("q5_k_m", False, 10),
        ("q5_k", True, 5),
    ],
    ids=["q4_0", "q4_k_m", "q4_k_m-tied", "q5_k_m", "q5_k-tied"],
)  # fmt: skip
def test_the_head_takes_int8_inputs_where_it_lies(
    tmp_path: Path, monkeypatch, kind: str, tied: bool, calls: int
) -> None:
    """A Llama-shaped GGUF (`benchmarks/bench_big.py`'s kinds, tiny): with int8 inputs an
    LM head of its own is one more int8 matmul, of its codes where they lie (read through
    `quant.arrays` it was untiled by a copy every step, with float inputs), and so is every
    Q6_K matrix of a Q4_K_M file, its head held in two levels as a layer's weights are; a
    tied Q6_K table too, held as its kernel at six bits a code (`quant.table_as_kernel`)
    and its rows looked up from there, and a tied Q5_K one (offsets) at five."""
    from benchmarks import bench_big
    from benchmarks.bench_big import Shape, write
    from jpaged import models

    monkeypatch.setitem(bench_big.MIXES, "q5_k", ("Q5_K", "Q5_K"))
    path = tmp_path / "model.gguf"
    # a K-quant's super-blocks are 256 inputs
    hidden = 64 if kind == "q4_0" else 256
    write(path, Shape(2, hidden, 2 * hidden, 4, 2, hidden // 4, tied=tied, vocab=320), kind)
    rounded, ref = models.load(path, activations="int8"), models.load(path)
    ids = jnp.asarray([[5, 9, 13]], jnp.int32)
    expected = np.asarray(jax.jit(models.logits)(ref.model, ids))
    int8: list[bool] = []
    for name, at in (("dot", 3), ("dot_t", 2)):
        real = getattr(qdot, name)
        monkeypatch.setattr(qdot, name, lambda *a, r=real, i=at: int8.append(a[i]) or r(*a))
    ours = np.asarray(jax.jit(models.logits)(rounded.model, ids))
    assert int8 == [True] * calls
    q6_k = NARROW_FORMS["q6_k"]
    if tied:
        table = rounded.model.embed.embedding
        form = NARROW_FORMS["q5_k" if kind == "q5_k" else "q6_k"]
        assert table.form == form._replace(narrow=True, transposed=True, tiled=True)
        shape = (hidden * form.bits // 8, 320)
        assert table.int8_inputs and table.tiled and table.codes.shape == shape
        # its rows looked up in its two levels are the file's values (every 8-column group's
        # every column)
        import gguf

        file = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
        dense = gguf.quants.dequantize(file.data, file.tensor_type).reshape(320, hidden)
        every = jnp.arange(320, dtype=jnp.int32)[::-1]
        np.testing.assert_array_equal(rounded.model.embed(every, None), dense[every])
        if kind == "q4_k_m":  # v, down's and the table
            assert "3 as 6-bit codes" in quant.describe(rounded.model)
        np.testing.assert_array_equal(quant.dequantized(rounded.model)["embed"]["embedding"], dense)
    elif kind != "q4_0":  # six bits a code, the file's own values
        head, ref_head = rounded.model.lm_head.kernel, ref.model.lm_head.kernel
        assert head.form == q6_k._replace(narrow=True, tiled=True) and head.codes.dtype == jnp.uint8
        np.testing.assert_array_equal(head.arrays()[0], ref_head.arrays()[0])
        assert "3 as 6-bit codes" in quant.describe(rounded.model)  # v, down's and the head
    if kind == "q5_k_m":  # five: q, k, o, gate, up and v's and down's Q5_K stacks
        assert "7 as 5-bit codes" in quant.describe(rounded.model)
        q, ref_q = rounded.model.layers.attn.q.kernel, ref.model.layers.attn.q.kernel
        assert q.form == NARROW_FORMS["q5_k"]._replace(narrow=True, tiled=True)
        np.testing.assert_array_equal(q.arrays()[0], ref_q.arrays()[0])
    assert np.abs(ours - expected).max() <= 0.1 * np.abs(expected).max()


# the GGUF types whose codes are held at their own bits with int8 inputs, in their files' forms
NARROW_FORMS = {q.name.lower(): gguf_blocks.EXACT[q][1] for q in (Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q5_1)}


@pytest.mark.skipif(not qdot.int8_kernel(), reason="no AVX2")
@pytest.mark.parametrize("kind", NARROW_FORMS)
@pytest.mark.parametrize("shape", [(256, 32), (512, 288), (14336, 1024)], ids=str)
def test_narrow_codes_match_a_float64_reference(kind: str, shape: tuple[int, int]) -> None:
    """Q6_K's and Q5_*'s codes held at their own bits (`qdot.narrow`, packed in place by
    `hostcopy.narrow`, over each type's whole range) against a float64 reference of the
    rounded inputs and of float ones, at tiny shapes and the depth of the 8B model's FFN
    down, 14,336 inputs (1, 2 and 4 tokens: run by run; 5: strip by strip); `quant`'s
    readers take them back as the int8 codes they are."""
    form, (inputs, outputs) = NARROW_FORMS[kind], shape
    if inputs > 512 and kind in ("q5_0", "q5_1"):
        pytest.skip("at the 8B shape a width's path is one type's (Q5_K's)")
    table, w = _quantized(outputs, inputs, form, seed=inputs)
    codes, *rest = (np.ascontiguousarray(np.asarray(p).T) for p in table)
    held = hostcopy.narrow(np.array(qdot.tile(jnp.asarray(codes))), form.bits, form.affine)
    assert held.shape == (inputs * form.bits // 8, outputs) and held.dtype == np.uint8
    np.testing.assert_array_equal(qdot.untile(jnp.asarray(held), inputs, form.affine), codes)
    parts = (jnp.asarray(held), *map(jnp.asarray, rest))
    np.testing.assert_array_equal(qdot.narrow(qdot.tile(codes), form.bits, form.affine), held)
    dot = jax.jit(qdot.dot, static_argnums=3)
    for tokens in (1, 2, 4) if inputs > 512 else (1, 2, 4, 5):
        x = np.random.default_rng(tokens).standard_normal((tokens, inputs)).astype(np.float32)
        ours, xr = np.asarray(dot(jnp.asarray(x), parts, None, True)), _rounded(x)
        size = np.abs(xr) @ np.abs(w.T)
        assert np.all(np.abs(ours - xr @ w.T) <= 1e-5 * size + 1e-6), (tokens, kind)
        # float inputs: the same codes, the inputs as they are
        ours, size = np.asarray(dot(jnp.asarray(x), parts, None, False)), np.abs(x) @ np.abs(w.T)
        assert np.all(np.abs(ours - x @ w.T) <= 1e-5 * size + 1e-6), (tokens, kind, "float")
    if inputs > 512:
        return
    # XLA's path reads them too (a stack's layer, codes as int8)
    _, scale, offset, supers = qdot.levels(parts)
    weight = quant.QuantWeight(
        parts[0], scale, offset, axis=-2, dtype=jnp.float32, metadata={}, supers=supers,
        narrow=True, bits=form.bits, tiled=True,
    )  # fmt: skip
    weight.int8_inputs = True
    assert weight.form == form._replace(narrow=True, tiled=True)
    np.testing.assert_allclose(quant.dense(weight.arrays(), -2, jnp.float32), w.T, rtol=1e-6)
    with qdot.unsplit(False):
        xla = quant.dot(jnp.asarray(x), weight.held()[0], jnp.float32, None, True)
    np.testing.assert_allclose(np.asarray(xla), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits, affine, past", [(6, False, 32), (5, False, -17), (5, True, 32)])
def test_narrow_packing_refuses_codes_past_their_bits(bits: int, affine: bool, past: int) -> None:
    codes = np.zeros((64, 8), np.int8)
    codes[35, 5] = past
    with pytest.raises(ValueError, match=f"{bits}-bit codes are"):  # over the cores
        hostcopy.narrow(codes, bits, affine, np.empty((8 * bits, 8), np.uint8))
    with pytest.raises(ValueError, match=f"{bits}-bit codes are"):  # in place
        hostcopy.narrow(codes, bits, affine)


def test_the_build_is_keyed_on_what_it_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CPUs of one name, one with AVX-512: each its own library (the compiler's
    `-march` macros in the key), and another compiler version another library too."""
    import shutil

    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler is not None
    native = cpu._target(compiler, "-march=native")
    assert "__SSE2__" in native and native != cpu._target(compiler, "-march=x86-64")
    paths = []
    for target in ("#define __AVX2__ 1", "#define __AVX512F__ 1\n#define __AVX2__ 1"):
        monkeypatch.setattr(cpu, "_target", lambda *_, t=target: t)
        monkeypatch.setattr(cpu.subprocess, "run", lambda *a, **k: None)  # nothing built
        paths.append(cpu.build(qdot.SOURCE))
    assert paths[0] != paths[1]


def test_builders_that_start_together_build_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Processes finding one library missing at once (the suite's workers and its
    eight-device run, on a cold cache) take turns: one compiles, the others find it built."""
    import threading
    import time

    monkeypatch.setattr(cpu, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu, "_target", lambda *_: "#define __AVX2__ 1")
    builds = []

    def compile_(cmd: list[str], **_: object) -> None:
        builds.append(cmd)
        time.sleep(0.2)
        Path(cmd[-1]).write_bytes(b"built")  # the `-o` file

    monkeypatch.setattr(cpu.subprocess, "run", compile_)
    paths: list[Path] = []
    builders = [threading.Thread(target=lambda: paths.append(cpu.build(qdot.SOURCE)))
                for _ in range(3)]  # fmt: skip
    for b in builders:
        b.start()
    for b in builders:
        b.join()
    assert len(builds) == 1 and len(paths) == 3 and len(set(paths)) == 1
    assert paths[0].read_bytes() == b"built"


@pytest.mark.parametrize("fault", ["compiler fails", "compiler hangs", "symbol missing"])
def test_any_kernel_fault_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    names = qdot.NAMES
    if fault == "compiler fails":
        monkeypatch.setenv("CXX", "false")  # exits 1 on every call
        monkeypatch.setattr(cpu, "cache_dir", lambda: Path(tempfile.mkdtemp()))
    elif fault == "compiler hangs":
        monkeypatch.setattr(cpu, "BUILD_TIMEOUT_S", 0.001)
        monkeypatch.setattr(cpu, "cache_dir", lambda: Path(tempfile.mkdtemp()))
    else:
        names = (*names, "jpaged_no_such_kernel")
    with caplog.at_level(logging.WARNING):
        assert not cpu.register.__wrapped__(qdot.SOURCE, names)
    assert "unavailable, using XLA's path" in caplog.text


def _q4_0(inputs: int, outputs: int, seed: int) -> tuple[tuple[jax.Array, ...], np.ndarray]:
    """Random Q4_0-form kernel parts (packed codes `[in / 2, out]` centred on 8, a float32
    scale per 32 inputs) straight in the kernel's layout, and the codes and scales to build
    the float64 reference from (`_q4_0_ref`)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (inputs // 2, outputs), dtype=np.uint8)
    scale = rng.uniform(-0.01, 0.01, (inputs // 32, outputs)).astype(np.float32)
    return (jnp.asarray(codes), jnp.asarray(scale)), codes


def _q4_0_ref(
    x: np.ndarray, parts: tuple, codes: np.ndarray, cols: np.ndarray, size: bool = False
) -> np.ndarray:
    """float64 `x @ w[:, cols]` of `_q4_0`'s weights (a 128256-column head is 4 GB in
    float64): row r of a run of 16 holds input r (low nibble) and r + 16. `size`: `|x| @
    |w|` instead, the sum of the products' sizes."""
    scale = np.asarray(parts[1], np.float64)[:, cols]
    if size:
        x, scale = np.abs(x), np.abs(scale)
    held = codes[:, cols].reshape(-1, 16, len(cols))
    values = np.concatenate([held & 15, held >> 4], axis=1).astype(np.float64) - 8
    if size:
        values = np.abs(values)
    return x.astype(np.float64) @ (values * scale[:, None]).reshape(x.shape[1], -1)


def _checked_columns(outputs: int) -> np.ndarray:
    """All of a small matrix's columns; of a big one every 7th (one in each run of 8 that
    `qdot.tile` lays out together, each lane of a vector in turn, every tile of columns and
    every thread's share) and the last 64 (the part tile)."""
    if outputs <= 8192:
        return np.arange(outputs)
    return np.union1d(np.arange(0, outputs, 7), np.arange(outputs - 64, outputs))


@pytest.mark.parametrize(
    "tokens, inputs",
    [(t, i) for t in (1, 2) for i in ("float", "tiled", "int8")] + [(5, "tiled")],
)
@pytest.mark.parametrize(
    "shape", [(64, 32), (640, 2336), (4096, 14336), (14336, 4096), (4096, 128256)], ids=str
)
def test_q4_0_at_8b_shapes_matches_float64_reference(
    shape: tuple[int, int], tokens: int, inputs: str
) -> None:
    """One or two tokens against Q4_0 codes at tiny shapes and Llama-3.1-8B's (its MLP's
    up and down, a 128256-row head), the paths decode takes: with int8 inputs, or float ones
    (`tiled`), the codes in their tiles' order, in L2-sized tiles of columns (128256: three
    and a part); with float ones against codes as they lie, sub-block by sub-block; five
    tokens of float inputs against tiled codes: L2-sized tiles of columns split over the
    threads (`F4Columns`). Each output within 1e-5 of the sum of its products' sizes."""
    int8, tiled = inputs == "int8", inputs != "float"
    if tiled and not qdot.int8_kernel():
        pytest.skip("no AVX2")
    rows, outputs = shape
    parts, codes = _q4_0(rows, outputs, seed=rows + tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, rows)).astype(np.float32)
    held = (qdot.tile(parts[0]), *parts[1:]) if tiled else parts  # as the loader lays them
    dot = jax.jit(qdot.dot, static_argnums=(3, 4))
    ours = np.asarray(dot(jnp.asarray(x), held, None, int8, tiled))
    xr = _rounded(x) if int8 else x
    cols = _checked_columns(outputs)
    ref = _q4_0_ref(xr, parts, codes, cols)
    size = _q4_0_ref(xr, parts, codes, cols, size=True)
    ours = ours[:, cols]
    assert np.all(np.abs(ours - ref) <= 1e-5 * size + 1e-6), np.abs(ours - ref).max()


# the GGUF types a mixture's expert stacks hold (a Q4_K_M file's), as the loader lays them
STACK_FORMS = {q.name.lower(): gguf_blocks.EXACT[q][1] for q in (Q.Q4_K, Q.Q6_K, Q.Q8_0)}


def _expert_stacks(form: quant.Form, int8: bool, layers: int, experts: int, inputs: int,
                   outputs: int) -> tuple[tuple[jax.Array, ...], np.ndarray, bool]:  # fmt: skip
    """Random expert stacks `[layers, experts, ...]` of `form` as `qdot.dot_id` reads them
    (packed codes in `tile`'s order, narrow ones at their bits; int8 codes tiled with int8
    inputs), their values `[layers, experts, outputs, inputs]` in float64, and whether the
    codes are tiled."""
    tables = [
        [_quantized(outputs, inputs, form, seed=10 * layer + e) for e in range(experts)]
        for layer in range(layers)
    ]
    parts = [
        np.stack([np.stack([np.asarray(t[0][i]).T for t in row]) for row in tables])
        for i in range(len(tables[0][0][0]))
    ]
    w = np.stack([np.stack([t[1] for t in row]) for row in tables])
    codes = jnp.asarray(parts[0])
    tiled = int8 or form.packed or form.bits < 8
    if tiled:
        codes = qdot.tile(codes)
    if form.bits < 8:
        codes = qdot.narrow(codes, form.bits, form.affine)
    return (codes, *map(jnp.asarray, parts[1:])), w, tiled


@pytest.mark.parametrize("kind", STACK_FORMS)
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("own", [False, True], ids=["shared", "own"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_routed_experts_match_a_float64_reference(
    kind: str, int8: bool, own: bool, tokens: int
) -> None:
    """`dot_id` (llama.cpp's `mul_mat_id`): each (token, expert) pair's row times its expert's
    matrix of layer 1 of a stack of two, against a float64 reference of the same inputs (of
    the rounded ones with `int8`), every type a Q4_K_M mixture's experts hold; a token's row
    shared by its experts (gate, up) or a pair's own (down); one token (two experts: each
    one's contraction split over the threads), and 13 (one expert of 11 rows: chunks of the
    few-token readers; one of a single row). The experts no pair chose, and the other
    layer, have NaN scales: never read, the output is finite."""
    if int8 and not qdot.int8_kernel():
        pytest.skip("no AVX2")
    form, (layers, experts, inputs, outputs, k) = STACK_FORMS[kind], (2, 6, 512, 96, 2)
    parts, w, tiled = _expert_stacks(form, int8, layers, experts, inputs, outputs)
    ids = np.array([[1, 4]] * 11 + [[4, 2], [0, 4]], np.int32)[-tokens:]  # 3 and 5: none
    unread = np.ones((layers, experts), bool)
    unread[1, np.unique(ids)] = False
    parts = tuple(
        jnp.where(unread.reshape(layers, experts, 1, 1), jnp.nan, p).astype(p.dtype)
        if jnp.issubdtype(p.dtype, jnp.floating) else p
        for p in parts
    )  # fmt: skip
    rng = np.random.default_rng(len(kind) + own)
    x = rng.standard_normal((len(ids), k, inputs) if own else (len(ids), inputs)).astype(np.float32)
    one = jnp.asarray(1, jnp.int32)
    dot = jax.jit(qdot.dot_id, static_argnums=(4, 5))
    ours = np.asarray(dot(jnp.asarray(x), jnp.asarray(ids), parts, one, int8, tiled))
    assert ours.shape == (len(ids), k, outputs) and np.isfinite(ours).all()
    rows = x if own else np.broadcast_to(x[:, None], (len(ids), k, inputs))
    rows = _rounded(rows.reshape(-1, inputs)).reshape(rows.shape) if int8 else rows
    picked = w[1][ids]  # [T, k, out, in]
    ref = np.einsum("tki,tkoi->tko", rows.astype(np.float64), picked)
    size = np.einsum("tki,tkoi->tko", np.abs(rows), np.abs(picked))
    assert np.all(np.abs(ours - ref) <= 1e-5 * size + 1e-6), np.abs(ours - ref).max()
