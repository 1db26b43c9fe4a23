"""Qwen3-MoE (`models.moe`, `models.qwen3_moe`) beyond the parity module's case (top-2,
unnormalised, a dense layer: tests/unit/test_models_parity.py): Qwen3-30B-A3B's routing (top-8,
renormalised, every layer sparse) against transformers, the three ways of computing the
experts against each other, and the per-expert naming of real checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import moe

TOP8 = {"num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": True, "mlp_only_layers": []}


@pytest.fixture(scope="module")
def top8(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3moe", **TOP8)


def test_top8_renormalised_matches_transformers_every_impl(
    top8: Path, hf_reference: Callable[[Path], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    model = models.load(top8, dtype="float32")
    assert model.config.moe is not None and all(model.config.moe.sparse_layers)
    assert model.model.layers.mlp is None  # no dense MLP held
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        ref = hf_reference(top8)(torch.tensor(seq)).logits.numpy()
    for impl in ("gather", "grouped", "dense"):
        monkeypatch.setattr(moe, "IMPL", impl)
        got = np.asarray(models.logits(model.model, jnp.asarray(seq, jnp.int32)))
        np.testing.assert_allclose(got, ref, atol=1e-4, err_msg=impl)


def test_route_is_softmax_then_top_k() -> None:
    """transformers' order: softmax over every expert, then the top k, renormalised only
    when asked."""
    from models.config import MoEConfig

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
