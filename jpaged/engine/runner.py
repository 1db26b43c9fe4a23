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

A call crosses between host and device once each way: its metadata and sampling
parameters travel packed in one int32 array, and its results come back packed
in one. Sampled tokens also stay on the device, in a small ring the next step
reads its decode rows' input tokens from (`Row.source`), so the host can
dispatch step N+1 before it has seen step N's tokens (`dispatch` / `collect`).
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
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.cache import kv_pool
from jpaged.cache.kv_pool import KVPool
from jpaged.cache.protocol import CachePoolProtocol, StepMetadata
from jpaged.config import EngineConfig
from jpaged.engine.sampling import SamplingArrays, sample, variant
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
    ring: jax.Array,  # int32 [R] tokens sampled by the latest steps
    packed: jax.Array,  # int32 [shape.size()], see `Shape.fields`
    *,
    config: ModelConfig,
    impl: str,
    shape: Shape,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array], KVPool]:  # logits, (sampling, ring_at), kv
    f = shape.unpack(packed)
    sources = f["sources"][:, None]  # decode rows whose token is still on the device
    tokens = jnp.where(sources >= 0, ring[jnp.maximum(sources, 0)], f["tokens"])
    meta = StepMetadata(
        slot_mapping=f["slot_mapping"],
        block_tables=f["block_tables"],
        context_lens=f["context_lens"],
        query_lens=f["query_lens"],
        pages=f["pages"] if shape.pages else None,
    )
    logits, kv = forward(params, kv, tokens, meta, config=config, attention_impl=impl)
    return logits, (f["sampling"], f["ring_at"][0]), kv


step_fn = jax.jit(_step, static_argnames=("config", "impl", "shape"), donate_argnums=1)


def _sample(
    logits: jax.Array,  # f32 [rows, V]
    sampling: tuple[jax.Array, jax.Array],  # int32 [6, rows] `SamplingArrays.pack`, ring_at []
    ring: jax.Array,  # int32 [R]
    *,
    greedy: bool,
    top: bool,
) -> tuple[jax.Array, jax.Array]:  # int32 [rows, 2 + 2K] packed results, the ring
    params, ring_at = sampling
    tokens, logprobs, top_ids, top_logprobs = sample(
        logits, SamplingArrays.unpack(params), greedy=greedy, top=top
    )
    ring = lax.dynamic_update_slice(ring, tokens, (ring_at,))
    bits = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
    packed = [tokens[:, None], bits(logprobs)[:, None], top_ids, bits(top_logprobs)]
    return jnp.concatenate(packed, axis=1), ring


# A program of its own, per row bucket and variant: compiled into every step program, the
# sampler doubled each one's memory mappings (~140 of ~250), and an XLA:CPU process holds
# only vm.max_map_count (65530) of them in all.
sample_fn = jax.jit(_sample, static_argnames=("greedy", "top"), donate_argnums=2)
VARIANTS = [{"greedy": g, "top": t} for g in (True, False) for t in (False, True)]


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

    def fields(self) -> dict[str, tuple[int, ...]]:
        """The arrays a call of this shape packs into one int32 array, in order."""
        r = self.rows
        return {
            "sampling": (len(dataclasses.fields(SamplingArrays)), r),
            "tokens": (r, self.lq),
            "sources": (r,),  # ring index of a decode row's input token, or -1
            "slot_mapping": (r, self.lq),
            "block_tables": (r, self.width),
            "context_lens": (r,),
            "query_lens": (r,),
            "pages": (3, self.pages),
            "ring_at": (1,),  # where the call's sampled tokens go in the ring
        }

    def pack(self, arrays: dict[str, np.ndarray]) -> np.ndarray:  # int32 [size]
        # a fresh array each call: on CPU the device array may alias it (zero copy)
        parts = []
        for name, dims in self.fields().items():
            a = np.asarray(arrays[name])
            if a.shape != dims:
                raise ValueError(f"{name} has shape {a.shape}, the bucket needs {dims}")
            parts.append(a.astype(np.int32, copy=False).reshape(-1))
        return np.concatenate(parts)

    def size(self) -> int:
        return sum(int(np.prod(dims)) for dims in self.fields().values())

    def unpack(self, packed: Any) -> dict[str, Any]:
        """The arrays back from `pack`'s output (NumPy or traced)."""
        out, at = {}, 0
        for name, dims in self.fields().items():
            n = int(np.prod(dims))
            out[name] = packed[at : at + n].reshape(dims)
            at += n
        return out


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # f32 [n]
    top_ids: np.ndarray  # int32 [n, K]
    top_logprobs: np.ndarray  # f32 [n, K]
    shape: Shape  # the bucket this call ran in (for benchmarks: real vs padded work)


