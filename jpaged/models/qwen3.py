"""Qwen3: Llama plus per-head q/k RMSNorm and an explicit head_dim. Defaults are `Qwen3Config`'s."""

from __future__ import annotations

from jpaged.models import llama
from jpaged.models.common import CausalLM
from jpaged.models.config import ModelConfig

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


class Qwen3(CausalLM):
    """Qwen3: Llama's blocks with per-head q/k RMSNorm (`config.qk_norm`) and, in some
    checkpoints, sliding-window layers."""


LAYER_TENSORS = {
    **llama.LAYER_TENSORS,
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
}


def model_config(hf: dict) -> ModelConfig:
    heads = int(hf.get("num_attention_heads", 32))
    layers = int(hf.get("num_hidden_layers", 32))
    max_position = int(hf.get("max_position_embeddings", 32768))
    theta, scaling = llama.rope(hf, 10000.0, max_position)
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    layer_types = hf.get("layer_types") or [
        "sliding_attention"
        if window is not None and i >= hf.get("max_window_layers", 28)
        else "full_attention"
        for i in range(layers)
    ]
    return ModelConfig(
        architecture="qwen3",
        vocab_size=int(hf.get("vocab_size", 151936)),
        hidden_size=int(hf.get("hidden_size", 4096)),
        intermediate_size=int(hf.get("intermediate_size", 22016)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or 128),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_position,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        hidden_act=llama.activation(hf, "hidden_act", "silu"),
        qk_norm=True,
        sliding_window=None if window is None else int(window),
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=llama.token_ids(hf.get("eos_token_id")),
    )
