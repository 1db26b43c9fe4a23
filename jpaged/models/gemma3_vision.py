"""Gemma 3's vision half (4B+, `Gemma3ForConditionalGeneration`): the SigLIP tower, the
multi-modal projector, config.json -> Gemma3VisionConfig, tensor names -> state paths.

`Gemma3Vision(pixels)` is transformers' `get_image_features`: the tower's last hidden
state, average-pooled from its patch grid to `mm_tokens_per_image` tokens, RMS-normed
(Gemma's `(1 + w)`) and projected to the text model's hidden size. Those embeddings take
the place of the image tokens' in the text sequence.

State: `tower.*` (`models.siglip`), `projector.norm` `[vision hidden]`,
`projector.proj.kernel` `[vision hidden, text hidden]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.common import Linear, _param, rms_norm
from jpaged.models.siglip import SiglipConfig, SiglipVision, siglip_config


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    tower: SiglipConfig
    text_hidden_size: int
    mm_tokens_per_image: int = 256
    image_token_id: int = 262_144
    boi_token_id: int = 255_999  # <start_of_image>
    eoi_token_id: int = 256_000  # <end_of_image>

    @property
    def tokens_per_side(self) -> int:
        return int(self.mm_tokens_per_image**0.5)


# Gemma3Config's vision_config when config.json has none (a SigLIP So400m at 896 px)
DEFAULT_VISION = {
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
}


def vision_config(hf: dict) -> Gemma3VisionConfig:
    """A `Gemma3ForConditionalGeneration` config.json; absent keys take `Gemma3Config`'s
    defaults (`image_token_index`, ...; transformers also reads the `*_id` spellings)."""
    tower = siglip_config(hf.get("vision_config") or DEFAULT_VISION)
    d = Gemma3VisionConfig(tower, 0)
    text = hf.get("text_config") or {}

    def token(name: str, default: int) -> int:
        return int(hf.get(f"{name}_index", hf.get(f"{name}_id", default)))

    c = Gemma3VisionConfig(
        tower=tower,
        text_hidden_size=int(text.get("hidden_size", 2304)),
        mm_tokens_per_image=int(hf.get("mm_tokens_per_image", d.mm_tokens_per_image)),
        image_token_id=token("image_token", d.image_token_id),
        boi_token_id=token("boi_token", d.boi_token_id),
        eoi_token_id=token("eoi_token", d.eoi_token_id),
    )
    side = tower.patches_per_side
    if c.tokens_per_side**2 != c.mm_tokens_per_image or side % c.tokens_per_side:
        raise ValueError(
            f"mm_tokens_per_image {c.mm_tokens_per_image} must be a square whose side divides "
            f"the {side}x{side} patch grid"
        )
    return c


class Projector(nnx.Module):
    """Gemma3MultiModalProjector: patch grid -> `mm_tokens_per_image` text embeddings."""

    def __init__(self, config: Gemma3VisionConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        vh = config.tower.hidden_size
        self.norm = _param(jnp.zeros((vh,), dtype))  # mm_soft_emb_norm, (1 + w)
        self.proj = Linear(
            vh, config.text_hidden_size, bias=False, column=True, dtype=dtype, rngs=rngs
        )
        self.config = config

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, num_patches, vision hidden]
        c = self.config
        b, _, d = x.shape
        side, out = c.tower.patches_per_side, c.tokens_per_side
        k = side // out
        grid = x.reshape(b, out, k, out, k, d).astype(jnp.float32)
        pooled = grid.mean(axis=(2, 4)).astype(x.dtype).reshape(b, out * out, d)
        return self.proj(rms_norm(pooled, self.norm[...], c.tower.layer_norm_eps, True))


class Gemma3Vision(nnx.Module):
    def __init__(self, config: Gemma3VisionConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.tower = SiglipVision(config.tower, dtype=dtype, rngs=rngs)
        self.projector = Projector(config, dtype=dtype, rngs=rngs)
        self.config = config

    def __call__(
        self,
        pixels: jax.Array,  # [B, 3, image_size, image_size], `models.image.preprocess`d
    ) -> jax.Array:
        """Each image's soft tokens `[B, mm_tokens_per_image, text hidden]`."""
        return self.projector(self.tower(pixels))


def image_features(
    graphdef: nnx.GraphDef[Gemma3Vision],
    state: nnx.State | dict,
    pixels: jax.Array,  # [B, 3, image_size, image_size]
) -> jax.Array:
    """`Gemma3Vision.__call__` on a split module, for `jax.jit` (weights a plain pytree)."""
    return nnx.merge(graphdef, state)(pixels)


# jitted as engines call it (graphdef static): the H100 compile merged q, k and v's GEMMs
# by copying their weights together, 8 MiB a layer every call (as the text step's did)
encode = jax.jit(
    image_features,
    static_argnums=0,
    compiler_options={"xla_gpu_dot_merger_threshold_mb": 0},
)


# Checkpoint names, after the aliases, -> state paths (`models.loader.vision_naming`).
# The tower's names are SiglipVisionModel's (`vision_model.` dropped by the aliases).
VISION_TENSORS = {
    "vision_tower.embeddings.patch_embedding.weight": "tower.patch.kernel",
    "vision_tower.embeddings.patch_embedding.bias": "tower.patch.bias",
    "vision_tower.embeddings.position_embedding.weight": "tower.position",
    "vision_tower.post_layernorm.weight": "tower.post_norm.scale",
    "vision_tower.post_layernorm.bias": "tower.post_norm.bias",
    "multi_modal_projector.mm_soft_emb_norm.weight": "projector.norm",
    "multi_modal_projector.mm_input_projection_weight": "projector.proj.kernel",
}
VISION_LAYER_PREFIX = "vision_tower.encoder.layers."
VISION_LAYER_TENSORS = {
    "layer_norm1.weight": "norm1.scale",
    "layer_norm1.bias": "norm1.bias",
    "layer_norm2.weight": "norm2.scale",
    "layer_norm2.bias": "norm2.bias",
    **{
        f"{part}.{kind}": f"{short}.{'kernel' if kind == 'weight' else 'bias'}"
        for part, short in (
            ("self_attn.q_proj", "q"),
            ("self_attn.k_proj", "k"),
            ("self_attn.v_proj", "v"),
            ("self_attn.out_proj", "o"),
            ("mlp.fc1", "fc1"),
            ("mlp.fc2", "fc2"),
        )
        for kind in ("weight", "bias")
    },
}
# Released checkpoints say `vision_tower.vision_model.`, transformers 4.52-4.x saves
# `model.vision_tower.vision_model.`, 5.x `vision_tower.` (longest first: the first
# matching alias applies).
VISION_ALIASES = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}
# the text model's, and SigLIP's pooling head, which Gemma 3 never runs
VISION_IGNORED = ("language_model.", "model.language_model.", "lm_head.", "vision_tower.head.")


def from_checkpoint(key: str, value: np.ndarray) -> np.ndarray:
    """Checkpoint tensor -> the module's layout for state path `key` (a layer's, unstacked):
    PyTorch's `[out, in]` kernels transposed; the patch Conv2d `[hidden, C, p, p]`
    flattened to `[C * p * p, hidden]`; the projection is stored `[in, out]` already."""
    if key == "tower.patch.kernel":
        return value.reshape(value.shape[0], -1).T
    if key.endswith(".kernel") and key != "projector.proj.kernel":
        return value.T
    return value
