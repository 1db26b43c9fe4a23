"""A step's rows (`jpaged.engine.contract.Row`) laid out in its bucket as the arrays the
step program reads (`Shape.fields`), their page tables and attention metadata from the
host cache among them; a steady decode step moves the latest layout on.

Host work only, and no device state: the runner adds what lives on the device (which
ring slot holds a decode row's token, the control slots of rows with penalties) and
puts the packed array there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from jpaged.config import EngineConfig
from jpaged.engine.buckets import Shape, bucket, pow2_ladder, score_ladder, token_ladder
from jpaged.engine.contract import Row
from jpaged.engine.controls import RowControls
from jpaged.engine.sampling import SamplingArrays
from jpaged.engine.speculative import extra_samples
from jpaged.kernels import ragged_plan
from jpaged.kernels.ragged_plan import Ragged


class PageTables(Protocol):
    """What steps read of the host cache (`jpaged.cache.CacheProtocol` is one): the pool's
    size and the rows' page tables."""

    @property
    def num_blocks(self) -> int: ...  # device pool size, null block included

    @property
    def num_groups(self) -> int: ...  # KV groups: page tables a sequence

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        """int32 [num_groups, n, width] tables and int32 [n] lengths (`CacheProtocol`)."""
        ...


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """A host cache's size alone (the device pool's blocks and KV groups), standing in for
    the cache in runners that build no steps of their own (a worker process's replays
    process 0's; the memory probe only compiles)."""

    num_blocks: int
    num_groups: int

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        raise RuntimeError("a runner without a host cache builds no steps")


@dataclasses.dataclass
class Batch:
    """A step's rows in their bucket, not yet packed."""

    shape: Shape
    arrays: dict[str, np.ndarray]  # every field of `shape` but "sampling" and "ring_at"
    # the rows' sampling parameters; `slot` is the runner's to fill when `controlled`
    sampling: SamplingArrays
    per: np.ndarray  # the positions each row samples
    positions: int  # their sum: the step's sampled rows that are not padding
    score_ends: np.ndarray  # where each row's scores end among the step's scored tokens
    controlled: bool  # some row has penalties, a logit bias or a blocked EOS
    # the images the step encodes, float32 [3, H, W] each, in `image_at`'s order
    pixels: list[np.ndarray] = dataclasses.field(default_factory=list)

    def pack(self, ring_at: int) -> np.ndarray:
        """The one int32 array the step reads, its sampled tokens going to ring slot
        `ring_at` on."""
        arrays = {**self.arrays, "sampling": self.sampling.pack(), "ring_at": np.array([ring_at])}
        return self.shape.pack(arrays)


@dataclasses.dataclass
class _Steady:
    """The latest step built, where every row decoded a token still on the device: the
    next step over the same sequences, each one token further, differs from it only in its
    attention metadata (positions +1, where no row starts a page), ring slots and sample
    indices (`Batcher.steady`)."""

    seq_ids: np.ndarray  # int [n]
    sample_index: np.ndarray  # int [n]
    tables: np.ndarray  # int32 [G, n, width], as `PageTables.page_tables` gave them
    context_lens: np.ndarray  # int [n]
    batch: Batch


