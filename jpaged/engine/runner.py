"""The device state between calls (the pool, the ring of sampled tokens, each bucket's
logits buffer), and the calls of the step programs (`programs`) over a batch of rows.

A step's rows are laid out in a token bucket (`batch`); padding tokens write to the null
block and see nothing, padding sequences sample garbage nobody reads. A call crosses
between host and device once each way: its metadata and sampling parameters travel packed
in one int32 array, and its results come back packed in one. Sampled tokens also stay on
the device, in a small ring the next step reads its decode rows' input tokens from
(`Row.on_device`, `sources`), so the host can dispatch step N+1 before it has seen step
N's tokens (`dispatch` / `collect`).

With tensor parallelism (a `mesh`) the weights and the pool lie split over the
devices (`models.sharding`), each call's packed inputs go to every device alike,
and the sampled tokens, the same on every device, are read from one.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jpaged.cache import kv_pool
from jpaged.cache.groups import KVGroups
from jpaged.config import EngineConfig
from jpaged.engine import programs
from jpaged.engine.batch import Batch, Batcher, PageTables, kept
from jpaged.engine.buckets import Shape, bucket, pow2_ladder
from jpaged.engine.compile import Progress, compilations, compile_all, use_compilation_cache
from jpaged.engine.contract import Decodes, Row, Scores, StepResult, row_of
from jpaged.engine.controls import ControlSlots
from jpaged.engine.lora import LoRASlots
from jpaged.engine.programs import ONE_LAUNCH, VARIANTS
from jpaged.engine.sampling import (
    NUM_TOP_LOGPROBS,
    variant,
)
from jpaged.models import sharding
from jpaged.models.gemma3_vision import encode
from jpaged.models.loaded import LoadedModel

_NO_RING = (np.zeros(0, np.int64), np.zeros(0, np.int64))


@dataclasses.dataclass
class Pending:
    """A dispatched call: its results stay on the device until `Runner.collect`."""

    # int32 [seqs, 2 + 2K]: token, logprob bits, top ids, top logprob bits; None until
    # `Runner.sample` for a call dispatched with `sample=False`
    packed: jax.Array | None
    rows: int
    shape: Shape
    scores: jax.Array | None = None  # int32 [scored, 1 + 2K]: logprob bits, top ids and bits
    score_ends: np.ndarray | None = None  # int [n]: where each row's scores end in `scores`
    # a call whose sampler waits for its grammar mask: the step's outputs and the variant
    unsampled: tuple[jax.Array, Any, dict[str, Any], bool] | None = None
    steps: int = 1  # decode steps the call ran: `packed` is [steps', seqs, 2 + 2K]


class Runner:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        tables: PageTables,
        mesh: Mesh | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        """`model` lies on `mesh` already (`models.loader.shard_model`) when there is one;
        `tables`: the device pool's size and the rows' page tables (the engine's host cache,
        or `batch.CacheSize` where no steps are built here); `groups`: the KV groups of
        `tables` (None: one group of every layer)."""
        if config.compilation_cache_dir:
            use_compilation_cache(config.compilation_cache_dir)
        mc = model.config
        self.model_config = mc
        graphdef, state = nnx.split(model.model)
        self.graphdef = programs.Static(graphdef)
        # as a pure dict: a State's nested States and Variables flatten in Python, ~0.2 ms a call
        self.state = nnx.to_pure_dict(state)
        self.mesh = mesh
        # the vision encoder (a vision-language model on one device; None: no images)
        self.vision = model.vision if mesh is None else None
        if self.vision is not None:
            self._vision_def, vision_state = nnx.split(self.vision)
            self._vision_state = nnx.to_pure_dict(vision_state)
        self.groups = groups or KVGroups.of(mc.num_layers)
        if self.groups.num_groups != tables.num_groups:
            raise ValueError(
                f"{self.groups.num_groups} KV groups for a cache of {tables.num_groups}"
            )
        # host inputs go to every device of the mesh alike (or to the default device)
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._new_pool = functools.partial(
            kv_pool.create,
            num_layers=self.groups.size,  # a block holds its group's layers
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            num_blocks=tables.num_blocks,
            dtype=config.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            sharding=None if mesh is None else NamedSharding(mesh, sharding.pool_spec()),
        )
        self.kv = self._new_pool()
        self.impl = impl = config.attention_impl
        self.eager = config.enforce_eager
        self._gpu = jax.default_backend() == "gpu"
        self.one_launch = self._gpu  # see `programs.step_sampled_fn`
        self.batcher = Batcher(
            config, tables, impl, config.lora is not None, gpu=jax.default_backend() == "gpu"
        )
        # The ring of sampled tokens, in two halves that calls take turns to write: the
        # next call reads the previous one's tokens while it writes its own.
        self._ring_half = self.batcher.max_samples
        self._ring_at = 0
        # the latest call's sequences (int [n]) and where each one's last token is in the ring
        self._ring_rows = _NO_RING
        self.ring = jnp.zeros(2 * self._ring_half, jnp.int32, device=self._replicated)
        self.controls = ControlSlots(
            config.max_batch_size, mc.vocab_size, mc.eos_token_ids, self._put
        )
        self.lora = None if config.lora is None else LoRASlots(config.lora, mc, config.dtype, mesh)
        # each bucket's latest sampled logits (by rows): its next call writes over them
        self._spares: dict[int, jax.Array] = {}
        self.max_steps = config.num_scheduler_steps
        self.compilations = 0
        self.device_s = 0.0  # dispatching, and waiting for results the device has not finished
        self.wait_s = 0.0  # of which reading results (waiting for the device among it)

    @property
    def token_ladder(self) -> list[int]:
        return self.batcher.token_ladder

    def shape(self, num_tokens: int, num_scored: int = 0, score_top: bool = False) -> Shape:
        """The bucket of a step of `num_tokens` tokens, `num_scored` of them scored (with
        their alternatives if `score_top`)."""
        return self.batcher.shape(num_tokens, num_scored, score_top)

    def reset_pool(self) -> None:
        """A fresh zero pool and ring, after a failed step consumed the donated ones."""
        self.kv = self._new_pool()
        self.ring = jnp.zeros(2 * self._ring_half, jnp.int32, device=self._replicated)
        self._ring_rows = _NO_RING
        self._spares = {}
        self.controls.reset()

    @property
    def pool_lost(self) -> bool:
        state = self.controls.state
        return (
            self.kv.k.is_deleted()
            or self.ring.is_deleted()
            or (state is not None and state.counts.is_deleted())
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        # pad to a power of two with 0 -> 0 (the null block onto itself) to bound compilations
        n = bucket(len(copies), pow2_ladder(max(len(copies), 1)))
        pairs = np.zeros((n, 2), np.int32)
        pairs[: len(copies)] = copies
        self.kv = self._counted(kv_pool.copy_blocks_jit, self.kv, self._arg(pairs))

    def run(self, rows: Sequence[Row]) -> StepResult:
        """One step over `rows`, waiting for its results."""
        return self.collect(self.dispatch(rows))

    def dispatch(self, rows: Sequence[Row] | Decodes, sample: bool = True) -> Pending:
        """Start one step over `rows`, decodes and prompt chunks alike, each row writing
        its `token_ids` after the tokens its sequence holds (`Decodes`: a steady decode
        step's, which moves the latest layout on where it can). Returns at once; the
        results stay on the device until `collect`. With `sample=False` only the forward
        pass starts: `Runner.sample` gives the sampler its grammar mask later."""
        if isinstance(rows, Decodes):
            seq_ids = rows.seq_ids
            batch = self._steady(rows)
            if batch is None:  # (the latest call ran other rows: built whole)
                batch = self._build([row_of(row) for row in rows], seq_ids)
        else:
            seq_ids = np.fromiter((r.seq_id for r in rows), np.int64, len(rows))
            batch = self._build(rows, seq_ids)
        at = self._ring_at
        self._ring_at = self._ring_half - at
        self._ring_rows = seq_ids, np.cumsum(batch.per) - 1 + at
        shape = batch.shape
        start = time.perf_counter()
        # the images' soft tokens first, then the step that takes them
        features = self.encode(batch.pixels, shape.images) if shape.images else None
        sampler = variant(batch.sampling)
        if sample and self._one_launch(shape) and not batch.controlled and sampler in ONE_LAUNCH:
            pending = Pending(None, batch.positions, shape)
            pending.packed, pending.scores = self._forward_sampled(
                shape, batch.pack(at), features, sampler
            )
        else:
            logits, sampling, scores = self._forward(shape, batch.pack(at), features)
            unsampled = (logits, sampling, sampler, batch.controlled)
            pending = Pending(None, batch.positions, shape, scores, unsampled=unsampled)
        pending.score_ends = batch.score_ends if shape.scored else None
        self.device_s += time.perf_counter() - start
        if sample and pending.unsampled is not None:
            self.sample(pending)
        return pending

    def _steady(self, rows: Decodes) -> Batch | None:
        """The latest layout moved on (`Batcher.steady`), where the latest call ran these
        sequences (or more): each row's input is its token of that call, in the ring."""
        last, slots = self._ring_rows
        keep = kept(last, rows.seq_ids)
        if keep is None:
            return None
        return self.batcher.steady(rows.seq_ids, rows.sample_index, slots[keep])

    def _build(self, rows: Sequence[Row], seq_ids: np.ndarray) -> Batch:
        """A step laid out whole, its rows' controls in their slots."""
        batch = self.batcher.build(rows, self._ring_of())
        if batch.controlled:
            ids = seq_ids.tolist()
            slots = self.controls.assign(ids, [r.controls for r in rows], self._counted)
            batch.sampling.slot[:] = self.controls.inert  # padding rows count into the inert row
            batch.sampling.slot[: batch.positions] = np.repeat(slots, batch.per)
        return batch

    def dispatch_steps(self, rows: Sequence[Row], steps: int) -> Pending:
        """Start `steps` decode steps of plain decode rows (one token each, their sequences
        grown by `steps` slots) in one program: each step's tokens go to the other ring
        half than the step before's, which the next call reads as it reads a one-step
        call's. Their results come back together (`collect`: `steps` tokens a row)."""
        most = self.max_steps
        if not 1 < steps <= most:
            raise ValueError(f"{steps} steps a call: EngineConfig.num_scheduler_steps is {most}")
        at = self._ring_at
        ats = [at if i % 2 == 0 else self._ring_half - at for i in range(steps)]
        batch, packed = self.batcher.build_steps(rows, self._ring_of(), ats, most)
        self._ring_at = self._ring_half - ats[-1]
        seq_ids = np.fromiter((r.seq_id for r in rows), np.int64, len(rows))
        self._ring_rows = seq_ids, ats[-1] + np.arange(len(rows))
        shape = batch.shape
        start = time.perf_counter()
        results = self._forward_steps(shape, packed, variant(batch.sampling)["greedy"])
        self._copy_ahead(results)
        self.device_s += time.perf_counter() - start
        return Pending(results, len(rows), shape, steps=steps)

    def _ring_of(self) -> dict[int, int]:
        """Seq id -> where its token of the latest call is in the ring."""
        seq_ids, slots = self._ring_rows
        return dict(zip(seq_ids.tolist(), slots.tolist(), strict=True))

    def _forward_steps(self, shape: Shape, packed: np.ndarray, greedy: bool) -> jax.Array:
        """The program of several decode steps: -> their packed results."""
        program = programs.eager_steps_fn if self.eager else programs.steps_fn
        logits, results, self.ring, self.kv = self._call_step(
            program, shape, packed, None, size=self.max_steps, greedy=greedy
        )
        self._spares[shape.sample_rows] = logits
        return results

    def hidden(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Prefill `rows` (their blocks granted) and sample nothing: each row's tokens'
        final hidden states, float32 [len(token_ids), hidden] (waits for the device)."""
        lens = np.array([len(r.token_ids) for r in rows])
        shape, packed = self.batcher.prefill(rows)
        start = time.perf_counter()
        h, self.kv = self._counted(
            programs.eager_hidden_fn if self.eager else programs.hidden_fn,
            self.state,
            self.kv,
            self._arg(packed),
            graphdef=self.graphdef,
            impl=self.impl,
            shape=shape,
            mesh=self.mesh,
            groups=self.groups,
        )
        host = np.asarray(jax.device_get(h))[: lens.sum()]
        self.device_s += time.perf_counter() - start
        return np.split(host, np.cumsum(lens)[:-1])

    def sample(self, pending: Pending, mask: np.ndarray | None = None) -> None:
        """Start the sampler of a dispatched call, with the grammar `mask` (int32 [seqs,
        ceil(V / 32)], -1 for unconstrained rows) if any."""
        assert pending.unsampled is not None, "sampled already"
        start = time.perf_counter()
        logits, sampling, sampler, controlled = pending.unsampled
        state = self.controls.state if controlled else None
        device_mask = None if mask is None else self._arg(mask)
        pending.packed, self.ring, state = self._counted(
            programs.sample_fn, logits, sampling, self.ring, state, device_mask, **sampler
        )
        self._copy_ahead(pending.packed)
        self._spares[logits.shape[0]] = logits
        if controlled:
            self.controls.state = state
        pending.unsampled = None
        self.device_s += time.perf_counter() - start

    def collect(self, pending: Pending) -> StepResult:
        """A dispatched call's results for its rows (waits for the device)."""
        assert pending.packed is not None, "collect before sample"
        start = time.perf_counter()
        # the call's one transfer out (np.asarray: jax.device_get's pytree walk cost ~50 us)
        with jax.transfer_guard_device_to_host("allow"):
            host = np.asarray(pending.packed)
            scores = None if pending.scores is None else np.asarray(pending.scores)
        waited = time.perf_counter() - start
        self.device_s += waited
        self.wait_s += waited
        n = pending.rows
        if pending.steps > 1:  # [steps, rows, cols] -> each row's tokens in order
            host = host[: pending.steps, :n].transpose(1, 0, 2).reshape(n * pending.steps, -1)
            n *= pending.steps
        tokens, logprobs, top_ids, top_logprobs = _unpack(host[:n], 1)
        result = StepResult(tokens[:, 0], logprobs[:, 0], top_ids, top_logprobs, pending.shape)
        if scores is not None and pending.score_ends is not None:
            _, lps, ids, tops = _unpack(scores, 0)
            starts = pending.score_ends - np.diff(pending.score_ends, prepend=0)
            result.scores = [
                Scores(lps[a:b, 0], ids[a:b], tops[a:b]) if b > a else None
                for a, b in zip(starts, pending.score_ends, strict=True)
            ]
        return result

    def encode(self, pixels: Sequence[np.ndarray], slots: int) -> jax.Array:
        """The vision encoder's soft tokens of `pixels` (float32 [3, H, W] each), padded to
        `slots` images: [slots, tokens per image, hidden], on the device (one jitted call,
        every image of a step together)."""
        if self.vision is None:
            raise ValueError("this model takes no images")
        batch = np.zeros((slots, *pixels[0].shape), np.float32)
        batch[: len(pixels)] = np.stack(pixels)
        # (the weights as a pure dict: a module's pytree flattens slowly, as the step's would)
        return self._counted(encode, self._vision_def, self._vision_state, self._arg(batch))

    def _forward(
        self, shape: Shape, packed: np.ndarray, features: jax.Array | None = None
    ) -> tuple[jax.Array, Any, Any]:
        program = self._step_program(sampled=False)
        logits, sampling, scores, self.kv = self._call_step(program, shape, packed, features)
        return logits, sampling, scores

    def _forward_sampled(
        self,
        shape: Shape,
        packed: np.ndarray,
        features: jax.Array | None,
        sampler: dict[str, Any],
    ) -> tuple[jax.Array, jax.Array | None]:
        """A step and its sampler in one launch: -> the packed results, the scores."""
        logits, results, self.ring, scores, self.kv = self._call_step(
            self._step_program(sampled=True), shape, packed, features, **sampler
        )
        self._spares[shape.sample_rows] = logits
        self._copy_ahead(results)
        return results, scores

    def _call_step(
        self,
        program: Any,
        shape: Shape,
        packed: np.ndarray,
        features: jax.Array | None,
        **extra: Any,  # the program's own static arguments (a sampler's variant, ...)
    ) -> Any:
        """A step program's call over the device state, its arguments as every call of it
        passes them (a call passing other keywords is another program)."""
        return self._counted(
            program,
            self.state,
            self.kv,
            self.ring,
            self._arg(packed),
            self._out(shape),
            **self._step_args(),
            shape=shape,
            features=features,
            **extra,
        )

    def _step_program(self, sampled: bool) -> Any:
        """The jitted step (with its sampler where `sampled`), eager or not."""
        if sampled:
            return programs.eager_step_sampled_fn if self.eager else programs.step_sampled_fn
        return programs.eager_step_fn if self.eager else programs.step_fn

    def _copy_ahead(self, results: jax.Array) -> None:
        """Start a call's results on their way to the host now: read a step later, they
        are there by then. (A CPU's results are in host memory already: nothing to start,
        and the call cost ~20 us a step.)"""
        if self._gpu:
            results.copy_to_host_async()

    def _step_args(self) -> dict[str, Any]:
        """A step program's arguments besides its arrays, shape and images, as every call
        passes them (a call passing other keywords is another program)."""
        lora = None if self.lora is None else self.lora.weights
        return dict(
            graphdef=self.graphdef, impl=self.impl, mesh=self.mesh, groups=self.groups, lora=lora
        )

    def _sample(self, logits: jax.Array, sampling: Any, sampler: dict[str, Any]) -> jax.Array:
        packed, self.ring, _ = self._counted(
            programs.sample_fn, logits, sampling, self.ring, None, None, **sampler
        )
        self._spares[logits.shape[0]] = logits
        return packed

    def _out(self, shape: Shape) -> jax.Array:
        """Where a step of `shape` writes its logits: over the latest sampled ones of its
        bucket (their sampler is queued before it), zeros at a bucket's first call."""
        spare = self._spares.pop(shape.sample_rows, None)
        return self._zeros(shape) if spare is None else spare

    def _zeros(self, shape: Shape) -> jax.Array:
        return jnp.zeros(self._logits(shape), jnp.float32, device=self._on())

    def _on(self) -> Any:
        """Where a step's logits lie: committed as the previous step's outputs are (the
        pool is one), else it is another program."""
        pool = self.kv.k
        return self._replicated or (pool.sharding if pool.committed else None)

    def _logits(self, shape: Shape) -> tuple[int, int]:
        return shape.sample_rows, self.model_config.vocab_size

    def _put(self, host: np.ndarray) -> jax.Array:
        return jax.device_put(host, self._replicated)

    def _arg(self, host: np.ndarray) -> jax.Array | np.ndarray:
        """A step's host input as its program takes it: on one device the jitted call puts
        a NumPy array itself, in C++ (~10 us; `jax.device_put` took ~90 us in Python)."""
        return host if self._replicated is None else self._put(host)

    def _counted(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        before = compilations()
        # a call's host inputs go in as NumPy (`_arg`), put by the jitted call itself: the
        # transfers meant (a guard that disallows transfers catches any other)
        with jax.transfer_guard_host_to_device("allow"):
            result = fn(*args, **kwargs)
        self.compilations += compilations() - before
        return result

    def activation_bytes(self, width: int) -> int:
        """Device memory a call needs beside the weights and the pool, at most (per device):
        XLA's buffer assignment of the largest step, its page tables `width` blocks wide, and
        of a sampler with logprobs over its logits (both, where one program runs them:
        `one_launch`), and every bucket's logits (kept between its calls: `_out`)."""
        shape = dataclasses.replace(self.shape(self.token_ladder[-1]), width=width)
        step = self._lowered_step(shape)
        logits, sampling = step.out_info[:2]
        sampler = programs.sample_fn.lower(
            logits, sampling, self.ring, None, None, greedy=False, top=NUM_TOP_LOGPROBS
        )

        def need(program: Any) -> int:
            m = program.compile().memory_analysis()
            return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes

        rows = sum({s.sample_rows for s in self.warmup_shapes()})
        needs = need(step), need(sampler)
        return 4 * rows * self.model_config.vocab_size + (
            sum(needs) if self.one_launch else max(needs)
        )

    def warmup_shapes(self) -> list[Shape]:
        """Every bucket serving can produce: one per token bucket."""
        return [self.shape(t) for t in self.token_ladder]

    def warmup(self) -> None:
        """Compile (and run once, on padding) every bucket now, so serving compiles nothing:
        each step shape, every sampler variant of each sequence count, and with
        `one_launch` each step with its sampler's variants without logprobs."""
        shapes = self.warmup_shapes()
        seqs = sorted({s.sample_rows for s in shapes})
        fused = sum(self._one_launch(s) for s in shapes) * len(ONE_LAUNCH)
        several = 2 * len(self._steps_shapes())
        progress = Progress(
            len(shapes) + len(seqs) * len(VARIANTS) + fused + several,
            f"compiling {len(shapes)} step programs (token buckets {self.token_ladder}), "
            f"{len(seqs) * len(VARIANTS)} sampler programs and {fused} steps with their "
            "samplers" + (f", {several} programs of several decode steps" if several else ""),
        )
        before = compilations()
        compile_all(self._lowered(shapes), progress)
        self.compilations += compilations() - before
        progress.close()
        for s in shapes:  # (each call finds its program compiled)
            logits, sampling, _ = self._forward(s, np.zeros(s.size(), np.int32))
            jax.block_until_ready(logits)
            if s.sample_rows in seqs:
                seqs.remove(s.sample_rows)
                for sampler in VARIANTS:
                    jax.block_until_ready(self._sample(logits, sampling, sampler))
            for sampler in ONE_LAUNCH if self._one_launch(s) else []:
                zeros = np.zeros(s.size(), np.int32)
                jax.block_until_ready(self._forward_sampled(s, zeros, None, sampler))
        for s in self._steps_shapes():  # (run no step: their count, the last entry, is 0)
            for greedy in (True, False):
                zeros = np.zeros(self.max_steps * s.size() + 1, np.int32)
                jax.block_until_ready(self._forward_steps(s, zeros, greedy))
        self.copy_blocks([(0, 0)])
        if self.lora is not None:
            self.lora.warmup()

    def _lowered(self, shapes: Sequence[Shape]) -> Iterator[Any]:
        """The programs of `shapes`' steps, their samplers and (`_one_launch`) the steps
        with their samplers, lowered as the calls make them (which find them compiled)."""
        seqs = set()
        for s in shapes:
            step = self._lowered_step(s)
            yield step
            if s.sample_rows not in seqs:
                seqs.add(s.sample_rows)
                logits, sampling = step.out_info[:2]
                for sampler in VARIANTS:
                    yield programs.sample_fn.lower(
                        logits, sampling, self.ring, None, None, **sampler
                    )
            for sampler in ONE_LAUNCH if self._one_launch(s) else []:
                yield self._lowered_step(s, sampler)
        for s in self._steps_shapes():
            for greedy in (True, False):
                yield self._lowered_steps(s, greedy)

    def _steps_shapes(self) -> list[Shape]:
        """The buckets of calls of several decode steps (with num_scheduler_steps > 1):
        those of max_batch_size rows at most."""
        if self.max_steps < 2:
            return []
        top = bucket(self.batcher.max_seqs, self.token_ladder)
        return [s for s in self.warmup_shapes() if s.tokens <= top]

    def _lowered_steps(self, shape: Shape, greedy: bool) -> Any:
        """The program of several decode steps of `shape`, lowered as `_forward_steps`
        calls it."""
        packed = self._arg(np.zeros(self.max_steps * shape.size() + 1, np.int32))
        out = jax.ShapeDtypeStruct(self._logits(shape), jnp.float32, sharding=self._on())
        program = programs.eager_steps_fn if self.eager else programs.steps_fn
        return program.lower(
            self.state,
            self.kv,
            self.ring,
            packed,
            out,
            **self._step_args(),
            shape=shape,
            features=None,
            size=self.max_steps,
            greedy=greedy,
        )

    def _one_launch(self, shape: Shape) -> bool:
        """Whether a step of `shape` that samples plainly runs with its sampler: on a GPU,
        in the buckets of decode steps (a prompt's step is long enough that one launch
        more is nothing, and every variant of a bucket is a program to compile)."""
        return self.one_launch and shape.tokens <= self.batcher.max_seqs

    def _lowered_step(self, shape: Shape, sampler: dict[str, Any] | None = None) -> Any:
        """The step program of `shape` (with `sampler`: the step and its sampler), lowered
        as `_forward` (`_forward_sampled`) calls it."""
        packed: Any = np.zeros(shape.size(), np.int32)  # (`_arg`'s, where it is NumPy)
        if self._replicated is not None:  # as `_arg` puts it, putting nothing (nor announcing)
            packed = jax.ShapeDtypeStruct(packed.shape, jnp.int32, sharding=self._replicated)
        out = jax.ShapeDtypeStruct(self._logits(shape), jnp.float32, sharding=self._on())
        kwargs = self._step_args() | {"shape": shape, "features": None} | (sampler or {})
        program = self._step_program(sampler is not None)
        return program.lower(self.state, self.kv, self.ring, packed, out, **kwargs)


def _unpack(
    host: np.ndarray,  # int32 [rows, ids + 1 + 2K]
    ids: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A packed result's columns: `ids` id columns, one logprob, K top ids, K top logprobs."""
    k = (host.shape[1] - ids - 1) // 2
    floats = host.view(np.float32)
    top = ids + 1
    return host[:, :ids], floats[:, ids:top], host[:, top : top + k], floats[:, top + k :]
