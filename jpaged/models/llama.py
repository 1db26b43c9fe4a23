"""Llama 3.x: the module, Hugging Face config.json -> ModelConfig, tensor names -> state paths.

Defaults for absent keys are `LlamaConfig`'s. The RoPE and EOS helpers here are
shared with the other families, whose configs follow the same conventions.
"""

from __future__ import annotations

from typing import Any

from jpaged.models.common import CausalLM
from jpaged.models.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class Llama(CausalLM):
    """Llama 3.x: the shared blocks as they are (RMSNorm scaling by w, SiLU MLP, optional
    biases, `llama3`/`linear` RoPE scaling)."""


# Per-layer tensors, relative to `model.layers.{i}.` -> state paths relative to `layers.`
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.scale",
    "self_attn.q_proj.weight": "attn.q.kernel",
    "self_attn.k_proj.weight": "attn.k.kernel",
    "self_attn.v_proj.weight": "attn.v.kernel",
    "self_attn.o_proj.weight": "attn.o.kernel",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.bias": "attn.o.bias",
    "post_attention_layernorm.weight": "mlp_norm.scale",
    "mlp.gate_proj.weight": "mlp.gate.kernel",
    "mlp.up_proj.weight": "mlp.up.kernel",
    "mlp.down_proj.weight": "mlp.down.kernel",
    "mlp.gate_proj.bias": "mlp.gate.bias",
    "mlp.up_proj.bias": "mlp.up.bias",
    "mlp.down_proj.bias": "mlp.down.bias",
}


def rope_scaling(params: dict | None, max_position_embeddings: int) -> tuple | None:
    """ModelConfig.rope_scaling from a rope dict (`rope_scaling` or `rope_parameters`)."""
    kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if kind == "default":
        return None
    assert params is not None
    if kind == "linear":
        return ("linear", float(params["factor"]))
    if kind == "llama3":
        return (
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings", max_position_embeddings)),
        )
    raise ValueError(
        f"unsupported rope type {kind!r} in config.json (supported: default, linear, llama3)"
    )


def rope(hf: dict, default_theta: float, max_position: int) -> tuple[float, tuple | None]:
    """(theta, scaling): transformers 5 writes `rope_parameters` (theta inside);
    released checkpoints write `rope_theta` + `rope_scaling`, which wins when set."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    return theta, rope_scaling(params, max_position)


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def activation(hf: dict, key: str, default: str) -> str:
    act = hf.get(key) or default
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported {key} {act!r} in config.json (supported: {ACTIVATIONS})")
    return act


def model_config(hf: dict) -> ModelConfig:
    heads = int(hf.get("num_attention_heads", 32))
    hidden = int(hf.get("hidden_size", 4096))
    max_position = int(hf.get("max_position_embeddings", 2048))
    theta, scaling = rope(hf, 10000.0, max_position)
    return ModelConfig(
        architecture="llama",
        vocab_size=int(hf.get("vocab_size", 32000)),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size", 11008)),
        num_layers=int(hf.get("num_hidden_layers", 32)),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_position,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=activation(hf, "hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_ids=token_ids(hf.get("eos_token_id", 2)),
    )
