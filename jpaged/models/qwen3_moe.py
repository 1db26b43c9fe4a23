"""Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF `qwen3moe`): Qwen3's attention, and in its sparse
layers a mixture of experts (`models.moe`) in place of the MLP. Defaults are
`Qwen3MoeConfig`'s."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from jpaged.models import moe, qwen3
from jpaged.models.common import CausalLM, DecoderLayer, LayerInputs
from jpaged.models.config import ModelConfig

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)

# Per-layer tensors (`model.layers.{i}.` stripped); the experts' `mlp.experts.{j}.*` are
# stacked by the loader into `mlp.experts.*` first (`stack_experts`)
LAYER_TENSORS = {
    **qwen3.LAYER_TENSORS,
    "mlp.gate.weight": "moe.router",
    "mlp.experts.gate_proj.weight": "moe.gate.kernel",
    "mlp.experts.up_proj.weight": "moe.up.kernel",
    "mlp.experts.down_proj.weight": "moe.down.kernel",
}


class MoEDecoderLayer(DecoderLayer):
    """A Qwen3 layer whose MLP is the experts where `MoEConfig.sparse_layers` says, the
    dense MLP elsewhere (a model with both holds both, `models.moe.absent`)."""

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        super().__init__(config, dtype=dtype, rngs=rngs)
        m = config.moe
        assert m is not None
        if all(m.sparse_layers):
            self.mlp = None  # type: ignore[assignment]
        self.moe = moe.MoE(config, dtype=dtype, rngs=rngs) if any(m.sparse_layers) else None
        self.sparse = tuple(m.sparse_layers)

    def feed_forward(self, y: jax.Array, inputs: LayerInputs, mesh: Mesh | None) -> jax.Array:
        devices = 1 if mesh is None else mesh.size
        index = inputs.layer_index

        def dense(y: jax.Array) -> jax.Array:
            assert self.mlp is not None
            return self.mlp(y, inputs.adapters, devices)

        def sparse(y: jax.Array) -> jax.Array:
            assert self.moe is not None
            return self.moe(y, index, mesh)

        if self.moe is None:
            return dense(y)
        if self.mlp is None:
            return sparse(y)
        assert index is not None
        return lax.cond(jnp.asarray(self.sparse)[index], sparse, dense, y)


class Qwen3Moe(CausalLM):
    """Qwen3-MoE: Qwen3's blocks, experts in the MLP's place (`MoEDecoderLayer`)."""

    layer_class = MoEDecoderLayer


def model_config(hf: dict) -> ModelConfig:
    dense = qwen3.model_config(hf)
    return dataclasses.replace(
        dense,
        architecture="qwen3moe",
        intermediate_size=int(hf.get("intermediate_size", 6144)),
        moe=moe.moe_config(hf, dense.num_layers),
    )
