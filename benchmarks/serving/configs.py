"""The configurations a serving benchmark compares: paged and contiguous at the same KV bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jpaged.dtypes import concrete_dtype


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    label: str
    backend: str
    max_batch_size: int
    max_seq_len: int
    block_size: int
    num_blocks: int | None  # paged only: usable blocks, matched to the contiguous bytes
    dtype: str
    max_num_batched_tokens: int
    tensor_parallel: int = 1  # devices the model is split over
    data_parallel: int = 1  # replicas of the model, each with the pool sized here
    kv_cache_dtype: str = "auto"
    kv_memory_bytes: int | None = None  # paged only, instead of num_blocks
    hybrid_kv_cache: bool = True  # sliding-window layers keep only their window (paged)
    speculative: dict | None = None  # EngineConfig.speculative (n-gram drafts)
    # (adapters, rank): requests spread round-robin over that many random LoRA adapters
    lora: tuple[int, int] | None = None

    def engine_config(self) -> Any:
        from jpaged.config import EngineConfig

        return EngineConfig(
            backend=self.backend,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            max_num_batched_tokens=self.max_num_batched_tokens,
            tensor_parallel=self.tensor_parallel,
            data_parallel=self.data_parallel,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_memory_bytes=self.kv_memory_bytes,
            hybrid_kv_cache=self.hybrid_kv_cache,
            speculative=self.speculative,
            lora=None
            if self.lora is None
            else {"max_loras": self.lora[0], "max_lora_rank": self.lora[1]},
            # a burst must queue whole: the queue limit is not what is measured
            max_waiting_requests=1 << 16,
        )

    def server_flags(self) -> list[str]:
        flags = [
            "--backend",
            self.backend,
            "--max-batch-size",
            str(self.max_batch_size),
            "--max-seq-len",
            str(self.max_seq_len),
            "--block-size",
            str(self.block_size),
            "--dtype",
            self.dtype,
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-waiting",
            str(1 << 16),
            "--tensor-parallel",
            str(self.tensor_parallel),
            "--data-parallel",
            str(self.data_parallel),
            "--kv-cache-dtype",
            self.kv_cache_dtype,
        ]
        if self.num_blocks is not None:
            flags += ["--num-blocks", str(self.num_blocks)]
        if self.kv_memory_bytes is not None:
            flags += ["--kv-memory-bytes", str(self.kv_memory_bytes)]
        if not self.hybrid_kv_cache:
            flags.append("--no-hybrid-kv-cache")
        if self.speculative is not None:
            s = self.speculative
            flags += ["--speculative-ngram", str(s["num_speculative_tokens"])]
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in s:
                    flags += [f"--{key.replace('_', '-')}", str(s[key])]
        return flags


def matched_configs(
    backend: str,
    *,
    contiguous_batch: int = 8,
    paged_batches: tuple[int, ...] = (24, 48),
    max_seq_len: int = 4096,
    block_size: int = 16,
    dtype: str = "auto",
    max_num_batched_tokens: int = 512,
    tensor_parallel: int = 1,
    data_parallel: int = 1,
) -> list[BenchConfig]:
    """Contiguous `contiguous_batch x max_seq_len` and paged pools of the same bytes (in
    all: with `tensor_parallel` N each device holds 1/N of them; with `data_parallel` M,
    each of the M replicas holds such a pool)."""
    dtype = concrete_dtype(dtype)  # the configs, their JSON and server flags name it
    if (contiguous_batch * max_seq_len) % block_size:
        raise ValueError("contiguous_batch * max_seq_len must be a multiple of block_size")
    blocks_per_seq = -(-max_seq_len // block_size)
    num_blocks = contiguous_batch * blocks_per_seq  # the contiguous pool, null block aside
    common: dict[str, Any] = dict(
        max_seq_len=max_seq_len,
        block_size=block_size,
        dtype=dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel=tensor_parallel,
        data_parallel=data_parallel,
    )
    split = f" tp{tensor_parallel}" if tensor_parallel > 1 else ""
    split += f" dp{data_parallel}" if data_parallel > 1 else ""
    configs = []
    if backend in ("contiguous", "both"):
        configs.append(
            BenchConfig(
                f"contiguous b{contiguous_batch}{split}",
                "contiguous",
                contiguous_batch,
                num_blocks=None,
                **common,
            )
        )
    if backend in ("paged", "both"):
        for b in paged_batches:
            configs.append(
                BenchConfig(f"paged b{b}{split}", "paged", b, num_blocks=num_blocks, **common)
            )
    return configs


def kv_variants(
    configs: list[BenchConfig],
    kv_dtypes: tuple[str, ...],
    shape: tuple[int, int, int],
    hybrid: tuple[bool, ...] = (True,),
) -> list[BenchConfig]:
    """Each paged configuration per KV dtype (`auto` first) and per `hybrid` setting (KV
    groups or every layer whole: labelled "whole"), its pool sized in bytes, those of the
    model-dtype whole-context pool of its `num_blocks`, for a model of `shape` (layers, KV
    heads, head_dim): a block's size depends on both, the memory must not."""
    from jpaged.cache.kv_pool import block_bytes

    out = []
    for cfg in configs:
        if cfg.backend != "paged" or cfg.num_blocks is None:
            out.append(cfg)
            continue
        pool = cfg.num_blocks * block_bytes(*shape[:2], cfg.block_size, shape[2], cfg.dtype)
        for kv in ("auto", *(k for k in kv_dtypes if k != "auto")):
            for h in hybrid:
                label = cfg.label + ("" if kv == "auto" else f" {kv}") + ("" if h else " whole")
                out.append(
                    dataclasses.replace(
                        cfg,
                        label=label,
                        kv_cache_dtype=kv,
                        num_blocks=None,
                        kv_memory_bytes=pool,
                        hybrid_kv_cache=h,
                    )
                )
    return out


def speculative_variants(configs: list[BenchConfig], spec: dict | None) -> list[BenchConfig]:
    """Each configuration without, then with, speculative decoding `spec` (labelled
    "ngramK"); unchanged without one."""
    if spec is None:
        return configs
    tag = f" ngram{spec['num_speculative_tokens']}"
    return [
        c
        for cfg in configs
        for c in (cfg, dataclasses.replace(cfg, label=cfg.label + tag, speculative=spec))
    ]


def lora_variants(configs: list[BenchConfig], adapters: int, rank: int) -> list[BenchConfig]:
    """Each configuration without, then with, `adapters` LoRA adapters of `rank` resident
    (labelled "loraNxrR"); unchanged for 0 adapters."""
    if not adapters:
        return configs
    tag = f" lora{adapters}xr{rank}"
    return [
        c
        for cfg in configs
        for c in (cfg, dataclasses.replace(cfg, label=cfg.label + tag, lora=(adapters, rank)))
    ]


def model_shape(path: Path) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a checkpoint directory."""
    from jpaged.models.loader import family_for

    hf = json.loads((path / "config.json").read_text())
    c = family_for(hf, str(path)).model_config(hf)
    return c.num_layers, c.num_kv_heads, c.head_dim


def kv_block_bytes(path: Path, cfg: BenchConfig) -> int:
    """Bytes of one KV block (all layers, K and V) of a checkpoint, as the engine sizes it."""
    from jpaged.cache.kv_pool import block_bytes

    layers, heads, head_dim = model_shape(path)
    return block_bytes(layers, heads, cfg.block_size, head_dim, cfg.dtype, cfg.kv_cache_dtype)
