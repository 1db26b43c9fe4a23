"""Host batch building into static shape buckets, and the jitted, pool-donating step.

XLA compiles one program per input shape, so every batch is padded to a bucket:
rows to a power of two (or max_batch_size), page-table width to a power of two
of the longest row's blocks (decode cost follows the compiled width, not the
stored tokens), prompt chunks to a power of two. Padding rows write to the
null block and are masked out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jpaged.cache import kv_pool
from jpaged.cache.kv_pool import KVPool
from jpaged.cache.protocol import CachePoolProtocol, StepMetadata
from jpaged.config import EngineConfig
from jpaged.engine.sampling import SamplingArrays, sample
from models.common import forward
from models.config import LoadedModel, ModelConfig

MIN_CHUNK = 16

_compilations = 0
_lock = threading.Lock()


def _count_compile(event: str, duration_secs: float, **_: str | int) -> None:
    global _compilations
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _step(
    params: dict,
    kv: KVPool,
    tokens: jax.Array,  # int32 [B, Lq]
    meta: StepMetadata,
    samp: SamplingArrays,
    *,
    config: ModelConfig,
    impl: str,
    greedy: bool,
) -> tuple[tuple[jax.Array, ...], KVPool]:
    logits, kv = forward(params, kv, tokens, meta, config=config, attention_impl=impl)
    return sample(logits, samp, greedy=greedy), kv


step_fn = jax.jit(_step, static_argnames=("config", "impl", "greedy"), donate_argnums=1)


def _pow2_ladder(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` below `limit`, then `limit` itself."""
    ladder = []
    b = start
    while b < limit:
        ladder.append(b)
        b *= 2
    return [*ladder, limit]


def _below(ladder: Sequence[int], b: int) -> int:
    i = ladder.index(b)
    return ladder[i - 1] if i else 0


def _bucket(n: int, ladder: Sequence[int]) -> int:
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # f32 [n]
    top_ids: np.ndarray  # int32 [n, K]
    top_logprobs: np.ndarray  # f32 [n, K]


@dataclasses.dataclass
class Row:
    seq_id: int
    token_ids: Sequence[int]  # the new tokens this row writes
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0


def use_compilation_cache(path: str) -> None:
    """Persist compiled programs on disk, unless the user configured JAX's cache already."""
    if getattr(jax.config, "jax_compilation_cache_dir", None):
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    # our step programs compile in about a second on CPU: cache them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


