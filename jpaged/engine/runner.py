"""Host batch building into static shape buckets, and the jitted, pool-donating step.

XLA compiles one program per input shape, so every call is padded to a bucket:
- decode: one row per sequence, rows padded to the batch ladder (1, 2, 4, then
  multiples of 8, then half octaves, then max_batch_size), one token per row. On
  the XLA path the rows' pages are one list (`ragged_attention`) padded to a
  half-octave bucket of the pages they hold; for Pallas, page tables a power of
  two of the longest row's blocks wide.
- prefill: every prompt chunk is cut into tiles of PREFILL_TILE tokens and each
  tile is a row of its own that carries its sequence's page table. Padding is at
  most a tile per chunk (the scheduler cuts chunks on tile boundaries), instead of
  rows x the longest chunk, and the shape no longer depends on how many chunks
  the step holds or how long the longest is.
Padding rows and tokens write to the null block and are masked out.
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
from jpaged.kernels.ragged_attention import page_list
from models.common import forward
from models.config import LoadedModel, ModelConfig

# Tokens per prefill row. Smaller tiles pad less (half a tile per chunk on average) but
# gather their sequence's pages once per tile; at 32 a full 512-token step is 16 rows.
PREFILL_TILE = 32
MIN_PAGES = 16  # smallest page-list bucket of a ragged decode step
MIN_PREFILL_WIDTH = 8  # smallest page-table width of a prefill step, in blocks

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
    *,
    config: ModelConfig,
    impl: str,
) -> tuple[jax.Array, KVPool]:
    return forward(params, kv, tokens, meta, config=config, attention_impl=impl)


step_fn = jax.jit(_step, static_argnames=("config", "impl"), donate_argnums=1)
# A program of its own, per row bucket only: compiled into every step program, the sampler
# doubled each one's memory mappings (~140 of ~250), and an XLA:CPU process holds only
# vm.max_map_count (65530) of them in all.
sample_fn = jax.jit(sample)


def _pow2_ladder(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` below `limit`, then `limit` itself."""
    ladder = []
    b = start
    while b < limit:
        ladder.append(b)
        b *= 2
    return [*ladder, limit]


def _half_octave_ladder(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... below `limit`, then `limit`: at most a third padding."""
    ladder = sorted({b for p in _pow2_ladder(limit) for b in (p, p * 3 // 2) if 0 < b < limit})
    return [*ladder, limit]


def _batch_ladder(limit: int) -> list[int]:
    """Decode row buckets, vLLM's: 1, 2, 4, then multiples of 8 up to 64 (where a
    padded row costs the most relative to the step), then half octaves, then `limit`."""
    small = {b for b in (1, 2, 4, *range(8, 65, 8)) if b < limit}
    return sorted(small | {b for b in _half_octave_ladder(limit) if b > 64} | {limit})


def _bucket(n: int, ladder: Sequence[int]) -> int:
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A compiled bucket: `rows` x `lq` tokens, page tables `width` blocks wide, and
    for a ragged decode (XLA path) a list of `pages` pages instead of page tables."""

    rows: int
    lq: int
    width: int
    pages: int = 0


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # f32 [n]
    top_ids: np.ndarray  # int32 [n, K]
    top_logprobs: np.ndarray  # f32 [n, K]
    shape: Shape  # the bucket this call ran in (for benchmarks: real vs padded work)


