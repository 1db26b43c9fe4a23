"""SigLIP's vision encoder (Gemma 3's vision tower) as a `flax.nnx` module.

Follows `transformers/models/siglip/modeling_siglip.py` (`SiglipVisionTransformer`,
eager attention) op for op: patches embedded by a linear map (its stride-`patch` Conv2d),
learned position embeddings, pre-LayerNorm encoder layers, a final LayerNorm. Gemma 3
reads the last hidden state, so the pooling head is not built.

State (kernels `[in, out]`, the layers' weights stacked `[num_layers, ...]` for a scan):

    patch.kernel         [channels * patch * patch, hidden]   (the Conv2d's, flattened)
    patch.bias           [hidden]
    position             [num_patches, hidden]
    layers.norm1.{scale,bias}, layers.norm2.{scale,bias}   [L, hidden]
    layers.{q,k,v,o}.{kernel,bias}                        [L, hidden, hidden], [L, hidden]
    layers.fc1.{kernel,bias}, layers.fc2.{kernel,bias}     [L, hidden, inter], [L, inter, hidden]
    post_norm.{scale,bias}                                 [hidden]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jpaged.kernels.common import on_gpu
from jpaged.models.common import Linear, _normal, _param


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def siglip_config(hf: dict) -> SiglipConfig:
    """A `vision_config` dict; absent keys take `SiglipVisionConfig`'s defaults."""
    d = SiglipConfig()
    act = hf.get("hidden_act", d.hidden_act)
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported SigLIP activation {act!r}")
    return SiglipConfig(
        hidden_size=int(hf.get("hidden_size", d.hidden_size)),
        intermediate_size=int(hf.get("intermediate_size", d.intermediate_size)),
        num_layers=int(hf.get("num_hidden_layers", d.num_layers)),
        num_heads=int(hf.get("num_attention_heads", d.num_heads)),
        num_channels=int(hf.get("num_channels", d.num_channels)),
        image_size=int(hf.get("image_size", d.image_size)),
        patch_size=int(hf.get("patch_size", d.patch_size)),
        layer_norm_eps=float(hf.get("layer_norm_eps", d.layer_norm_eps)),
        hidden_act=act,
    )


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm: mean and variance over the last axis, in the input's dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: Any) -> None:
        self.scale = _param(jnp.ones((dim,), dtype))
        self.bias = _param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


class EncoderLayer(nnx.Module):
    def __init__(self, config: SiglipConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c, h = config, config.hidden_size

        def linear(din: int, dout: int) -> Linear:
            return Linear(din, dout, bias=True, column=True, dtype=dtype, rngs=rngs)

        self.norm1 = LayerNorm(h, c.layer_norm_eps, dtype=dtype)
        self.q, self.k, self.v, self.o = (linear(h, h) for _ in range(4))
        self.norm2 = LayerNorm(h, c.layer_norm_eps, dtype=dtype)
        self.fc1 = linear(h, c.intermediate_size)
        self.fc2 = linear(c.intermediate_size, h)
        self.config = c

    def attention(self, x: jax.Array) -> jax.Array:  # [B, N, hidden], every patch sees all
        c = self.config
        b, n, _ = x.shape
        q, k, v = (p(x).reshape(b, n, c.num_heads, c.head_dim) for p in (self.q, self.k, self.v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c.head_dim**-0.5
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, -1)
        return self.o(out)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        tanh = self.config.hidden_act == "gelu_pytorch_tanh"
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=tanh))


class SiglipVision(nnx.Module):
    def __init__(self, config: SiglipConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        c = config
        patch_in = c.num_channels * c.patch_size**2
        self.patch = Linear(patch_in, c.hidden_size, bias=True, column=True, dtype=dtype, rngs=rngs)
        self.position = _param(_normal(rngs, (c.patches_per_side**2, c.hidden_size), dtype))

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def stacked(rngs: nnx.Rngs) -> EncoderLayer:
            return EncoderLayer(c, dtype=dtype, rngs=rngs)

        self.layers = stacked(rngs)
        self.post_norm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)
        self.config = c

    def __call__(
        self,
        pixels: jax.Array,  # [B, channels, image_size, image_size], preprocessed
    ) -> jax.Array:
        """The last hidden state `[B, num_patches, hidden]`, patches in row-major order."""
        c = self.config
        b, s, p = pixels.shape[0], c.patches_per_side, c.patch_size
        dtype = self.position.dtype
        # [B, C, s, p, s, p] -> [B, s, s, C, p, p]: each patch flattened as the Conv2d's
        # kernel [hidden, C, p, p] is
        patches = pixels.astype(dtype).reshape(b, c.num_channels, s, p, s, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(b, s * s, -1)
        x = self.patch(patches) + self.position[...]

        layer_def, layer_state = nnx.split(self.layers)

        def body(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
            return nnx.merge(layer_def, state)(x), None

        # unrolled on a GPU as the text model's layers are (`models.common`): a while loop
        # runs outside CUDA graphs and copied each layer's weights out of their stack
        x, _ = lax.scan(body, x, layer_state, unroll=c.num_layers if on_gpu() else 1)
        return self.post_norm(x)