class Runner:
    def __init__(self, model: LoadedModel, config: EngineConfig, cache: CachePoolProtocol) -> None:
        if config.compilation_cache_dir:
            use_compilation_cache(config.compilation_cache_dir)
        mc = model.config
        self.model_config = mc
        self.params = model.params
        self.cache = cache
        self._new_pool = functools.partial(
            kv_pool.create,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            num_blocks=cache.num_blocks,
            dtype=config.dtype,
        )
        self.kv = self._new_pool()
        impl = config.attention_impl
        if impl == "auto":
            impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        self.impl = impl
        self.batch_ladder = _pow2_ladder(config.max_batch_size)
        # a table never needs more columns than the pool has blocks (the kernel rejects it)
        self.width_ladder = _pow2_ladder(min(config.blocks_per_seq, cache.num_blocks))
        max_chunk = min(config.max_num_batched_tokens, config.max_seq_len)
        self.chunk_ladder = _pow2_ladder(max(max_chunk, MIN_CHUNK), MIN_CHUNK)
        self.token_budget = config.max_num_batched_tokens
        self.block_size = config.block_size
        self.compilations = 0
        self.device_s = 0.0  # dispatch + device compute + bringing the results back

    def reset_pool(self) -> None:
        """A fresh zero pool, after a failed step consumed the donated one."""
        self.kv = self._new_pool()

    @property
    def pool_lost(self) -> bool:
        return self.kv.k.is_deleted()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        # pad to a power of two with 0 -> 0 (the null block onto itself) to bound compilations
        n = _bucket(len(copies), _pow2_ladder(max(len(copies), 1)))
        pairs = np.zeros((n, 2), np.int32)
        pairs[: len(copies)] = copies
        self.kv = self._counted(kv_pool.copy_blocks_jit, self.kv, pairs[:, 0], pairs[:, 1])

    def run(self, rows: Sequence[Row], *, greedy: bool) -> StepResult:
        """One jitted step over `rows` (all decode rows, or all prefill chunks)."""
        n = len(rows)
        b = _bucket(n, self.batch_ladder)
        longest = max(len(r.token_ids) for r in rows)
        lq = 1 if longest == 1 else _bucket(longest, self.chunk_ladder)
        width = _bucket(
            max(self.cache.num_blocks_needed(r.seq_id) for r in rows), self.width_ladder
        )
        tokens = np.zeros((b, lq), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.token_ids)] = r.token_ids
        meta = self.cache.metadata(
            [r.seq_id for r in rows], [len(r.token_ids) for r in rows], b, width, lq
        )
        samp = SamplingArrays(
            temperature=np.array([r.temperature for r in rows] + [0.0] * (b - n), np.float32),
            top_k=np.array([r.top_k for r in rows] + [0] * (b - n), np.int32),
            top_p=np.array([r.top_p for r in rows] + [1.0] * (b - n), np.float32),
            seed=np.array([r.seed for r in rows] + [0] * (b - n), np.uint32),
            step=np.array([r.step for r in rows] + [0] * (b - n), np.int32),
        )
        start = time.perf_counter()
        host = jax.device_get(self._execute(tokens, meta, samp, greedy=greedy))
        self.device_s += time.perf_counter() - start
        return StepResult(*(np.asarray(a)[:n] for a in host))

    def _execute(
        self, tokens: np.ndarray, meta: StepMetadata, samp: SamplingArrays, *, greedy: bool
    ) -> tuple[jax.Array, ...]:
        out, self.kv = self._counted(
            step_fn,
            self.params,
            self.kv,
            tokens,
            meta,
            samp,
            config=self.model_config,
            impl=self.impl,
            greedy=greedy,
        )
        return out

    def _counted(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        before = _compilations
        result = fn(*args, **kwargs)
        self.compilations += _compilations - before
        return result

    def warmup_shapes(self) -> list[tuple[int, int, int, bool]]:
        """Every (rows, tokens per row, width, greedy) bucket serving can produce.

        Prefill chunks always take the sampling variant: one program per shape.
        """
        shapes = [
            (b, 1, w, g)
            for b, w, g in itertools.product(self.batch_ladder, self.width_ladder, (True, False))
        ]
        for b, lq, w in itertools.product(self.batch_ladder, self.chunk_ladder, self.width_ladder):
            # the smallest batch landing in these buckets: one more than the bucket below
            rows, longest = _below(self.batch_ladder, b) + 1, _below(self.chunk_ladder, lq) + 1
            fits_budget = longest + rows - 1 <= self.token_budget
            if fits_budget and w * self.block_size >= longest:
                shapes.append((b, lq, w, False))
        return shapes

    def warmup(self) -> None:
        """Compile every bucket now, so that serving compiles nothing."""
        shapes = self.warmup_shapes()
        start = time.perf_counter()
        for i, (b, lq, w, greedy) in enumerate(shapes):
            meta = StepMetadata(
                slot_mapping=np.zeros((b, lq), np.int32),
                block_tables=np.zeros((b, w), np.int32),
                context_lens=np.zeros(b, np.int32),
                query_lens=np.zeros(b, np.int32),
            )
            samp = SamplingArrays(
                temperature=np.zeros(b, np.float32),
                top_k=np.zeros(b, np.int32),
                top_p=np.ones(b, np.float32),
                seed=np.zeros(b, np.uint32),
                step=np.zeros(b, np.int32),
            )
            jax.block_until_ready(
                self._execute(np.zeros((b, lq), np.int32), meta, samp, greedy=greedy)
            )
            print(
                f"\rjpaged: warming up {i + 1}/{len(shapes)} shapes "
                f"({time.perf_counter() - start:.0f} s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
        print(file=sys.stderr)
        self.copy_blocks([(0, 0)])
