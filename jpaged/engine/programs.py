"""The jitted programs a step runs: the step (the model over a bucket of tokens, the pool
donated), its sampler, the two in one (a GPU's decode step), several decode steps in one,
and a prefill that samples nothing.

A step is one flat axis of tokens: every decoding sequence's next token, then prompt
chunks, sequence after sequence (`ragged_attention`). XLA compiles one program per input
shape, so the token count is padded to a bucket (`buckets.token_ladder`); everything else
about a call's shape follows from its bucket and the configuration. A call's metadata and
sampling parameters travel packed in one int32 array (`Shape.fields`), its results come
back packed in one, and sampled tokens also stay on the device, in a small ring the next
step reads its decode rows' input tokens from (`runner.Runner` keeps the state between
calls).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from jpaged.cache.groups import KVGroups
from jpaged.cache.kv_pool import KVPool
from jpaged.engine.buckets import Shape
from jpaged.engine.sampling import (
    NUM_TOP_LOGPROBS,
    ControlState,
    SamplingArrays,
    count,
    sample,
    score,
)
from jpaged.kernels.ragged_plan import Ragged
from jpaged.models.common import CausalLM, forward
from jpaged.models.lora import LoRABatch

T = TypeVar("T")


def _step(
    state: dict,  # the model's weights: `nnx.to_pure_dict` of its split state
    kv: KVPool,
    ring: jax.Array,  # int32 [R] tokens sampled by the latest steps
    packed: jax.Array,  # int32 [shape.size()], see `Shape.fields`
    out: jax.Array,  # f32 [shape.sample_rows, V], donated: where the logits are written
    *,
    graphdef: Static[nnx.GraphDef[CausalLM]],  # the model's, from `nnx.split`
    impl: str,
    shape: Shape,
    mesh: Mesh | None = None,
    groups: KVGroups | None = None,
    lora: dict | None = None,  # `LoRASlots.weights` when shape.lora
    features: jax.Array | None = None,  # [shape.images, tokens per image, hidden] (images)
) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array | None, KVPool]:
    """-> logits [seqs, V] (in `out`'s buffer), (sampling, ring_at), scores [scored, 1 + 2K]
    (None when the shape scores nothing), kv. With `shape.images` the tokens `image_at`
    marks take their embeddings from the images' `features`."""
    f = shape.unpack(packed)
    sources = f["sources"]  # decode tokens that are still on the device
    tokens = jnp.where(sources >= 0, ring[jnp.maximum(sources, 0)], f["tokens"])
    meta = Ragged(*(f[name] for name in Ragged._fields))
    rows = jnp.concatenate([f["last"], f["score_at"]]) if shape.scored else f["last"]
    adapters = None if lora is None else LoRABatch(f["lora"], lora)
    images = None
    if shape.images:
        assert features is not None
        images = (features.reshape(-1, features.shape[-1]), f["image_at"])
    logits, kv = forward(
        graphdef.value,
        state,
        kv,
        tokens,
        meta,
        rows,
        attention_impl=impl,
        mesh=mesh,
        groups=groups,
        adapters=adapters,
        images=images,
    )
    scores = None
    if shape.scored:
        logprobs, top_ids, top_logprobs = score(
            logits[shape.sample_rows :], f["score_ids"], top=shape.score_top
        )
        scores = jnp.concatenate([_bits(logprobs)[:, None], top_ids, _bits(top_logprobs)], axis=1)
        logits = logits[: shape.sample_rows]
    del out  # (its buffer holds the result: donated, and of the logits' shape)
    return logits, (f["sampling"], f["ring_at"][0]), scores, kv


def _hidden(
    state: dict,  # the model's weights: `nnx.to_pure_dict` of its split state
    kv: KVPool,
    packed: jax.Array,  # int32 [shape.size()]: a step's fields, only the prefill's read
    *,
    graphdef: Static[nnx.GraphDef[CausalLM]],
    impl: str,
    shape: Shape,
    mesh: Mesh | None = None,
    groups: KVGroups | None = None,
) -> tuple[jax.Array, KVPool]:
    """A prefill that samples nothing: -> every token's final hidden state [tokens,
    hidden] (float32, for embeddings), kv."""
    f = shape.unpack(packed)
    meta = Ragged(*(f[name] for name in Ragged._fields))
    rows = jnp.arange(shape.tokens, dtype=jnp.int32)
    return forward(
        graphdef.value,
        state,
        kv,
        f["tokens"],
        meta,
        rows,
        attention_impl=impl,
        mesh=mesh,
        groups=groups,
        head=False,
    )


# XLA on GPU merges dots that share an input (q/k/v, gate/up) into one by concatenating
# their weights: a copy of those weights every step (1 GB a step for a 1B model, as many
# bytes as the matmuls read). Off: each reads its weight where it lies. And tensor
# parallelism's all-reduces join the step's CUDA graph (by default each collective split
# it: ~4 graph launches a layer and the kernels between them outside any graph). This
# list is XLA's default command buffer kinds plus COLLECTIVES. (XLA:CPU ignores both.)
STEP_OPTIONS = {
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES",
}
# `EngineConfig.enforce_eager` (vLLM's name): the same programs with every kernel launched
# on its own. A graph saves the launches but XLA re-records, on the host, every node that
# reads or writes a buffer whose address changed since the last call: which is faster on a
# card is for a measurement to say (RESULTS).
EAGER_OPTIONS = {**STEP_OPTIONS, "xla_gpu_enable_command_buffer": ""}


class Static(Generic[T]):
    """A jitted program's static argument, hashed once: jit hashes its static arguments
    (and a pytree argument's static parts) at every call, and a model's `nnx.GraphDef` took
    ~125 us to hash (a one-user step's host work is ~1 ms)."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: T) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and (
            self.value is other.value or self.value == other.value
        )


def _program(fn: Any, eager: bool, donate: tuple[int, ...], static: tuple[str, ...] = ()) -> Any:
    """`fn` (`_hidden`, `_step`, `_step_sampled`) jitted as the runner calls it, `donate`
    donated (the pool, and a step's logits buffer: kept although no op reads it)."""
    return jax.jit(
        fn,
        static_argnames=("graphdef", "impl", "shape", "mesh", "groups", *static),
        donate_argnums=donate,
        keep_unused=True,
        compiler_options=EAGER_OPTIONS if eager else STEP_OPTIONS,
    )


hidden_fn, eager_hidden_fn = (_program(_hidden, eager, (1,)) for eager in (False, True))


def _bits(x: jax.Array) -> jax.Array:
    """float32 bits as int32, to travel in one int32 array with the ids."""
    return lax.bitcast_convert_type(x, jnp.int32)


# The logits of a step's bucket land in the buffer of the bucket's previous logits
# (`Runner._out`), and XLA packs the step's temporaries there too: the CUDA graph's
# commands keep their addresses from call to call. Else the logits, and every temporary
# beside them, got a new buffer each call and the graph was re-recorded whole (on an
# H200 a 1B step served at one user 2.67 -> 1.87 ms, at 256 users 17.9 -> 9.3; RESULTS).
step_fn, eager_step_fn = (_program(_step, eager, (1, 4)) for eager in (False, True))


def _sample(
    logits: jax.Array,  # f32 [rows, V]
    sampling: tuple[jax.Array, jax.Array],  # int32 [F, rows] `SamplingArrays.pack`, ring_at []
    ring: jax.Array,  # int32 [R]
    state: ControlState | None,  # penalties and biases (None: no row has any)
    mask: jax.Array | None,  # int32 [rows, ceil(V / 32)] grammar bitmask (None: no grammar)
    *,
    greedy: bool,
    top: int,
) -> tuple[jax.Array, jax.Array, ControlState | None]:  # int32 [rows, 2 + 2K] results, ring
    params, ring_at = sampling
    p = SamplingArrays.unpack(params)
    tokens, logprobs, top_ids, top_logprobs = sample(
        logits, p, greedy=greedy, top=top, state=state, mask=mask
    )
    if state is not None:
        state = count(state, p.slot, tokens)
    ring = lax.dynamic_update_slice(ring, tokens, (ring_at,))
    packed = [tokens[:, None], _bits(logprobs)[:, None], top_ids, _bits(top_logprobs)]
    return jnp.concatenate(packed, axis=1), ring, state


# A program of its own, per row bucket and variant: compiled into every step program, the
# sampler doubled each one's memory mappings (~140 of ~250), and an XLA:CPU process holds
# only vm.max_map_count (65530) of them in all. With a `state` or a `mask` (not None) a
# variant compiles when first needed: warm-up compiles the plain ones. No CUDA graph: XLA
# rewrites a graph's every node on the host whenever an argument's address changes (each
# call: fresh logits), which for a program this small costs more than launching its
# kernels: an H200's served 1B step at one user 2.03 -> 1.68 ms without it (RESULTS).
sample_fn = jax.jit(
    _sample,
    static_argnames=("greedy", "top"),
    donate_argnums=(2, 3),
    compiler_options={"xla_gpu_enable_command_buffer": ""},
)
VARIANTS = [{"greedy": g, "top": t} for g in (True, False) for t in (0, NUM_TOP_LOGPROBS)]


def _step_sampled(
    state: dict,
    kv: KVPool,
    ring: jax.Array,  # int32 [R], donated: the sampled tokens go in
    packed: jax.Array,  # int32 [shape.size()]
    out: jax.Array,  # f32 [shape.sample_rows, V], donated
    *,
    greedy: bool,
    top: int,
    **step: Any,  # `_step`'s other arguments
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, KVPool]:
    """`_step` and its sampler in one program: -> logits (in `out`'s buffer), the sampler's
    packed results, ring, scores, kv."""
    logits, sampling, scores, kv = _step(state, kv, ring, packed, out, **step)
    results, ring, _ = _sample(logits, sampling, ring, None, None, greedy=greedy, top=top)
    return logits, results, ring, scores, kv


# On a GPU a step without penalties, biases or a grammar mask is one program, its sampler
# inside (`_step_sampled`): one launch and one CUDA graph a step, where the sampler's ~10
# kernels were launched one by one after the step's graph (~0.27 ms of an H200's 1.54 ms
# served 1B step at one user). Its variants without logprobs (`ONE_LAUNCH`) are compiled
# at warm-up beside the two-program path the other steps take. (On XLA:CPU a program's
# memory mappings are the scarce thing: two programs a step, as above.)
step_sampled_fn, eager_step_sampled_fn = (
    _program(_step_sampled, eager, (1, 2, 4), ("greedy", "top")) for eager in (False, True)
)
ONE_LAUNCH = [v for v in VARIANTS if not v["top"]]


def _steps(
    state: dict,
    kv: KVPool,
    ring: jax.Array,  # int32 [R], donated
    packed: jax.Array,  # int32 [size * shape.size() + 1]: the steps' arrays, how many run
    out: jax.Array,  # f32 [shape.sample_rows, V], donated
    *,
    size: int,
    greedy: bool,
    **step: Any,  # `_step`'s other arguments
) -> tuple[jax.Array, jax.Array, jax.Array, KVPool]:
    """Several plain decode steps in one program (`EngineConfig.num_scheduler_steps`):
    the first packed[-1] of the `size` steps' arrays, each `_step` then its sampler, each
    step's rows reading their inputs where the step before wrote its tokens in the ring
    (`Batcher.build_steps`). -> the last logits (in `out`'s buffer), the results [size,
    rows, 2 + 2K] (those of the steps not run zeros), ring, kv."""
    shape: Shape = step["shape"]
    arrays = packed[:-1].reshape(size, shape.size())
    results = jnp.zeros((size, shape.sample_rows, 2 + 2 * NUM_TOP_LOGPROBS), jnp.int32)

    def body(i: jax.Array, carry: tuple) -> tuple:
        kv, ring, logits, results = carry
        logits, sampling, _, kv = _step(state, kv, ring, arrays[i], logits, **step)
        packed, ring, _ = _sample(logits, sampling, ring, None, None, greedy=greedy, top=0)
        return kv, ring, logits, lax.dynamic_update_index_in_dim(results, packed, i, 0)

    kv, ring, out, results = lax.fori_loop(0, packed[-1], body, (kv, ring, out, results))
    return out, results, ring, kv


steps_fn, eager_steps_fn = (
    _program(_steps, eager, (1, 2, 4), ("size", "greedy")) for eager in (False, True)
)