@dataclasses.dataclass
class Row:
    seq_id: int
    token_ids: Sequence[int]  # the new tokens this row writes
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    logprobs: int = 0


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
        self.batch_ladder = _batch_ladder(config.max_batch_size)
        # a table never needs more columns than the pool has blocks (the kernel rejects it)
        self.width_ladder = _pow2_ladder(min(config.blocks_per_seq, cache.num_blocks))
        # chunks in one step hold at most the token budget, each at most a tile of padding
        budget = config.max_num_batched_tokens
        max_tiles = -(-budget // PREFILL_TILE) + min(config.max_batch_size, budget) - 1
        self.tile_ladder = _half_octave_ladder(max_tiles)
        # On the XLA path decode attends over a page list (`ragged_attention`), whose
        # cost follows the pages the rows hold; Pallas reads page tables.
        self.ragged = impl == "xla"
        # (fewer buckets: a few padding pages, or a wider prefill table, cost next to nothing)
        pages = _half_octave_ladder(config.max_batch_size * self.width_ladder[-1])
        self.page_ladder = [p for p in pages[:-1] if p >= MIN_PAGES] + pages[-1:]
        self.prefill_widths = [w for w in self.width_ladder if w >= MIN_PREFILL_WIDTH] or [
            self.width_ladder[-1]
        ]
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

    def run(self, rows: Sequence[Row]) -> StepResult:
        """One jitted step over `rows`: all decode rows (one token each) or all prompt chunks."""
        lens = np.array([len(r.token_ids) for r in rows])
        if lens.min() < 1:
            raise ValueError("every row needs at least one new token")
        blocks = max(self.cache.num_blocks_needed(r.seq_id) for r in rows)
        if lens.max() == 1:
            width = _bucket(blocks, self.width_ladder)
            shape = Shape(_bucket(len(rows), self.batch_ladder), 1, width)
            seq_ids = [r.seq_id for r in rows]
            meta = self.cache.metadata(seq_ids, [1] * len(rows), shape.rows, width, 1)
            if self.ragged:
                shape, meta = self._ragged(shape, meta)
            tokens = np.zeros((shape.rows, 1), np.int32)
            tokens[: len(rows), 0] = [r.token_ids[0] for r in rows]
            samp = sampling_arrays(rows, shape.rows)
            picks = np.arange(len(rows))
        else:
            width = _bucket(blocks, self.prefill_widths)
            shape, tokens, meta, owner, picks = self._tile(rows, lens, width)
            samp = sampling_arrays(rows, shape.rows, owner)
        start = time.perf_counter()
        host = jax.device_get(self._execute(tokens, meta, samp))
        self.device_s += time.perf_counter() - start
        tokens_out, logprobs, top_ids, top_logprobs = (np.asarray(a)[picks] for a in host)
        return StepResult(tokens_out, logprobs, top_ids, top_logprobs, shape)

    def _ragged(self, shape: Shape, meta: StepMetadata) -> tuple[Shape, StepMetadata]:
        """Swap a decode step's page tables for the list of its pages."""
        ctx = np.asarray(meta.context_lens)
        num_pages = _bucket(int((-(-ctx // self.block_size)).sum()), self.page_ladder)
        pages = page_list(np.asarray(meta.block_tables), ctx, self.block_size, num_pages)
        tables = np.zeros((shape.rows, 0), np.int32)
        return (
            Shape(shape.rows, 1, 0, num_pages),
            dataclasses.replace(meta, block_tables=tables, pages=pages),
        )

    def _tile(
        self, rows: Sequence[Row], lens: np.ndarray, width: int
    ) -> tuple[Shape, np.ndarray, StepMetadata, np.ndarray, np.ndarray]:
        """Cut each chunk into PREFILL_TILE-token rows. -> (shape, tokens, metadata, the
        chunk each tile belongs to, the tile holding each chunk's last token)."""
        t = PREFILL_TILE
        n = len(rows)
        tiles = -(-lens // t)
        first = np.cumsum(tiles) - tiles
        shape = Shape(_bucket(int(tiles.sum()), self.tile_ladder), t, width)
        seq_ids = [r.seq_id for r in rows]
        per_row = self.cache.metadata(seq_ids, lens.tolist(), n, width, int(tiles.max()) * t)
        chunks = np.zeros((n, int(tiles.max()) * t), np.int32)
        for i, r in enumerate(rows):
            chunks[i, : lens[i]] = r.token_ids
        owner = np.repeat(np.arange(n), tiles)
        j = np.arange(len(owner)) - first[owner]  # tile index within its chunk
        used = np.minimum(lens[owner] - j * t, t)
        ctx = np.asarray(per_row.context_lens)[owner] - lens[owner] + j * t + used

        def rows_of(a: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
            out = np.zeros((shape.rows, *tail), np.int32)
            out[: len(owner)] = a
            return out

        tokens = rows_of(chunks.reshape(n, -1, t)[owner, j], (t,))
        slots = np.asarray(per_row.slot_mapping).reshape(n, -1, t)
        meta = StepMetadata(
            slot_mapping=rows_of(slots[owner, j], (t,)),
            block_tables=rows_of(np.asarray(per_row.block_tables)[owner], (width,)),
            context_lens=rows_of(ctx, ()),
            query_lens=rows_of(used, ()),
        )
        return shape, tokens, meta, owner, first + tiles - 1

    def _execute(
        self, tokens: np.ndarray, meta: StepMetadata, samp: SamplingArrays
    ) -> tuple[jax.Array, ...]:
        logits, self.kv = self._counted(
            step_fn, self.params, self.kv, tokens, meta,
            config=self.model_config, impl=self.impl,
        )  # fmt: skip
        return self._counted(sample_fn, logits, samp)

    def _counted(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        before = _compilations
        result = fn(*args, **kwargs)
        self.compilations += _compilations - before
        return result

    def warmup_shapes(self) -> list[Shape]:
        """Every bucket serving can produce: decode rows at every width (or page count),
        prefill tiles at every width."""
        if self.ragged:
            decode = []
            for below, rows in zip([0, *self.batch_ladder], self.batch_ladder, strict=False):
                # each of at least below + 1 live rows holds a page, each at most a full table
                least = _bucket(below + 1, self.page_ladder)
                most = _bucket(rows * self.width_ladder[-1], self.page_ladder)
                decode += [Shape(rows, 1, 0, p) for p in self.page_ladder if least <= p <= most]
        else:
            widths = itertools.product(self.batch_ladder, (1,), self.width_ladder)
            decode = [Shape(*s) for s in widths]
        prefill = itertools.product(self.tile_ladder, (PREFILL_TILE,), self.prefill_widths)
        return decode + [Shape(*s) for s in prefill]

    def warmup(self) -> None:
        """Compile (and run once, on padding) every bucket now, so serving compiles nothing."""
        shapes = self.warmup_shapes()
        start = time.perf_counter()
        for i, s in enumerate(shapes):
            meta = StepMetadata(
                slot_mapping=np.zeros((s.rows, s.lq), np.int32),
                block_tables=np.zeros((s.rows, s.width), np.int32),
                context_lens=np.zeros(s.rows, np.int32),
                query_lens=np.zeros(s.rows, np.int32),
                pages=page_list(np.zeros((s.rows, 0), np.int32), np.zeros(s.rows), 1, s.pages)
                if s.pages
                else None,
            )
            samp = sampling_arrays([], s.rows)
            jax.block_until_ready(self._execute(np.zeros((s.rows, s.lq), np.int32), meta, samp))
            print(
                f"\rjpaged: warming up {i + 1}/{len(shapes)} shapes "
                f"({time.perf_counter() - start:.0f} s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
        print(file=sys.stderr)
        self.copy_blocks([(0, 0)])


def sampling_arrays(
    rows: Sequence[Row], size: int, owner: np.ndarray | None = None
) -> SamplingArrays:
    """Row `owner[i]`'s (default: row i's) sampling parameters in call row i, padded to
    `size` rows with greedy ones."""
    if owner is None:
        owner = np.arange(len(rows))

    def column(name: str, dtype: Any, pad: float) -> np.ndarray:
        out = np.full(size, pad, dtype)
        out[: len(owner)] = np.array([getattr(r, name) for r in rows], dtype)[owner]
        return out

    return SamplingArrays(
        temperature=column("temperature", np.float32, 0.0),
        top_k=column("top_k", np.int32, 0),
        top_p=column("top_p", np.float32, 1.0),
        seed=column("seed", np.uint32, 0),
        step=column("step", np.int32, 0),
        logprobs=column("logprobs", np.int32, 0),
    )
