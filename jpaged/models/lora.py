"""LoRA adapters: PEFT's files read into padded arrays, and the batched low-rank update.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`) and `adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight`
`[r, in]` and `lora_B.weight` `[out, r]`). A targeted projection computes
`y + (x @ A.T) @ B.T * scale`; here B is stored pre-scaled and transposed (`[r, out]`).
On the host an adapter keeps its own rank and only the projections it targets; written
to the device it is zero-padded to the engine's `max_lora_rank` and every projection
(`Adapter.padded`), so the step's shapes never depend on which adapters are resident.

In a step, all resident adapters sit in one array per projection, `[L, S, ...]` for S slots
(the scan slices the layer axis), and each token names its slot (0: none). `delta` computes
every slot's `x @ A` and keeps each token's own with a one-hot mask (one einsum over the
gathered slots, no per-token gather of A/B), so a token without an adapter adds exactly 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.config import ModelConfig

# PEFT's module names (HF's) -> ours, in the order the step's arrays hold them
MODULES = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


_MLP = ("gate_proj", "up_proj", "down_proj")  # a dense MLP's (a mixture's layers: experts)


def dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, i),
        "up": (h, i),
        "down": (i, h),
    }


@dataclasses.dataclass
class Adapter:
    """One adapter in host memory at its own rank r: per projection it targets, A
    `[L, in, r]` and B `[L, r, out]` (scaled), zeros in the layers it does not adapt.
    `shapes` / `layers`: the model's, for `padded`."""

    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    shapes: dict[str, tuple[int, int]]
    layers: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def padded(self, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every projection's A `[L, in, rank]` and B `[L, rank, out]`, zeros beyond the
        adapter's own rank and targets (what a device slot holds)."""
        out = {}
        for name, (din, dout) in self.shapes.items():
            a = np.zeros((self.layers, din, rank), np.float32)
            b = np.zeros((self.layers, rank, dout), np.float32)
            if name in self.weights:
                a[:, :, : self.rank], b[:, : self.rank] = self.weights[name]
            out[name] = (a, b)
        return out


def load_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """Read a PEFT adapter for a model of `config`. Raises ValueError naming the file and
    field for anything the engine cannot serve exactly."""
    from safetensors.numpy import load_file

    root = Path(path)
    cfg_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise ValueError(f"{f}: missing (a PEFT adapter directory holds {f.name})")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file}: not JSON ({exc})") from None

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{cfg_file}: {field}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"{cfg['peft_type']!r}, only LORA is served")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise bad("r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise bad("r", f"{rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, int | float):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    # What would change the math beyond x @ A @ B * scale: refused rather than served wrong.
    for field, plain in (
        ("bias", "none"),
        ("use_dora", False),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        if cfg.get(field, plain) not in (plain, None, {}, []):
            raise bad(field, f"{cfg[field]!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise bad("target_modules", f"unknown modules {unknown}; known: {sorted(MODULES)}")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora", False) else rank)

    def bad_tensor(key: str, why: str) -> ValueError:
        return ValueError(f"{weights_file}: {key}: {why}")

    shapes = dims(config)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, value in load_file(str(weights_file)).items():
        m = _KEY.search(key)
        if m is None:
            raise bad_tensor(key, "not a LoRA A/B weight of a decoder layer's projection")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in MODULES:
            raise bad_tensor(key, f"unknown module {module!r}; known: {sorted(MODULES)}")
        if layer >= config.num_layers:
            raise bad_tensor(key, f"layer {layer} of a {config.num_layers}-layer model")
        if config.moe is not None and config.moe.sparse_layers[layer] and module in _MLP:
            raise bad_tensor(key, f"layer {layer}'s MLP is experts, which take no adapter")
        din, dout = shapes[MODULES[module]]
        want = (rank, din) if which == "A" else (dout, rank)
        if value.shape != want:
            raise bad_tensor(key, f"shape {list(value.shape)}, expected {list(want)}")
        if MODULES[module] not in weights:
            weights[MODULES[module]] = (
                np.zeros((config.num_layers, din, rank), np.float32),
                np.zeros((config.num_layers, rank, dout), np.float32),
            )
        a, b = weights[MODULES[module]]
        if which == "A":
            a[layer] = value.T
        else:
            b[layer] = value.T.astype(np.float32) * np.float32(scale)
    return Adapter(str(root), rank, weights, shapes, config.num_layers)


class LoRABatch(NamedTuple):
    """A step's adapters (device arrays): each token's slot (int32 [T], 0: none) and per
    projection A `[L, S, in, R]`, B `[L, S, R, out]` over the S = max_loras resident slots
    (slot s at index s - 1)."""

    slots: jax.Array
    weights: dict[str, tuple[jax.Array, jax.Array]]


def batch(adapters: list[Adapter], slots: jax.Array, dtype: jnp.dtype) -> LoRABatch:
    """A `LoRABatch` of `adapters` in slots 1, 2, ... (outside the engine, which keeps its
    resident adapters in place: `jpaged.engine.lora`)."""
    rank = max(a.rank for a in adapters)
    padded = [a.padded(rank) for a in adapters]
    weights = {
        k: tuple(jnp.stack([p[k][i] for p in padded], axis=1).astype(dtype) for i in (0, 1))
        for k in padded[0]
    }
    return LoRABatch(jnp.asarray(slots, jnp.int32), weights)  # type: ignore[arg-type]


class LoRALayer(NamedTuple):
    """One layer's share of a `LoRABatch`: the tokens' one-hot slots `[T, S]` and the
    layer's A `[S, in, R]`, B `[S, R, out]`."""

    onehot: jax.Array
    weights: dict[str, tuple[jax.Array, jax.Array]]


def num_slots(batch: LoRABatch) -> int:
    return next(iter(batch.weights.values()))[0].shape[1]


def onehot(slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:
    """`[T, S]`: 1 at each token's slot - 1; all zeros for slot 0 (no adapter)."""
    return jax.nn.one_hot(slots - 1, num_slots, dtype=dtype)


def apply(lora: LoRALayer | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`y` (projection `name`'s output for `x`) plus each token's adapter update."""
    if lora is None:
        return y
    a, b = lora.weights[name]
    return y + delta(x, lora.onehot, a.astype(x.dtype), b.astype(x.dtype))


def delta(x: jax.Array, onehot: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`(x @ A[slot]) @ B[slot]` per token: x `[T, in]`, onehot `[T, S]`, a `[S, in, R]`,
    b `[S, R, out]` -> `[T, out]` (exact zeros for tokens whose onehot row is 0)."""
    xa = jnp.einsum("ti,sir->tsr", x, a) * onehot[:, :, None]
    return jnp.einsum("tsr,sro->to", xa, b)
