"""Gemma 3 (text): the module, config.json -> ModelConfig, tensor names -> state paths.

Covers `Gemma3ForCausalLM` (1B: a text config) and the text half of
`Gemma3ForConditionalGeneration` (4B+: `text_config`, weights under a
`language_model` prefix). Released `text_config`s are sparse, so absent keys take
`Gemma3TextConfig`'s defaults, exactly as transformers does.
"""

from __future__ import annotations

from jpaged.models import llama
from jpaged.models.common import CausalLM
from jpaged.models.config import ModelConfig

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
MODEL_TYPES = ("gemma3_text", "gemma3")


class Gemma3(CausalLM):
    """Gemma 3: `(1 + w)` RMSNorms, q/k norms, sandwich norms around attention and MLP,
    embeddings scaled by `sqrt(hidden)`, sliding-window layers with their own RoPE base,
    tied embeddings (all of it `ModelConfig` data the shared blocks read)."""


# Llama's, with Qwen3's q/k norms and the sandwich norms: Gemma's post-attention norm is
# the attention's own, its MLP's input norm is the pre-feedforward one.
LAYER_TENSORS = {
    **llama.LAYER_TENSORS,
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    "post_attention_layernorm.weight": "post_attn_norm.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "post_mlp_norm.scale",
}
# Released multimodal checkpoints say `language_model.model.`, transformers >= 4.52 saves
# `model.language_model.`; both mean the text model's `model.`.
TENSOR_ALIASES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
IGNORED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _rope(hf: dict) -> tuple[float, tuple | None, float]:
    """(global theta, global scaling, local theta), the way
    Gemma3TextConfig.convert_rope_params_to_dict resolves them."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    max_position = int(hf.get("max_position_embeddings", 131_072))
    if llama.rope_scaling(local, max_position) is not None:
        raise ValueError("rope scaling on Gemma 3 sliding-window layers is not supported")
    scaling = llama.rope_scaling(full, max_position)
    return float(full["rope_theta"]), scaling, float(local["rope_theta"])


def model_config(hf: dict) -> ModelConfig:
    text = hf.get("text_config") or hf
    if text.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 use_bidirectional_attention (embedding models) is not supported")
    layers = int(text.get("num_hidden_layers", 26))
    pattern = int(text.get("sliding_window_pattern", 6))
    layer_types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    theta, scaling, local_theta = _rope(text)
    window = text.get("sliding_window", 4096)
    softcap = text.get("final_logit_softcapping")
    return ModelConfig(
        architecture="gemma3",
        vocab_size=int(text.get("vocab_size", 262_208)),
        hidden_size=int(text.get("hidden_size", 2304)),
        intermediate_size=int(text.get("intermediate_size", 9216)),
        num_layers=layers,
        num_heads=int(text.get("num_attention_heads", 8)),
        num_kv_heads=int(text.get("num_key_value_heads", 4)),
        head_dim=int(text.get("head_dim", 256)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        hidden_act=llama.activation(text, "hidden_activation", "gelu_pytorch_tanh"),
        qk_norm=True,
        norm_plus_one=True,
        embed_scale=True,
        sandwich_norm=True,
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)),
        sliding_window=None if window is None else int(window),
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        rope_local_base_freq=local_theta,
        final_logit_softcapping=None if softcap is None else float(softcap),
        # attn_logit_softcapping stays None: transformers' Gemma3Attention never passes it
        # to the attention function (checked in 5.23), and parity with it defines correct.
        bos_token_id=hf.get("bos_token_id", text.get("bos_token_id", 2)),
        eos_token_ids=llama.token_ids(hf.get("eos_token_id", text.get("eos_token_id", 1))),
    )


# The chat template of Google's Gemma 3 tokenizers (text parts only). A GGUF converted
# without one (google/gemma-3-270m's is) gets this. Gemma has no system role: a system
# message becomes the start of the first user turn, followed by a blank line.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
