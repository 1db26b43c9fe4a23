"""Sizing the KV cache: the model's KV groups, the bytes of a block, a device's memory, how
many blocks `memory_fraction` of it holds, and the host cache (paged or contiguous) over
them, or its size alone. The device arrays themselves (the pool) are `jpaged.cache.kv_pool`'s."""

from __future__ import annotations

import os

import jax
from flax import nnx

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.groups import KVGroups
from jpaged.cache.kv_pool import block_bytes
from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import CacheProtocol
from jpaged.config import EngineConfig
from jpaged.engine.batch import CacheSize
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel


def kv_groups(config: EngineConfig, model: ModelConfig) -> KVGroups:
    """The model's KV groups: sliding layers apart where the paged backend may free their
    passed blocks, one group of every layer otherwise."""
    hybrid = config.backend == "paged" and config.hybrid_kv_cache
    return KVGroups.of(model.num_layers, model.sliding_layers, model.sliding_window, hybrid=hybrid)


def kv_block_bytes(config: EngineConfig, model: ModelConfig, groups: KVGroups) -> int:
    """The bytes of one block: K, V (and scales) of a KV group's layers."""
    return block_bytes(
        groups.size,
        model.num_kv_heads,
        config.block_size,
        model.head_dim,
        config.dtype,
        config.kv_cache_dtype,
    )


def make_cache(
    config: EngineConfig, usable_blocks: int, groups: KVGroups | None = None
) -> CacheProtocol:
    if config.backend == "paged":
        return PagedKVCache(
            num_blocks=usable_blocks + 1,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            groups=groups,
        )
    return ContiguousKVCache(
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        block_size=config.block_size,
    )


def cache_size(config: EngineConfig, usable_blocks: int, groups: KVGroups) -> CacheSize:
    """The device pool `make_cache(config, usable_blocks, groups)` addresses, for runners
    without a host cache (distributed workers)."""
    if config.backend == "paged":
        return CacheSize(usable_blocks + 1, groups.num_groups)
    blocks = ContiguousKVCache.total_blocks(
        config.max_batch_size, config.max_seq_len, config.block_size
    )
    return CacheSize(blocks, ContiguousKVCache.num_groups)


def weights_on_device(model: LoadedModel) -> tuple[jax.Device, int]:
    """The first device holding the model's weights, and the bytes of them it holds."""
    leaves = jax.tree.leaves(nnx.state(model.model))
    device = leaves[0].addressable_shards[0].device
    weights = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    return device, weights


def device_memory(device: jax.Device, weights: int) -> tuple[int, int]:
    """A device's memory and the bytes in use on it: JAX's allocator statistics (a GPU), or
    on a CPU, which has none, the host's memory and the `weights` on the device."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats["bytes_in_use"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), weights


def blocks_in_budget(
    total: int, fraction: float, in_use: int, activations: int, block_bytes: int
) -> tuple[int, str]:
    """The usable KV blocks (the null block apart) of `block_bytes` that `fraction` of a
    device's `total` bytes holds beside `in_use` (the weights) and a step's `activations`,
    and that arithmetic in words."""
    gib = 1 << 30
    budget = int(total * fraction) - in_use - activations
    usable = max(budget // block_bytes - 1, 0)
    arithmetic = (
        f"KV memory a device: memory_fraction={fraction} x {total / gib:.2f} GiB - "
        f"{in_use / gib:.2f} GiB in use (weights) - {activations / gib:.2f} GiB a step's "
        f"activations = {budget / gib:.2f} GiB: {usable + 1} blocks of {block_bytes:,} bytes "
        "(one the null block)"
    )
    if usable < 1:
        raise ValueError(
            f"EngineConfig.memory_fraction={fraction} leaves no KV block: {arithmetic}"
        )
    return usable, arithmetic
