"""Quantized weights: GGUF blocks unpacked exactly, and the matmul / row gather the step runs
on them against a float64 reference of the dequantized weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from jpaged import models
from jpaged.models import gguf_blocks, qdot, quant
from jpaged.models.loaded import LoadedModel

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


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


def _exact_blocks(qtype: GGMLQuantizationType, rows: int) -> tuple[np.ndarray, int]:
    """Blocks of `qtype` `[rows, 2 blocks]`: random bytes and (the types `gguf` quantizes)
    quantized values, the first two rows' scales float16 no normal number makes (-0,
    subnormal); the block's values."""
    rng = np.random.default_rng(int(qtype))
    elems = GGML_QUANT_SIZES[qtype][0]
    raw = _random_blocks(qtype, rows * 2, rng).reshape(rows, -1)
    if qtype not in K_QUANTS:  # gguf quantizes these itself
        w = rng.standard_normal((rows, 2 * elems)).astype(np.float32)
        raw = np.concatenate([raw[: rows // 2], gguf_quants.quantize(w[rows // 2 :], qtype)])
    at = 208 if qtype == Q.Q6_K else 0
    raw[:2, at : at + 2] = np.array([-0.0, 2**-20], np.float16).view(np.uint8).reshape(2, 2)
    return raw, elems


@pytest.mark.parametrize("qtype", gguf_blocks.EXACT)
@pytest.mark.parametrize("native", [True, False])
def test_unpack_is_bitwise_gguf_dequantize(
    qtype: GGMLQuantizationType, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every exact type, decoded by `hostcopy.cc` (137 rows: tiles of 64 over the cores, 8
    at a time, one left over; Llama's Q/K rows reordered) and without it."""
    if not native:
        monkeypatch.setattr(gguf_blocks.hostcopy.cpu, "library", lambda source: None)
    rows = 137
    raw, elems = _exact_blocks(qtype, rows)
    cols = 2 * elems
    ref = gguf_quants.dequantize(raw, qtype).reshape(rows, cols)
    b = gguf_blocks.unpack(raw, qtype, (rows, cols))
    form = gguf_blocks.layout(qtype)
    assert form is not None and b.scale.dtype == form.scale and b.block == form.block
    assert b.codes.dtype == (np.uint8 if form.packed else np.int8) and b.packed == form.packed
    assert b.codes.shape == (rows, cols // 2 if form.packed else cols)
    assert (b.offset is not None) == form.affine
    np.testing.assert_array_equal(b.dense(), ref)  # bit for bit, float32
    # a Llama's Q or K rows as llama.cpp orders them (4 heads of 34), put back as decoded
    llama = gguf_blocks.unpack(raw[:136], qtype, (136, cols), heads=4)
    np.testing.assert_array_equal(llama.dense(), gguf_blocks.unpermute(ref[:136], 4))
    # regrouped to a smaller sub-block (a name whose layers mix types) still exact
    np.testing.assert_array_equal(b.regrouped(quant.Form(16, True)).dense(), ref)
    if form.packed:  # beside affine 4-bit layers: still packed, still exact
        np.testing.assert_array_equal(b.regrouped(quant.Form(32, True, True)).dense(), ref)
        np.testing.assert_array_equal(gguf_blocks.pack(b.unpacked(), not form.affine), b.codes)


@pytest.mark.parametrize("qtype", gguf_blocks.EXACT)
def test_blocks_decoded_into_a_fused_matrix_transposed_and_tiled(
    qtype: GGMLQuantizationType,
) -> None:
    """Two tensors decoded straight into their columns of one fused matrix (8 and 64 of 72)
    are `unpack`'s arrays transposed there; tiled, the int8 kernels' order (`qdot.tile`)."""
    from jpaged.models import hostcopy

    raw, elems = _exact_blocks(qtype, 72)
    parts = [
        gguf_blocks.Encoded(r.reshape(-1), qtype, (len(r), 2 * elems)) for r in (raw[:8], raw[8:])
    ]
    whole = gguf_blocks.unpack(raw, qtype, (72, 2 * elems))
    ref = [
        None if a is None else np.ascontiguousarray(a.T)
        for a in (*whole[:3], *(whole.supers or (None, None)))
    ]

    def decoded(order: int) -> list[np.ndarray | None]:
        out = [None if a is None else np.full_like(a, 7) for a in ref]
        for part, col0 in zip(parts, (0, 8), strict=True):
            assert part.into(hostcopy.Into(tuple(out), order, col0))
        return out

    for got, want in zip(decoded(1), ref, strict=True):
        np.testing.assert_array_equal(got, want)
    hostcopy.tile(ref[0])
    for got, want in zip(decoded(2), ref, strict=True):
        np.testing.assert_array_equal(got, want)


def test_other_types_requantize_to_int8() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    b = gguf_blocks.requantize(w)
    assert gguf_blocks.layout(Q.Q2_K) == quant.Form(32, False) and gguf_blocks.layout(Q.F16) is None
    assert np.abs(b.dense() - w).max() <= np.abs(w).max() / 127
    # fp8: e4m3's 3 mantissa bits, a relative error of at most 1/16 (subnormals aside)
    f = gguf_blocks.requantize(w, 512, fp8=True)
    assert f.codes.dtype == quant.FP8 and f.scale.shape == (4, 1)
    assert np.abs(f.codes.astype(np.float32)).max() == 448.0
    assert np.abs(f.dense() - w).max() <= np.abs(w).max() / 16
    with pytest.raises(ValueError, match="not held as int8"):
        f.regrouped(quant.Form(512, False))


def _quantized(rows: int, cols: int, form: quant.Form, seed: int) -> tuple:
    """Random codes/scale(/offset) of a `[rows, cols]` table with sub-blocks along cols, and
    their dequantized values in float64."""
    rng = np.random.default_rng(seed)
    block, affine, packed = form.block, form.affine, form.packed
    low, high = ((0, 16) if affine else (-8, 8)) if packed else (-32, 32)
    if form.bits < 8:  # a narrow type's whole range (Q5_1's and Q5_K's from 0)
        low = 0 if affine else -(1 << (form.bits - 1))
        high = low + (1 << form.bits)
    codes = rng.integers(low, high, (rows, cols)).astype(np.int8)
    if form.fp8:  # values e4m3 holds exactly, of either sign and several exponents
        codes = (codes * rng.choice([0.125, 1.0, 4.0], codes.shape)).astype(quant.FP8)
    held = gguf_blocks.pack(codes, not affine) if packed else codes
    if form.group:  # a K-quant's: 6-bit sub-scales (Q6_K's signed) times a float16 a group
        b = gguf_blocks.Blocks(
            held,
            rng.integers(0 if affine else -32, 64 if affine else 32, (rows, cols // block)),
            rng.integers(0, 64, (rows, cols // block)) if affine else None,
            (
                rng.uniform(-2e-3, 2e-3, (rows, cols // block // form.group)),
                -rng.uniform(0, 3e-3, (rows, cols // block // form.group)) if affine else None,
            ),
        )
        subs = [a.astype(np.int8) for a in (b.scale, b.offset) if a is not None]
        supers = [a.astype(np.float16) for a in b.supers if a is not None]  # type: ignore[union-attr]
        b = b._replace(scale=subs[0], offset=subs[1] if affine else None)
        b = b._replace(supers=(supers[0], supers[1] if affine else None))
        parts = tuple(jnp.asarray(a) for a in (held, *subs, *supers))
        return parts, b.dense().astype(np.float64)
    scale = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(form.scale)
    offset = rng.uniform(-0.1, 0.1, scale.shape).astype(form.scale) if affine else None
    w = codes.astype(np.float64).reshape(rows, -1, block) * scale[..., None].astype(np.float64)
    if offset is not None:
        w = w + offset[..., None]
    parts = tuple(jnp.asarray(a) for a in (held, scale, offset) if a is not None)
    return parts, w.reshape(rows, cols)


FORMS = [
    # float16 scales as Q5_1's and Q4_0's, float32 as the K-quants'
    quant.Form(32, True, half=True), quant.Form(16, False),
    quant.Form(32, True, packed=True), quant.Form(64, False, packed=True, half=True),
    quant.Form(640, False),  # one scale per output channel (int8), factored out of the sum
    quant.Form(640, False, fp8=True), quant.Form(32, False, fp8=True),
    # two levels as the K-quants' (whose groups of 8 and 16 sub-blocks the GGUF tests load)
    quant.Form(32, True, packed=True, group=4), quant.Form(16, False, group=8),
]  # fmt: skip


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
def test_dot_matches_float64_reference(form: quant.Form, tokens: int) -> None:
    # [in, out] kernel: 640 x 256 makes several cache-sized slices of the contraction axis
    parts, w = _quantized(256, 640, form, seed=tokens)
    kernel = tuple(p.T for p in parts)  # sub-blocks along `in`
    x = np.random.default_rng(1).standard_normal((tokens, 640)).astype(np.float32)
    held = kernel[0].shape[0]
    unit = 1 if form.block == 640 else held // kernel[1].shape[0]
    assert quant._chunk(held, 256, unit, quant.CHUNK) < held
    y = jax.jit(quant.dot, static_argnums=2)(jnp.asarray(x), kernel, jnp.float32)
    ref = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "form",
    [
        quant.Form(32, False), quant.Form(16, True), quant.Form(32, False, True),
        quant.Form(96, False, fp8=True),
        # two levels, as a CPU holds a K-quant table (Q6_K's; Q4_K's, an untied embedding)
        quant.Form(16, False, group=2), quant.Form(32, True, True, group=3),
    ],
    ids=str,
)  # fmt: skip
def test_tied_head_and_rows_match_float64_reference(
    form: quant.Form, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts, w = _quantized(1024, 96, form, seed=form.block)  # a [vocab, hidden] table
    monkeypatch.setattr(quant, "HEAD_CHUNK", 96 * 256)  # a few slices of the vocabulary
    h = np.random.default_rng(2).standard_normal((3, 96)).astype(np.float32)
    assert quant._chunk(1024, 96, 1, quant.HEAD_CHUNK) < 1024
    logits = jax.jit(quant.dot_t, static_argnums=2)(jnp.asarray(h), parts, jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), h.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
    ids = jnp.asarray([5, 0, 1023, 5])
    rows = quant.take_rows(parts, ids, jnp.float32)
    np.testing.assert_allclose(np.asarray(rows), w[np.asarray(ids)], rtol=1e-6, atol=1e-7)


def test_row_parallel_sub_blocks_must_not_straddle_devices() -> None:
    from jpaged.models import loader
    from jpaged.models.config import ModelConfig

    c = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    ok = loader.abstract(c, jnp.float32)
    form = quant.Form(32, True, packed=True)
    quant.quantize(ok, {"layers.mlp.down.kernel": form}, devices=3)  # 96 / 32 = 3 blocks
    assert quant.layout_of(ok) == {"layers.mlp.down.kernel": form}
    assert ok.layers.mlp.down.kernel.scale.shape == (2, 3, 64)
    assert ok.layers.mlp.down.kernel.codes.shape == (2, 48, 64)  # two codes a byte
    bad = loader.abstract(c, jnp.float32)
    with pytest.raises(ValueError, match=r"layers.mlp.down.kernel: 3 sub-blocks of 32 .* straddle"):
        quant.quantize(bad, {"layers.mlp.down.kernel": form}, devices=2)
    # a K-quant's two levels of scales are a single device's (a CPU's) form
    two = {"layers.attn.o.kernel": quant.Form(16, False, group=4)}
    with pytest.raises(ValueError, match=r"layers.attn.o.kernel: its scales are held in two"):
        quant.quantize(loader.abstract(c, jnp.float32), two, devices=2)
    quant.quantize(one := loader.abstract(c, jnp.float32), two, devices=1)
    assert quant.layout_of(one) == two
    assert one.layers.attn.o.kernel.scale_super.shape == (2, 1, 64)  # 64 inputs: one group


# --------------------------------------------------------------- the demo models' weights


def _greedy_agrees(quantized: Any, dense: Any, prompt: list[int], steps: int) -> int:
    """Greedy-decode `steps` tokens with the float model, then score that sequence with the
    quantized one: each position's argmax must be the float model's, or the float model's
    top two within 1e-3 (a tie). Returns the positions checked."""
    n = len(prompt) + steps
    run = jax.jit(models.logits)
    ids = np.zeros((1, n), np.int32)  # causal: the padding after a position never reaches it
    ids[0, : len(prompt)] = prompt
    for t in range(len(prompt), n):
        ids[0, t] = int(np.asarray(run(dense, jnp.asarray(ids)))[0, t - 1].argmax())
    ref = np.asarray(run(dense, jnp.asarray(ids)))[0, len(prompt) - 1 : n - 1]
    ours = np.asarray(run(quantized, jnp.asarray(ids)))[0, len(prompt) - 1 : n - 1]
    for t, (q, r) in enumerate(zip(ours, ref, strict=True)):
        top2 = np.sort(r)[-2:]
        assert q.argmax() == r.argmax() or top2[1] - top2[0] < 1e-3, f"token {t}"
    return len(ref)


@pytest.fixture(scope="module")
def smol_dense(demo_gguf: Callable[[str], Path]) -> LoadedModel:
    return models.load(demo_gguf("smollm2-135m"), "float32", quantization="none")


def test_smollm2_quantized_greedy_equals_float_and_bytes(
    demo_model: Callable[[str], LoadedModel],
    demo_gguf: Callable[[str], Path],
    smol_dense: LoadedModel,
) -> None:
    smol = demo_model("smollm2-135m")
    tok = smol.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    for prompt in (list(chat), tok("The quick brown fox")["input_ids"]):
        _greedy_agrees(smol.model, smol_dense.model, prompt, steps=12)
    # resident weights: every device array of the model (the KV pool is the engine's)
    held, _ = quant.footprint(smol.model)
    dense, _ = quant.footprint(smol_dense.model)
    print(f"SmolLM2 weights: {held / 1e6:.1f} MB quantized, {dense / 1e6:.1f} MB float32")
    assert dense > 530e6 and held <= 0.19 * dense  # 4-bit codes two a byte, float16 scales: 0.18x
    # Q8_0 and Q4_1: the file's float16 scales (and offsets)
    assert quant.layout_of(smol.model)["embed.embedding"] == quant.Form(32, False, half=True)
    down = quant.layout_of(smol.model)["layers.mlp.down.kernel"]
    # in the CPU kernels' order where they read them (`quant.tiled_takes`)
    assert down == quant.Form(32, True, True, half=True, tiled=qdot.int8_kernel())
    # int8 from the GGUF's dequantized values: a scale per output channel
    int8 = models.load(demo_gguf("smollm2-135m"), "float32", quantization="int8")
    _greedy_agrees(int8.model, smol_dense.model, list(chat), steps=12)
    assert quant.layout_of(int8.model)["layers.mlp.down.kernel"] == quant.Form(1536, False)
    assert quant.footprint(int8.model)[0] <= 0.26 * dense


def test_engine_config_checks_quantization() -> None:
    from jpaged import EngineConfig

    assert EngineConfig().quantization == "auto"
    with pytest.raises(ValueError, match=r"EngineConfig.quantization must be one of"):
        EngineConfig(quantization="int4")
    assert EngineConfig().activations == "float"
    with pytest.raises(ValueError, match=r"EngineConfig.activations must be one of"):
        EngineConfig(activations="int4")


@pytest.mark.parametrize("how", ["int8", "fp8"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_weight_only_safetensors_within_a_perplexity_ratio_of_float(
    tiny_checkpoint: Callable[..., Path], family: str, how: str
) -> None:
    """`quantization="int8"` / `"fp8"`: every matrix int8 (float8_e4m3) with a scale per
    output channel, quantized as it loads; on a fixed text the perplexity stays within 1.01x
    of the float model's and each position's argmax is the float one's (or a tie within
    1e-3)."""
    path = tiny_checkpoint(family)
    dense = models.load(path, "float32")
    int8 = models.load(path, "float32", quantization=how)
    layout = quant.layout_of(int8.model)
    c = int8.config
    fp8 = how == "fp8"
    assert layout["layers.mlp.down.kernel"] == quant.Form(c.intermediate_size, False, fp8=fp8)
    assert layout["embed.embedding"] == quant.Form(c.hidden_size, False, fp8=fp8)  # per channel
    assert f"as {'fp8 (e4m3)' if fp8 else 'int8'} codes" in quant.describe(int8.model)
    assert not quant.layout_of(dense.model)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, c.vocab_size, (2, 48)), jnp.int32)
    run = jax.jit(models.logits)

    def perplexity(model: Any) -> float:
        logp = jax.nn.log_softmax(run(model, ids)[:, :-1], -1)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], -1)
        return float(jnp.exp(-picked.mean()))

    ratio = perplexity(int8.model) / perplexity(dense.model)
    print(f"{family}: {how} / float32 perplexity {ratio:.5f}")
    assert ratio <= 1.01  # (random tiny models: int8 may as well land a little lower)
    assert _greedy_agrees(int8.model, dense.model, [5, 17, 99, 3], steps=8)
    held, values = quant.footprint(int8.model)
    assert held < 0.3 * quant.footprint(dense.model)[0]


def test_gpu_layout_reads_int8_stacks_at_an_unfolded_layer_index(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a GPU traces the step (layers unrolled, quantized stacks whole, read at a layer
    index XLA cannot fold: `tests/multidevice/test_gpu_structure.py` pins that no weight is
    then copied), through XLA's path: the same logits as the CPU's layer scan."""
    from jpaged import models

    int8 = models.load(tiny_checkpoint("llama"), "float32", quantization="int8")
    ids = jnp.asarray(np.random.default_rng(1).integers(3, int8.config.vocab_size, (1, 24)))
    scanned = jax.jit(models.logits)(int8.model, ids)
    monkeypatch.setattr(models.common, "on_gpu", lambda: True)
    monkeypatch.setattr(qdot, "stacks", lambda: False)
    monkeypatch.setattr(qdot, "usable", lambda *_, **__: False)
    jax.clear_caches()  # traced anew: on_gpu is read while tracing
    try:
        unrolled = jax.jit(models.logits)(int8.model, ids)
    finally:
        jax.clear_caches()
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(scanned), rtol=1e-4, atol=1e-4)


def test_int8_row_parallel_layers_scale_each_devices_rows() -> None:
    from jpaged.models import loader
    from jpaged.models.config import ModelConfig

    c = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    one, two = loader._weight_only_layout(c, 1, "int8"), loader._weight_only_layout(c, 2, "int8")
    down = "layers.mlp.down.kernel"  # row-parallel: split along its 64 inputs
    assert one[down] == quant.Form(64, False) and two[down] == quant.Form(32, False)
    assert one["layers.attn.q.kernel"] == two["layers.attn.q.kernel"] == quant.Form(32, False)