class Batcher:
    """The buckets a configuration's steps run in, and rows laid out in them."""

    def __init__(
        self,
        config: EngineConfig,
        tables: PageTables,
        impl: str,
        lora: bool,
        gpu: bool,
    ) -> None:
        """`tables`: where the rows' page tables come from; `impl`: the attention
        implementation (resolved); `lora`: whether tokens carry adapter slots; `gpu`:
        whether the steps run on GPUs (their token buckets differ)."""
        self.tables = tables
        self.impl = impl
        self.lora = lora
        self.max_seqs = config.max_batch_size
        # sample rows a step has: one a sequence, and speculative decoding's drafts
        self.max_samples = self.max_seqs + extra_samples(config.speculative, self.max_seqs)
        # decodes always run, so a step may hold max_batch_size tokens past a smaller budget
        self.token_ladder = token_ladder(max(config.max_num_batched_tokens, self.max_seqs), gpu=gpu)
        self.score_ladder = score_ladder(self.token_ladder[-1])
        # a table never needs more columns than the pool has blocks
        self.width = min(config.blocks_per_seq, tables.num_blocks)
        self.block_size = config.block_size
        self._last: _Steady | None = None

    def shape(
        self, num_tokens: int, num_scored: int = 0, score_top: bool = False, images: int = 0
    ) -> Shape:
        """The bucket of a step of `num_tokens` tokens, `num_scored` of them scored (with
        their alternatives if `score_top`), encoding `images` images."""
        tokens = bucket(num_tokens, self.token_ladder)
        scored = bucket(num_scored, self.score_ladder) if num_scored else 0
        samples = min(tokens, self.max_samples) if self.max_samples > self.max_seqs else 0
        return Shape(
            tokens,
            min(tokens, self.max_seqs),
            self.width,
            self.impl,
            scored,
            score_top and bool(scored),
            self.tables.num_groups,
            samples,
            self.lora,
            bucket(images, pow2_ladder(images)) if images else 0,
        )

    def build(self, rows: Sequence[Row], ring_of: dict[int, int]) -> Batch:
        """Lay out a step over `rows`, each writing its `token_ids` after the tokens its
        sequence holds; `ring_of`: the ring slot of each sequence's token of the previous
        call (where its `on_device` row reads its input)."""
        if not rows or len(rows) > self.max_seqs:
            raise ValueError(f"a step takes 1 to {self.max_seqs} rows, got {len(rows)}")
        lens = np.array([len(r.token_ids) for r in rows])
        if lens.min() < 1:
            raise ValueError("every row needs at least one new token")
        if any(
            r.on_device and (n > 1 or r.seq_id not in ring_of)
            for r, n in zip(rows, lens.tolist(), strict=True)  # (not NumPy scalars)
        ):
            raise ValueError(
                "only decode rows (one token each) of sequences the previous call "
                "ran may take their token from the ring"
            )
        scored = np.array([len(r.score_ids) for r in rows])
        if (scored > lens).any():
            raise ValueError("a row can score at most the tokens it computes")
        per = 1 + np.array([r.drafts for r in rows])  # positions each row samples
        if (per > lens).any() or any(r.drafts and r.on_device for r in rows):
            raise ValueError("a row's drafts follow its first token, which the host knows")
        top = any(r.score_top and r.score_ids for r in rows)
        images = [(i, im) for i, r in enumerate(rows) for im in r.images]
        shape = self.shape(int(lens.sum()), int(scored.sum()), top, len(images))
        ends = np.cumsum(lens)
        extents = image_at = None
        pixels: list[np.ndarray] = []
        if images:
            # each image's tokens see to its last; their embeddings are its soft tokens
            extents = np.zeros(int(lens.sum()), np.int64)
            image_at = np.full(shape.tokens, -1, np.int32)
            by_pixels: dict[int, int] = {}  # one encoding of an image two rows share
            for i, im in images:
                slot = by_pixels.setdefault(id(im.image), len(pixels))
                if slot == len(pixels):
                    pixels.append(im.image.pixels)
                at = ends[i] - lens[i] + im.offset + np.arange(im.count)
                extents[at] = np.arange(im.count)[::-1]
                image_at[at] = slot * im.image.length + im.first + np.arange(im.count)
        seq_ids = [r.seq_id for r in rows]
        tables, context_lens = self.tables.page_tables(seq_ids, self.width)
        meta = self._plan(tables, context_lens, lens, shape, extents)
        tokens = np.zeros(shape.tokens, np.int32)
        tokens[: ends[-1]] = list(itertools.chain.from_iterable(r.token_ids for r in rows))
        sources = np.full(shape.tokens, -1, np.int32)
        sources[ends - 1] = [ring_of[r.seq_id] if r.on_device else -1 for r in rows]
        positions = int(per.sum())
        if positions > shape.sample_rows:
            raise ValueError(
                f"{positions} positions to sample exceed the step's {shape.sample_rows} sample rows"
            )
        last = np.zeros(shape.sample_rows, np.int32)
        if positions == len(rows):  # (no drafts: each row samples its last token)
            last[:positions] = ends - 1
        else:
            last[:positions] = np.repeat(ends, per) - np.repeat(per, per) + _within(per)
        # each row scores its first tokens: token j of row i's scores sits at flat index
        # (row i's first token) + j, and is entry (score_ends[i] - scored[i]) + j
        score_ends, total = np.cumsum(scored), int(scored.sum())
        score_at = np.zeros(shape.scored, np.int32)
        score_at[:total] = np.repeat(ends - lens - (score_ends - scored), scored) + np.arange(total)
        score_ids = np.zeros(shape.scored, np.int32)
        score_ids[:total] = [t for r in rows for t in r.score_ids]
        lora = np.zeros(shape.tokens if shape.lora else 0, np.int32)
        if shape.lora:
            lora[: ends[-1]] = np.repeat([r.lora_slot for r in rows], lens)
        arrays = {
            **meta._asdict(),
            "tokens": tokens,
            "sources": sources,
            "last": last,
            "score_at": score_at,
            "score_ids": score_ids,
            "lora": lora,
            "image_at": np.zeros(0, np.int32) if image_at is None else image_at,
        }
        batch = Batch(
            shape,
            arrays,
            sampling_arrays(rows, shape.sample_rows, per),
            per,
            positions,
            score_ends,
            any(r.controls is not None or r.block_eos for r in rows),
            pixels,
        )
        self._last = None
        if not batch.controlled and all(
            r.on_device and not r.score_ids and not r.images for r in rows
        ):  # (a row on the device has one token, no drafts)
            indices = np.array([r.sample_index for r in rows])
            self._last = _Steady(np.array(seq_ids), indices, tables, context_lens, batch)
        return batch

    def steady(
        self, seq_ids: np.ndarray, sample_index: np.ndarray, sources: np.ndarray
    ) -> Batch | None:
        """The latest step's layout moved on by a token (`contract.Decodes`: each of its
        sequences decoding one more token, the row sampling output `sample_index` of its
        sequence from ring slot `sources`), if the latest step was built over these
        sequences (or more: those that left since are dropped) with those tokens on the
        device; else None (the step is built whole). No Python object a row: the page
        tables are gathered from the cache and checked against the latest ones every step
        (so the layout cannot go stale); the attention metadata is planned anew where a
        row starts a page, a table changed or rows left, else its positions move on."""
        last = self._last
        keep = None if last is None else kept(last.seq_ids, seq_ids)
        if last is None or keep is None:
            return None
        tables, context_lens = self.tables.page_tables(seq_ids.tolist(), self.width)
        if not (
            np.array_equal(sample_index, last.sample_index[keep] + 1)
            and np.array_equal(context_lens, last.context_lens[keep] + 1)
        ):
            return None
        old, n = last.batch, len(seq_ids)
        if len(seq_ids) < len(last.seq_ids):  # rows left: the rest laid out anew
            batch = self._compact(old, keep, tables, context_lens, sample_index, sources)
        else:
            if (last.context_lens % self.block_size).all() and np.array_equal(tables, last.tables):
                positions = old.arrays["positions"].copy()
                positions[:n] += 1
                meta = {"positions": positions}
            else:  # a row starts a page
                ones = np.ones(n, np.int64)
                meta = self._plan(tables, context_lens, ones, old.shape)._asdict()
            moved = old.arrays["sources"].copy()
            moved[:n] = sources
            indices = old.sampling.sample_index.copy()
            indices[:n] = sample_index
            batch = dataclasses.replace(
                old,
                arrays={**old.arrays, **meta, "sources": moved},
                sampling=dataclasses.replace(old.sampling, sample_index=indices),
            )
        self._last = _Steady(seq_ids, sample_index, tables, context_lens, batch)
        return batch

    def _compact(
        self,
        old: Batch,
        keep: np.ndarray,
        tables: np.ndarray,
        context_lens: np.ndarray,
        sample_index: np.ndarray,
        sources: np.ndarray,
    ) -> Batch:
        """A steady step over the rows `keep` (bool [rows]) of the latest one, each a token
        further, as `build` lays it out: one token a row, in a bucket of their count."""
        n = len(sample_index)
        shape = self.shape(n)
        meta = self._plan(tables, context_lens, np.ones(n, np.int64), shape)
        moved = np.full(shape.tokens, -1, np.int32)
        moved[:n] = sources
        last = np.zeros(shape.sample_rows, np.int32)
        last[:n] = np.arange(n)
        lora = np.zeros(shape.tokens if shape.lora else 0, np.int32)
        if shape.lora:
            lora[:n] = old.arrays["lora"][: len(keep)][keep]
        arrays = {
            **meta._asdict(),
            "tokens": np.zeros(shape.tokens, np.int32),
            "sources": moved,
            "last": last,
            "score_at": np.zeros(shape.scored, np.int32),
            "score_ids": np.zeros(shape.scored, np.int32),
            "lora": lora,
            "image_at": np.zeros(0, np.int32),
        }
        sampling = _taken(old.sampling, keep, shape.sample_rows)
        sampling.sample_index[:n] = sample_index
        per = np.ones(n, np.int64)
        return Batch(shape, arrays, sampling, per, n, np.zeros(n, np.int64), False)

    def build_steps(
        self, rows: Sequence[Row], ring_of: dict[int, int], ring_ats: Sequence[int], size: int
    ) -> tuple[Batch, np.ndarray]:
        """Lay out len(ring_ats) decode steps of `rows` (plain decodes, one token each,
        each sequence grown by every step's slot already), step i writing its tokens to ring
        slot ring_ats[i] on and each row's input of step i > 0 read where step i - 1 wrote
        its token. Returns the first step's batch (its bucket, sampling parameters) and
        the one int32 array the program reads: `size` steps' packed arrays (those past
        the last zeros), then how many steps run."""
        steps, n = len(ring_ats), len(rows)
        if any(r.drafts or r.score_ids or r.images or r.block_eos for r in rows) or any(
            r.controls is not None for r in rows
        ):
            raise ValueError("several steps a call take plain decode rows only")
        if not 1 <= n <= self.max_seqs or steps > size:
            raise ValueError(f"{steps} steps of {n} rows: at most {size} of 1 to {self.max_seqs}")
        if any(len(r.token_ids) != 1 or (r.on_device and r.seq_id not in ring_of) for r in rows):
            raise ValueError("a row of several steps decodes one token a step")
        self._last = None  # (the next step is built whole)
        shape = self.shape(n)
        seq_ids = [r.seq_id for r in rows]
        tables, context_lens = self.tables.page_tables(seq_ids, self.width)
        context_lens = context_lens - (steps - 1)  # the first step's
        ones = np.ones(n, np.int64)
        meta = self._plan(tables, context_lens, ones, shape)
        tokens = np.zeros(shape.tokens, np.int32)
        tokens[:n] = [r.token_ids[0] for r in rows]
        sources = np.full(shape.tokens, -1, np.int32)
        sources[:n] = [ring_of[r.seq_id] if r.on_device else -1 for r in rows]
        last = np.zeros(shape.sample_rows, np.int32)
        last[:n] = np.arange(n)
        sampling = sampling_arrays(rows, shape.sample_rows)
        lora = np.zeros(shape.tokens if shape.lora else 0, np.int32)
        if shape.lora:
            lora[:n] = [r.lora_slot for r in rows]
        fixed = {
            "tokens": tokens,
            "last": last,
            "score_at": np.zeros(shape.scored, np.int32),
            "score_ids": np.zeros(shape.scored, np.int32),
            "lora": lora,
            "image_at": np.zeros(0, np.int32),
        }
        packed = np.zeros((size, shape.size()), np.int32)
        for i, ring_at in enumerate(ring_ats):
            if i:
                same_pages = (context_lens % self.block_size).all()
                context_lens = context_lens + 1
                if same_pages:  # the latest layout, a token further
                    positions = meta.positions.copy()
                    positions[:n] += 1
                    meta = meta._replace(positions=positions)
                else:  # a row starts a page
                    meta = self._plan(tables, context_lens, ones, shape)
                sampling.sample_index[:n] += 1
                sources[:n] = ring_ats[i - 1] + np.arange(n)
            packed[i] = self._pack_step(shape, meta, sources, sampling, ring_at, fixed)
        batch = Batch(shape, {}, sampling, ones, n, np.zeros(0, np.int64), False)
        return batch, np.concatenate([packed.reshape(-1), np.array([steps], np.int32)])

    @staticmethod
    def _pack_step(
        shape: Shape,
        meta: Ragged,
        sources: np.ndarray,
        sampling: SamplingArrays,
        ring_at: int,
        fixed: dict[str, np.ndarray],
    ) -> np.ndarray:
        arrays = {**meta._asdict(), **fixed, "sources": sources}
        arrays |= {"sampling": sampling.pack(), "ring_at": np.array([ring_at])}
        return shape.pack(arrays)

    def prefill(self, rows: Sequence[Row]) -> tuple[Shape, np.ndarray]:
        """A step over `rows` that samples nothing (only its tokens and attention metadata
        are read): its bucket and packed array."""
        lens = np.array([len(r.token_ids) for r in rows])
        shape = self.shape(int(lens.sum()))
        meta = self.plan([r.seq_id for r in rows], lens, shape)
        tokens = np.zeros(shape.tokens, np.int32)
        tokens[: lens.sum()] = list(itertools.chain.from_iterable(r.token_ids for r in rows))
        arrays = {name: np.zeros(dims, np.int32) for name, dims in shape.fields().items()}
        arrays |= {**meta._asdict(), "tokens": tokens}
        return shape, shape.pack(arrays)

    def plan(
        self,
        seq_ids: list[int],
        lens: np.ndarray,
        shape: Shape,
        extents: np.ndarray | None = None,
    ) -> Ragged:
        """The attention metadata of rows of `lens` new tokens after what `seq_ids` hold
        (`extents`: the keys past its own position each token sees, `ragged_plan.plan`)."""
        tables, context_lens = self.tables.page_tables(seq_ids, self.width)
        return self._plan(tables, context_lens, lens, shape, extents)

    def _plan(
        self,
        tables: np.ndarray,
        context_lens: np.ndarray,
        lens: np.ndarray,
        shape: Shape,
        extents: np.ndarray | None = None,
    ) -> Ragged:
        return ragged_plan.plan(
            lens,
            context_lens,
            tables,
            num_tokens=shape.tokens,
            num_seqs=shape.seqs,
            width=self.width,
            block_size=self.block_size,
            impl=self.impl,
            extents=extents,
        )


