"""Tensor parallelism: how params and the KV pool lie on a 1-D mesh of devices (Megatron).

Column-parallel q/k/v and gate/up (each device computes its own heads and its
slice of the MLP), row-parallel o and down (XLA all-reduces their partial sums),
vocabulary-parallel embedding and LM head (each device holds 1/N of the rows).
Norms and the output biases of row-parallel layers are small and replicated.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import LoadedModel, ModelConfig

AXIS = "tp"
_COLUMN = ("q", "k", "v", "gate", "up")  # [L, in, out]: split `out`
_ROW = ("o", "down")  # [L, in, out]: split `in`
_KV = ("k", "v", "k_bias", "v_bias")  # repeated when devices outnumber KV heads


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
    if problems:
        raise ValueError(
            f"tensor_parallel={n} cannot split this {c.architecture} model: " + "; ".join(problems)
        )


def sharded_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config the model runs with on `n` devices (KV heads repeated up to `n`)."""
    check(config, n)
    if n <= config.num_kv_heads:
        return config
    return dataclasses.replace(config, num_kv_heads=n)


def spec(key: str, layer: bool) -> PartitionSpec:
    """Where param `key` (a per-layer one when `layer`, with its leading [L] axis) lies."""
    lead = (None,) if layer else ()
    if key in _COLUMN:
        return PartitionSpec(*lead, None, AXIS)
    if key in _ROW:
        return PartitionSpec(*lead, AXIS, None)
    if key in ("q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"):
        return PartitionSpec(*lead, AXIS)
    if key == "embed":
        return PartitionSpec(AXIS, None)
    if key == "lm_head":
        return PartitionSpec(None, AXIS)
    return PartitionSpec()  # norms, o/down biases: replicated


def pool_spec() -> PartitionSpec:
    """KV pool values `[L, blocks, kv_heads, block_size, head_dim]` and scales `[L, blocks,
    kv_heads, block_size]`: each device its KV heads."""
    return PartitionSpec(None, None, AXIS)


def repeat_kv(key: str, value: Any, config: ModelConfig, n: int) -> Any:
    """Repeat each KV head of a k/v weight or bias `n // num_kv_heads` times (in place of
    the head) when devices outnumber KV heads; anything else as it is."""
    if key not in _KV or n <= config.num_kv_heads:
        return value
    xp = np if isinstance(value, np.ndarray) else jax.numpy
    heads = value.reshape(*value.shape[:-1], config.num_kv_heads, config.head_dim)
    repeated = xp.repeat(heads, n // config.num_kv_heads, axis=-2)
    return repeated.reshape(*value.shape[:-1], n * config.head_dim)


def global_shape(key: str, shape: tuple[int, ...], config: ModelConfig, n: int) -> tuple:
    """The shape param `key` (checkpoint `shape`) has on `n` devices (KV heads repeated)."""
    if key not in _KV or n <= config.num_kv_heads:
        return shape
    return (*shape[:-1], shape[-1] // config.num_kv_heads * n)


def local_box(
    key: str, layer: bool, shape: tuple[int, ...], mesh: Mesh | None
) -> tuple[slice, ...] | None:
    """With several processes: the part of param `key` (its global `shape`) that this
    process's devices hold, the box around their shards: all that the process keeps of it
    in host memory while loading. None in one process, which places whole params."""
    if mesh is None or jax.process_count() == 1:
        return None
    where = NamedSharding(mesh, spec(key, layer))
    indices = where.addressable_devices_indices_map(shape).values()
    shards = [_bounds(index, shape) for index in indices]
    return tuple(
        slice(min(s[d][0] for s in shards), max(s[d][1] for s in shards)) for d in range(len(shape))
    )


def _bounds(index: Any, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) on each axis of a device's shard `index` (slices, maybe fewer than
    the axes, or None for all) of an array of `shape`."""
    index = index or ()
    return [index[d].indices(n)[:2] if d < len(index) else (0, n) for d, n in enumerate(shape)]


def placer(config: ModelConfig, mesh: Mesh | None) -> Any:
    """`put(key, array, layer) -> jax.Array`: one param onto the devices (its shard on
    each, KV heads repeated as needed); plain `device_put` without a mesh. With several
    processes, `put(key, array, layer, box, shape)`: `array` is this process's `box`
    (`local_box`) of the param of global `shape`, KV heads repeated already, and each of
    its devices takes its shard from it."""

    def put(
        key: str,
        value: Any,
        layer: bool,
        box: tuple[slice, ...] | None = None,
        shape: tuple[int, ...] = (),
    ) -> jax.Array:
        if mesh is None:
            return jax.device_put(value)
        where = NamedSharding(mesh, spec(key, layer))
        if box is None:
            return jax.device_put(repeat_kv(key, value, config, mesh.size), where)

        def shard(index: Any) -> np.ndarray:
            cut = [
                slice(lo - b.start, hi - b.start)
                for (lo, hi), b in zip(_bounds(index, shape), box, strict=True)
            ]
            return np.asarray(value[tuple(cut)])

        return jax.make_array_from_callback(shape, where, shard)

    return put


def shard_model(model: LoadedModel, mesh: Mesh) -> LoadedModel:
    """`model` laid out over `mesh`: as it is when `models.load(..., tensor_parallel=)` put
    it there already, else resharded from where it lies (which then held it whole)."""
    config = sharded_config(model.config, mesh.size)  # fails before any transfer
    params = model.params
    flat = [(k, v, False) for k, v in params.items() if k != "layers"]
    flat += [(k, v, True) for k, v in params["layers"].items()]
    if all(
        isinstance(getattr(v, "sharding", None), NamedSharding)
        and v.sharding.mesh == mesh
        and v.sharding.spec == spec(k, layer)
        for k, v, layer in flat
    ):
        return model
    put = placer(model.config, mesh)
    out: dict[str, Any] = {k: put(k, v, False) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: put(k, v, True) for k, v in params["layers"].items()}
    return dataclasses.replace(model, config=config, params=out)
