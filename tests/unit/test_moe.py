"""Qwen3-MoE (`models.moe`, `models.qwen3_moe`) beyond the parity module's case (top-2,
unnormalised, a dense layer: tests/unit/test_models_parity.py): Qwen3-30B-A3B's routing (top-8,
renormalised, every layer sparse) against transformers, the three ways of computing the
experts against each other, and the per-expert naming of real checkpoints."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import models
from jpaged.models import moe

TOP8 = {"num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": True, "mlp_only_layers": []}


@pytest.fixture(scope="module")
def top8(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3moe", **TOP8)


def test_top8_renormalised_matches_transformers_every_impl(
    top8: Path, hf_reference: Callable[[Path], Any]
) -> None:
    """The model's logits (the default way: grouped on a CPU) are transformers'; the other
    ways give the grouped one's layer outputs (one small program each, not a model's)."""
    import torch

    model = models.load(top8, dtype="float32")
    assert model.config.moe is not None and all(model.config.moe.sparse_layers)
    assert model.model.layers.mlp is None  # no dense MLP held
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        ref = hf_reference(top8)(torch.tensor(seq)).logits.numpy()
    got = np.asarray(models.logits(model.model, jnp.asarray(seq, jnp.int32)))
    np.testing.assert_allclose(got, ref, atol=1e-4)
    block, m = model.model.layers.moe, model.config.moe
    x = jnp.asarray(np.random.default_rng(1).normal(size=(22, model.config.hidden_size)))
    x = x.astype(jnp.float32)
    layer = jnp.int32(1)  # the stacks `[L, E, in, out]` read at layer 1
    weights, ids = moe.route(x, block.router[...][1], m)
    stacks = (block.gate.kernel[...], block.up.kernel[...], block.down.kernel[...])
    read = functools.partial(moe.take, layer=layer, dtype=x.dtype)
    act = functools.partial(moe.activation, model.config.hidden_act)

    def run(impl: str) -> np.ndarray:
        fn = jax.jit(lambda x, w, i: moe.experts(x, w, i, stacks, read, act, m.num_experts, impl))
        return np.asarray(fn(x, weights, ids))

    by_impl = {impl: run(impl) for impl in ("grouped", "gather", "dense")}
    assert np.abs(by_impl["grouped"]).max() > 1e-3  # (layer 1's experts, not zeros)
    for impl in ("gather", "dense"):
        np.testing.assert_allclose(by_impl[impl], by_impl["grouped"], atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_of_quantized_experts_at_a_layer_matches_dense(dtype: str) -> None:
    """The gather path (a GPU's decode: a vector times a matrix a pair) on Q8_0-style expert
    stacks `[L, E, in, out]` (int8 codes, float16 scales a block of 32) read at a layer
    gives the dense path's output, float32 and bf16."""
    from jpaged.models import quant

    rng = np.random.default_rng(3)
    t, k, e, h, i, layers = 3, 2, 5, 64, 32, 2
    dt = jnp.dtype(dtype)

    def stack(din: int, dout: int) -> quant.QuantWeight:
        codes = jnp.asarray(rng.integers(-127, 128, (layers, e, din, dout)), jnp.int8)
        scale = jnp.asarray(rng.uniform(0.5, 1.5, (layers, e, din // 32, dout)) / 127 / din**0.5)
        scale = scale.astype(jnp.float16)
        return quant.QuantWeight(codes, scale, None, axis=-2, dtype=dt, metadata={})

    stacks = (stack(h, i), stack(h, i), stack(i, h))
    x = jnp.asarray(rng.normal(size=(t, h)), dt)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), dt)
    read = functools.partial(moe.take, layer=jnp.int32(1), dtype=dt)
    act = functools.partial(moe.activation, "silu")
    got, want = (
        np.asarray(moe.experts(x, weights, ids, stacks, read, act, e, impl), np.float32)
        for impl in ("gather", "dense")
    )
    assert np.abs(want).max() > 1e-2
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_routed_kernel_matches_the_tiles_and_dense(int8: bool) -> None:
    """On a CPU a decode step's pairs go through the routed kernel (`dot_pairs`,
    `qdot.dot_id`): Q4_K gate, Q8_0 up and a down of Q4_K and Q6_K layers (a `MixedWeight`,
    as a Q4_K_M file's) read at layer 1 give the tiles' output (the same kernels' numerics,
    int8 inputs too) and, with float inputs, a float64 reference; "auto" takes it."""
    from jpaged.models import qdot, quant
    from tests.unit.test_qdot import STACK_FORMS, _expert_stacks

    if not qdot.available() or (int8 and not qdot.int8_kernel()):
        pytest.skip("no CPU kernels (int8 inputs: AVX2) here")
    t, k, e, h, i, layers = 3, 2, 6, 256, 256, 2

    values = {}  # each stack's float64 `[layers, E, out, in]`

    def stack(kind: str, din: int, dout: int, layers: int) -> quant.QuantWeight:
        form = STACK_FORMS[kind]
        parts, values[kind, din, layers], tiled = _expert_stacks(form, int8, layers, e, din, dout)
        codes, scale, offset, supers = qdot.levels(parts)
        w = quant.QuantWeight(
            codes, scale, offset, axis=-2, dtype=jnp.float32, metadata={}, supers=supers,
            narrow=form.bits < 8, bits=form.bits, tiled=tiled,
        )  # fmt: skip
        w.int8_inputs = int8
        return w

    # layer 1's down is the Q6_K stack's first
    down = quant.MixedWeight(
        [stack("q4_k", i, h, 1), stack("q6_k", i, h, 1)], jnp.int32(1), jnp.int32(0)
    )
    stacks = (stack("q4_k", h, i, layers), stack("q8_0", h, i, layers), down)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    layer = jnp.int32(1)
    read = functools.partial(moe.take, layer=layer, dtype=jnp.float32)
    dot = functools.partial(moe.dot_one, layer=layer, dtype=jnp.float32)
    pairs = functools.partial(moe.dot_pairs, layer=layer)
    act = functools.partial(moe.activation, "silu")
    with qdot.unsplit(True):
        assert moe.routed(stacks, t, k)

        def run(impl: str) -> Any:
            return moe.experts(x, weights, ids, stacks, read, act, e, impl, dot, pairs)

        assert "jpaged_qdot_id" in str(jax.make_jaxpr(run, static_argnums=0)("auto"))
        routed, tiles = (np.asarray(run(impl)) for impl in ("gather", "grouped"))
    assert np.abs(tiles).max() > 1e-2
    np.testing.assert_allclose(routed, tiles, rtol=1e-4, atol=1e-5 * np.abs(tiles).max())
    if not int8:
        g, u = (
            np.einsum("th,tkih->tki", x, values[kind, h, layers][1][ids])
            for kind in ("q4_k", "q8_0")
        )
        y = np.einsum("tki,tkhi->tkh", g / (1 + np.exp(-g)) * u, values["q6_k", i, 1][0][ids])
        want = np.einsum("tkh,tk->th", y, weights)
        np.testing.assert_allclose(routed, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_route_is_softmax_then_top_k() -> None:
    """transformers' order: softmax over every expert, then the top k, renormalised only
    when asked."""
    from jpaged.models.config import MoEConfig

    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32)
    router = jnp.asarray(np.random.default_rng(2).normal(size=(6, 4)), jnp.float32)
    probs = np.asarray(jax_softmax(np.asarray(x) @ np.asarray(router).T))
    for norm in (False, True):
        w, ids = moe.route(x, router, MoEConfig(6, 2, 8, norm_topk_prob=norm))
        want_ids = np.argsort(-probs, axis=-1)[:, :2]
        want = np.take_along_axis(probs, want_ids, -1)
        if norm:
            want = want / want.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)


def jax_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_sparse_layers_follow_mlp_only_layers_and_step() -> None:
    hf = {"num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe.sparse_layers(hf, 6) == (False, True, False, False, False, True)
    assert moe.sparse_layers({"num_experts": 0}, 2) == (False, False)


def write_gguf(path: Path, hf_dir: Path, qtypes: dict[str, Any]) -> None:
    """A qwen3moe GGUF of checkpoint `hf_dir`, as llama.cpp's convert_hf_to_gguf.py writes
    one: the experts stacked `[E, out, in]` (`ffn_*_exps`), `qtypes` by tensor stem
    (`ffn_down_exps`: Q4_0, ...; float32 otherwise)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(hf_dir / "model.safetensors")
    layers, experts = hf["num_hidden_layers"], hf["num_experts"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_expert_count(experts)
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab += [(a["content"], a["id"]) for a in tok["added_tokens"]]
    names = dict((i, t) for t, i in vocab)
    tokens = [names.get(i, f"<unused{i}>") for i in range(hf["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(tokens))  # (no merges: transformers reads the scores)
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    names_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    stacked: dict[str, np.ndarray] = {}
    for name, value in sd.items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.i.mlp.experts.j.gate_proj.weight
            j = int(parts[5])
            base = ".".join(parts[:5] + parts[6:7])
            stacked.setdefault(base, np.zeros((experts, *value.shape), np.float32))[j] = value
            continue
        stacked[name.rsplit(".", 1)[0]] = value
    for base, value in stacked.items():
        gname = f"{names_map.get_name(base)}.weight"
        qtype = qtypes.get(gname.split(".")[-2])
        data = np.asarray(value, np.float32)
        if qtype is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


WIDTH = 24  # tokens a forward of the GGUF test
logits = jax.jit(models.logits)  # one program for both files' models (the same structure)


def greedy(model: models.LoadedModel, prompt: list[int], steps: int = 8) -> list[int]:
    """`steps` greedy tokens after `prompt` from forwards over WIDTH tokens (causal: the
    padding after a position changes nothing at it)."""
    ids = list(prompt)
    for _ in range(steps):
        row = np.zeros((1, WIDTH), np.int32)
        row[0, : len(ids)] = ids
        out = np.asarray(logits(model.model, jnp.asarray(row)))
        ids.append(int(out[0, len(ids) - 1].argmax()))
    return ids[len(prompt) :]


def test_gguf_matches_its_safetensors_twin(top8: Path, tmp_path: Path) -> None:
    """A qwen3moe GGUF: float experts give the twin's logits and greedy tokens; quantized
    ones (Q8_0 gate/up, Q4_0 down) are held in their own bits and give the file's
    dequantized logits."""
    import gguf

    from jpaged.models import quant

    twin = models.load(top8, dtype="float32")
    write_gguf(tmp_path / "f32.gguf", top8, {})
    f32 = models.load(tmp_path / "f32.gguf", dtype="float32")
    assert f32.config.moe == twin.config.moe  # (the twin renormalises, as llama.cpp does)
    seq = jnp.asarray(np.random.default_rng(3).integers(0, 320, (1, WIDTH)), jnp.int32)
    want = np.asarray(models.logits(twin.model, seq))
    np.testing.assert_allclose(np.asarray(models.logits(f32.model, seq)), want, atol=1e-4)
    # greedy continuations of two prompts (one program: the logits of WIDTH tokens)
    for prompt in ([5, 17, 99, 3], list(range(30, 45))):
        assert greedy(twin, prompt) == greedy(f32, prompt)

    t = gguf.GGMLQuantizationType
    types = {"ffn_gate_exps": t.Q8_0, "ffn_up_exps": t.Q8_0, "ffn_down_exps": t.Q4_0}
    write_gguf(tmp_path / "q.gguf", top8, types)
    q = models.load(tmp_path / "q.gguf", dtype="float32")
    held = quant.layout_of(q.model)
    assert held["layers.moe.down.kernel"].packed and held["layers.moe.gate.kernel"].block == 32
    dense = models.load(tmp_path / "q.gguf", dtype="float32", quantization="none")
    np.testing.assert_allclose(
        np.asarray(models.logits(q.model, seq)), np.asarray(models.logits(dense.model, seq)),
        atol=1e-4,
    )  # fmt: skip