def _within(per: np.ndarray) -> np.ndarray:
    """Each position's index within its row: 0..per[i] - 1 for each row i, flat."""
    return np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)


def kept(old: np.ndarray, new: np.ndarray) -> np.ndarray | None:
    """Which of the sequences `old` the sequences `new` are, in the same order (bool
    [len(old)]), where `new` is `old` but for some that left; else None."""
    if len(new) == len(old):
        return np.ones(len(old), bool) if np.array_equal(new, old) else None
    keep = np.isin(old, new)
    return keep if np.array_equal(old[keep], new) else None


_NO_CONTROLS = RowControls()
# a padding row's sampling parameters: greedy, no top-p, no penalties (`sampling_arrays`)
_PADDING = {"top_p": 1.0, "repetition_penalty": 1.0}


def _taken(sampling: SamplingArrays, keep: np.ndarray, size: int) -> SamplingArrays:
    """The sampling parameters of the rows `keep` (bool, a row a sample position), padded
    to `size` positions as `sampling_arrays` pads them."""
    n = int(keep.sum())
    columns = {}
    for field in dataclasses.fields(sampling):
        column = getattr(sampling, field.name)
        out = np.full(size, _PADDING.get(field.name, 0), column.dtype)
        out[:n] = column[: len(keep)][keep]
        columns[field.name] = out
    return SamplingArrays(**columns)


