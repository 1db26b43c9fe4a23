"""Tensor parallelism: a 1-D mesh of devices, and what Flax does not do for it.

Where each weight lies is the module's own sharding metadata (`out_sharding` on its
`nnx.Param`s, `models.common`, Megatron's layout): column-parallel q/k/v and gate/up
(fused: each device's share of each part side by side, `models.fused`), row-parallel o
and down (XLA all-reduces their partial sums), vocabulary-parallel
embedding and LM head; norms and row-parallel biases replicated. This module holds the
rest: the mesh, the checks, the KV pool's layout, KV heads repeated, the per-process
shard boxes of a load over several processes (moving a loaded model onto a mesh:
`models.loader.shard_model`).

KV heads are split over the devices when N divides them. With more devices than
KV heads (N a multiple of them) each device keeps a copy of the one KV head its
query heads read, as vLLM does: the k/v weights are repeated to N heads as they
load, and the model runs with `num_kv_heads = N`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jpaged.models.config import ModelConfig

AXIS = "tp"


def make_mesh(tensor_parallel: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The first `tensor_parallel` of `devices` (default: `jax.devices()`), as a 1-D mesh."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(tensor_parallel, int) or not 1 <= tensor_parallel <= len(devices):
        raise ValueError(
            f"tensor_parallel must be an int in [1, {len(devices)}] (the {jax.default_backend()} "
            f"devices JAX sees), got {tensor_parallel!r}"
        )
    return Mesh(np.array(devices[:tensor_parallel]), (AXIS,))


def check(config: ModelConfig, n: int) -> None:
    """ValueError unless the model splits over `n` devices."""
    c = config
    problems = [
        f"{what} ({size}) is not divisible by tensor_parallel={n}"
        for what, size in (
            ("num_heads", c.num_heads),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        )
        if size % n
    ]
    if c.num_kv_heads % n and n % c.num_kv_heads:
        problems.append(
            f"num_kv_heads ({c.num_kv_heads}) neither divides nor is divisible by "
            f"tensor_parallel={n}"
        )
    problems += _expert_problems(c, n)
    if problems:
        raise ValueError(
            f"tensor_parallel={n} cannot split this {c.architecture} model: " + "; ".join(problems)
        )


def _expert_problems(c: ModelConfig, n: int) -> list[str]:
    """Why `c`'s experts do not split over `n` devices (empty: they do)."""
    m = c.moe
    if m is None or n == 1:
        return []
    if m.expert_parallel:
        size, what = m.num_experts, "num_experts (expert parallelism)"
    else:
        size, what = m.intermediate_size, "moe_intermediate_size"
    return [f"{what} ({size}) is not divisible by tensor_parallel={n}"] if size % n else []


def sharded_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config the model runs with on `n` devices (KV heads repeated up to `n`)."""
    check(config, n)
    if n <= config.num_kv_heads:
        return config
    return dataclasses.replace(config, num_kv_heads=n)


def pool_spec() -> PartitionSpec:
    """KV pool values `[L, blocks, kv_heads, block_size, head_dim]` and scales `[L, blocks,
    kv_heads, block_size]`: each device its KV heads."""
    return PartitionSpec(None, None, AXIS)


def repeat_kv(w: nnx.Variable, value: Any, config: ModelConfig, n: int) -> Any:
    """Repeat each KV head of a k/v weight or bias (`kv_heads` metadata) `n // num_kv_heads`
    times (in place of the head) when devices outnumber KV heads; anything else as it is."""
    if not w.get_metadata().get("kv_heads"):
        return value
    return repeat_heads(value, config, n)


def repeat_heads(value: Any, config: ModelConfig, n: int) -> Any:
    """KV heads of `value` `[..., num_kv_heads * head_dim]` repeated up to `n`."""
    if n <= config.num_kv_heads:
        return value
    xp = np if isinstance(value, np.ndarray) else jax.numpy
    heads = value.reshape(*value.shape[:-1], config.num_kv_heads, config.head_dim)
    repeated = xp.repeat(heads, n // config.num_kv_heads, axis=-2)
    return repeated.reshape(*value.shape[:-1], n * config.head_dim)


def local_box(w: nnx.Variable, mesh: Mesh | None) -> tuple[slice, ...] | None:
    """With several processes: the part of weight `w` (abstract, its global shape) that this
    process's devices hold, the box around their shards: all that the process keeps of it
    in host memory while loading. None in one process, which places whole weights."""
    if mesh is None or jax.process_count() == 1:
        return None
    where = NamedSharding(mesh, spec_of(w))
    shards = [
        _bounds(index, w.shape) for index in where.addressable_devices_indices_map(w.shape).values()
    ]
    return tuple(
        slice(min(s[d][0] for s in shards), max(s[d][1] for s in shards))
        for d in range(len(w.shape))
    )


def _bounds(index: Any, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) on each axis of a device's shard `index` (slices, maybe fewer than
    the axes, or None for all) of an array of `shape`."""
    index = index or ()
    return [index[d].indices(n)[:2] if d < len(index) else (0, n) for d, n in enumerate(shape)]


def spec_of(w: nnx.Variable) -> PartitionSpec:
    """Where weight `w` lies on the mesh: its `out_sharding` metadata (none: replicated)."""
    return PartitionSpec(*w.get_metadata().get("out_sharding", ()))


def place(
    w: nnx.Variable, value: Any, mesh: Mesh | None, box: tuple[slice, ...] | None = None
) -> jax.Array:
    """`value` onto the devices as weight `w` (abstract) lies: whole, or its shard on each
    device. With several processes `value` is this process's `box` (`local_box`) of the
    weight, and each of its devices takes its shard from it."""
    if mesh is None:
        return jax.device_put(value)
    where = NamedSharding(mesh, spec_of(w))
    if box is None:
        return jax.device_put(value, where)

    def shard(index: Any) -> np.ndarray:
        cut = [
            slice(lo - b.start, hi - b.start)
            for (lo, hi), b in zip(_bounds(index, w.shape), box, strict=True)
        ]
        return np.asarray(value[tuple(cut)])

    return jax.make_array_from_callback(w.shape, where, shard)