@dataclasses.dataclass
class Pending:
    """A dispatched call: its results stay on the device until `Runner.collect`."""

    packed: jax.Array  # int32 [rows, 2 + 2K]: token, logprob bits, top ids, top logprob bits
    picks: np.ndarray  # int [n]: the result row of each input row
    ring_index: np.ndarray  # int [n]: where each row's sampled token sits in the ring
    shape: Shape


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
    # A decode row whose input token the previous step sampled and the host has not read:
    # the token's `Pending.ring_index` (its `token_ids` entry is then ignored).
    source: int = -1


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
        # The ring of sampled tokens, in two halves that calls take turns to write: a step
        # makes at most two calls, and the next step's reads come before its own writes.
        self._ring_half = max(self.batch_ladder[-1], self.tile_ladder[-1])
        self._ring_at = 0
        self.ring = jnp.zeros(2 * self._ring_half, jnp.int32)
        self.compilations = 0
        self.device_s = 0.0  # dispatching, and waiting for results the device has not finished

    def reset_pool(self) -> None:
        """A fresh zero pool and ring, after a failed step consumed the donated ones."""
        self.kv = self._new_pool()
        self.ring = jnp.zeros(2 * self._ring_half, jnp.int32)

    @property
    def pool_lost(self) -> bool:
        return self.kv.k.is_deleted() or self.ring.is_deleted()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        # pad to a power of two with 0 -> 0 (the null block onto itself) to bound compilations
        n = _bucket(len(copies), _pow2_ladder(max(len(copies), 1)))
        pairs = np.zeros((n, 2), np.int32)
        pairs[: len(copies)] = copies
        self.kv = self._counted(kv_pool.copy_blocks_jit, self.kv, jax.device_put(pairs))

    def run(self, rows: Sequence[Row]) -> StepResult:
        """One step over `rows`, waiting for its results."""
        return self.collect(self.dispatch(rows))

    def dispatch(self, rows: Sequence[Row]) -> Pending:
        """Start one step over `rows`: all decode rows (one token each) or all prompt
        chunks. Returns at once; the results stay on the device until `collect`."""
        lens = np.array([len(r.token_ids) for r in rows])
        if lens.min() < 1:
            raise ValueError("every row needs at least one new token")
        if lens.max() > 1 and any(r.source >= 0 for r in rows):
            raise ValueError("only decode rows (one token each) may take their token from the ring")
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
            sources = np.full(shape.rows, -1, np.int32)
            sources[: len(rows)] = [r.source for r in rows]
            samp = sampling_arrays(rows, shape.rows)
            picks = np.arange(len(rows))
        else:
            width = _bucket(blocks, self.prefill_widths)
            shape, tokens, meta, owner, picks = self._tile(rows, lens, width)
            sources = np.full(shape.rows, -1, np.int32)
            samp = sampling_arrays(rows, shape.rows, owner)
        at = self._ring_at
        self._ring_at = self._ring_half - at
        arrays = {
            **vars(meta),
            "pages": np.zeros((3, 0), np.int32) if meta.pages is None else meta.pages,
            "tokens": tokens,
            "sources": sources,
            "sampling": samp.pack(),
            "ring_at": np.array([at]),
        }
        packed = self._execute(shape, shape.pack(arrays), variant(samp))
        return Pending(packed, picks, at + picks, shape)

    def collect(self, pending: Pending) -> StepResult:
        """A dispatched call's results for its rows (waits for the device)."""
        start = time.perf_counter()
        host = np.asarray(jax.device_get(pending.packed))[pending.picks]
        self.device_s += time.perf_counter() - start
        k = (host.shape[1] - 2) // 2
        as_float = host.view(np.float32)
        return StepResult(
            tokens=host[:, 0],
            logprobs=as_float[:, 1],
            top_ids=host[:, 2 : 2 + k],
            top_logprobs=as_float[:, 2 + k :],
            shape=pending.shape,
        )

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

    def _execute(self, shape: Shape, packed: np.ndarray, sampler: dict[str, bool]) -> jax.Array:
        """Step and sample: one transfer to the device, results left there."""
        start = time.perf_counter()
        logits, sampling = self._forward(shape, packed)
        out = self._sample(logits, sampling, sampler)
        self.device_s += time.perf_counter() - start
        return out

    def _forward(self, shape: Shape, packed: np.ndarray) -> tuple[jax.Array, Any]:
        logits, sampling, self.kv = self._counted(
            step_fn, self.params, self.kv, self.ring, jax.device_put(packed),
            config=self.model_config, impl=self.impl, shape=shape,
        )  # fmt: skip
        return logits, sampling

    def _sample(self, logits: jax.Array, sampling: Any, sampler: dict[str, bool]) -> jax.Array:
        packed, self.ring = self._counted(sample_fn, logits, sampling, self.ring, **sampler)
        return packed

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
        """Compile (and run once, on padding) every bucket now, so serving compiles nothing:
        each step shape, and every sampler variant of each row count."""
        shapes = self.warmup_shapes()
        sampled = set()
        start = time.perf_counter()
        for i, s in enumerate(shapes):
            logits, sampling = self._forward(s, np.zeros(s.size(), np.int32))
            if s.rows not in sampled:
                sampled.add(s.rows)
                for sampler in VARIANTS:
                    jax.block_until_ready(self._sample(logits, sampling, sampler))
            jax.block_until_ready(logits)
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