def _columns(
    records: Iterable[tuple[float, ...]], shape: tuple[int, int], dtype: type
) -> np.ndarray:
    """[fields, n]: n records of so many fields each, by column. (`fromiter` over their
    flat numbers: `np.array` of the tuples took ~40% more a row.)"""
    fields, n = shape
    flat: np.ndarray = np.fromiter(itertools.chain.from_iterable(records), dtype, fields * n)
    return flat.reshape(n, fields).T


def sampling_arrays(
    rows: Sequence[Row], size: int, per: np.ndarray | None = None
) -> SamplingArrays:
    """The rows' sampling parameters, `per` positions a row (default one), padded to
    `size` positions with greedy ones."""
    # one array per kind, not per column: a step's host work is mostly NumPy calls
    # on small arrays (12 columns built apart took ~180 us a step at one row)
    floats = _columns(
        (
            (r.temperature, r.top_p, r.min_p, c.presence_penalty, c.frequency_penalty,
             c.repetition_penalty)
            for r in rows
            for c in (r.controls or _NO_CONTROLS,)
        ),
        (6, len(rows)),
        np.float32,
    )  # fmt: skip
    ints = _columns(
        ((r.top_k, r.seed, r.sample_index, r.logprobs, r.block_eos) for r in rows),
        (5, len(rows)),
        np.int64,
    )
    if per is not None and (per > 1).any():
        floats, ints = floats.repeat(per, 1), ints.repeat(per, 1)
        ints[2] += _within(per)  # a row's positions sample its next output tokens
    n = floats.shape[1]
    f = np.empty((6, size), np.float32)
    f[:, n:] = np.array([[0.0], [1.0], [0.0], [0.0], [0.0], [1.0]], np.float32)  # greedy, off
    f[:, :n] = floats
    i = np.zeros((5, size), np.int64)
    i[:, :n] = ints
    return SamplingArrays(
        temperature=f[0],
        top_k=i[0].astype(np.int32),
        top_p=f[1],
        min_p=f[2],
        seed=i[1].astype(np.uint32),
        sample_index=i[2].astype(np.int32),
        logprobs=i[3].astype(np.int32),
        presence_penalty=f[3],
        frequency_penalty=f[4],
        repetition_penalty=f[5],
        block_eos=i[4].astype(np.int32),
        slot=np.zeros(size, np.int32),  # `ControlSlots.assign` fills it when a row has controls
    )
