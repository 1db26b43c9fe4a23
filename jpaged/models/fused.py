"""Projections that read one input, held as one matrix: q, k, v as `attn.qkv`, gate and up
as `mlp.gate_up`.

A step then runs one GEMM where it ran three (two), and XLA never concatenates weights
itself (its dot merger did, on GPUs: a copy of every merged weight every step). The
checkpoint's names stay the logical ones (`attn.q.kernel`); the loader writes each into
its columns of the fused matrix. Under tensor parallelism each device holds its share of
every part in turn (`[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`), so the column split of the fused
matrix is the column split of each part and the output splits back without communication.
A model whose parts are held in different forms (a GGUF file's q in Q4_K and v in Q6_K)
keeps them apart (`ModelConfig.fused_projections` off): one form would widen the codes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models import hostcopy
from jpaged.models.config import ModelConfig

LAYERS = "layers."
# fused module -> its parts, in column order; the parts whose heads are KV heads
GROUPS = {"attn.qkv": ("attn.q", "attn.k", "attn.v"), "mlp.gate_up": ("mlp.gate", "mlp.up")}
KV_PARTS = {"attn.k", "attn.v"}


def widths(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each fused module's parts' output widths (global, as `c` says)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"attn.qkv": (q, kv, kv), "mlp.gate_up": (c.intermediate_size,) * 2}


def unfused(c: ModelConfig) -> ModelConfig:
    """`c` with its parts apart: the checkpoint's (logical) weights."""
    return dataclasses.replace(c, fused_projections=False)


def target(path: str) -> tuple[str, str, int] | None:
    """(fused state path, group, part index) of a logical state path
    (`layers.attn.k.kernel.codes` -> `layers.attn.qkv.kernel.codes`, "attn.qkv", 1);
    None for a weight that is no part."""
    for group, parts in GROUPS.items():
        for i, part in enumerate(parts):
            if path.startswith(f"{LAYERS}{part}."):
                return f"{LAYERS}{group}.{path[len(LAYERS) + len(part) + 1 :]}", group, i
    return None


def group_of(path: str) -> str | None:
    """The group of a fused state path (`layers.attn.qkv.kernel`), None for any other."""
    return next((g for g in GROUPS if path.startswith(f"{LAYERS}{g}.")), None)


def agree(layout: Mapping[str, Any]) -> bool:
    """Whether every group's parts are held alike in `layout` (logical path -> form):
    all float, or all in one form."""
    return all(
        len({layout.get(f"{LAYERS}{p}.kernel") for p in parts}) == 1 for parts in GROUPS.values()
    )


def layout(logical: Mapping[str, Any], c: ModelConfig) -> dict[str, Any]:
    """`logical`'s forms keyed by the state paths of `c`'s module."""
    if not c.fused_projections:
        return dict(logical)
    out = {}
    for path, form in logical.items():
        hit = target(path)
        out[path if hit is None else hit[0]] = form
    return out


def fuse(parts: Sequence[Any], devices: int) -> Any:
    """Parts `[..., w_i]` (NumPy or JAX) side by side along the last axis, each of
    `devices` devices' shares of all of them in turn."""
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
    lead = parts[0].shape[:-1]
    cut = [p.reshape(*lead, devices, -1) for p in parts]
    return xp.concatenate(cut, axis=-1).reshape(*lead, -1)


def ways(value: jax.Array) -> int:
    """How many devices' shares a fused matrix on the devices holds (`fuse`'s `devices`):
    it is split along its columns over every device it lies on."""
    return len(value.sharding.device_set)


def split(y: Any, part_widths: Sequence[int], devices: int) -> list[Any]:
    """`fuse`'s inverse: the parts of `y` `[..., sum(part_widths)]`."""
    lead = y.shape[:-1]
    y = y.reshape(*lead, devices, -1)
    bounds = np.cumsum([w // devices for w in part_widths])
    starts = [0, *bounds[:-1]]
    return [y[..., a:b].reshape(*lead, -1) for a, b in zip(starts, bounds, strict=True)]


def write(
    dest: np.ndarray,
    value: np.ndarray,
    part_widths: Sequence[int],
    index: int,
    devices: int,
    first: int = 0,
) -> None:
    """Write part `index` (`value` `[..., w]`, whole) into its columns of `dest`, the fused
    matrix's columns of devices `first` onward (all of them, or one process's box)."""
    share = [w // devices for w in part_widths]
    start = sum(share[:index])
    held = dest.shape[-1] // sum(share)
    view = dest.reshape(*dest.shape[:-1], held, sum(share))
    assert np.shares_memory(view, dest), "dest must be contiguous: a reshape copied it"
    cut = value.reshape(*value.shape[:-1], devices, share[index])[..., first : first + held, :]
    hostcopy.assign(view[..., start : start + share[index]], cut)


def apart(pure: dict, c: ModelConfig, devices: int = 1) -> dict:
    """A module's pure state dict (`nnx.to_pure_dict`) with each fused matrix (kernel, bias)
    back as its parts, the checkpoint's layout; `c` and `devices`: what the module runs
    with. The dict is changed in place and returned."""
    if not c.fused_projections:
        return pure
    layers = pure["layers"]
    for group, parts in GROUPS.items():
        block, name = group.split(".")
        for leaf, value in layers[block].pop(name).items():
            for part, piece in zip(parts, split(value, widths(c)[group], devices), strict=True):
                layers[block].setdefault(part.split(".")[1], {})[leaf] = piece
    return pure
