"""A mixture-of-experts MLP, written once for every family that routes tokens to experts
(Qwen3-MoE now; Mixtral, OLMoE later: their routers differ only in `route`'s options).

transformers' semantics (`Qwen3MoeSparseMoeBlock`): the router's logits `x @ gate.T` in
the model's dtype, a float32 softmax over every expert, then the top k (renormalised to sum 1
when `norm_topk_prob`), the weights cast back to the model's dtype; each routed expert's
SwiGLU output times its weight, summed.

Only the routed experts are read (`jax.lax.ragged_dot` on XLA:CPU broadcasts the input
over every expert). `grouped`: the (token, expert) pairs sorted by expert into tiles of
`TILE` rows, each tile one expert's (a group padded to whole tiles), one expert's weights
read a tile (MegaBlocks' layout, llama.cpp's `mul_mat_id` bucketing): on a CPU past
`ROUTED_PAIRS`, or from one token on where the routed kernel does not serve the stacks.
`gather`: each pair's input times its expert's matrix, no loop: on a CPU up to
`ROUTED_PAIRS` by the C++ kernel's routed products (`dot_pairs`, `qdot.dot_id`: one call a
projection, an expert's pairs together); off a CPU for few tokens (`GATHER_PAIRS`: one
command buffer on a GPU) each token's k experts' weights gathered by id, a vector times a
matrix a pair, which XLA GPU computes as a multiply and reduce reading the routed experts
where they lie (no gathered copy written out: benchmarks/RESULTS.md, 2026-12-07). `dense` computes
every expert for every token: the reference, and the baseline `benchmarks/bench_moe.py`
measures the others against.

The experts' weights `[E, in, out]` (gate, up `[E, hidden, I]`, down `[E, I, hidden]`) are
held whole across the layer scan (`whole` metadata, `quant.whole`): the scan never slices a
layer's stack out (a copy of every expert a step); a gather reads `[layer, ids]` in place.
Quantized experts (a GGUF's `ffn_*_exps`) are `quant.QuantWeight`s whose codes are gathered
and dequantized for the routed experts only.

On a mesh: tensor parallelism splits each expert's intermediate dimension, as the dense
MLP's is (XLA all-reduces down's partial sums); expert parallelism (`MoEConfig.
expert_parallel`) gives each device whole experts, tokens replicated: a device computes its
experts' share of every token's sum, one all-reduce adds the shares.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jpaged.models import qdot, quant, sharding
from jpaged.models.config import ModelConfig, MoEConfig

# (token, expert) pairs up to which experts are gathered a pair off a CPU (on XLA:CPU the
# gather's copy made a decode step 3.4x slower than the tiles: benchmarks/bench_moe.py)
GATHER_PAIRS = 64
# (token, expert) pairs up to which a CPU computes the routed pairs alone, in one kernel call
# a projection (`dot_pairs`), rather than tiles of `TILE` rows one after another: 30B-A3B's
# experts (Q4_K gate and up, Q6_K down), ms a layer routed / tiles on 2 loaded AVX-512 cores,
# int8 inputs 1.65 / 8.1 at 8 pairs, 18 / 87 at 128, 127 / 189 at 1024, 286 / 321 at 2048,
# 674 / 578 at 4096; float ones 2.3 / 16.5 at 8, 267 / 423 at 1024, 515 / 513 at 2048
# (2026-12-07: an expert's rows go 4 or 8 at a time, each reading its codes again)
ROUTED_PAIRS = 1024
TILE = 16  # rows of a tile of the grouped path
IMPLS = ("auto", "gather", "grouped", "dense")
IMPL = "auto"  # how `experts` computes when not told (tests and benchmarks set it)


def sparse_layers(hf: dict, num_layers: int) -> tuple[bool, ...]:
    """transformers' rule (`Qwen3MoeDecoderLayer`): a layer is sparse unless it is one of
    `mlp_only_layers`, when experts exist and `(i + 1) % decoder_sparse_step == 0`."""
    only = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    return tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def absent(c: ModelConfig, path: str, layer: int | None) -> bool:
    """Whether state path `path` (`layers.moe.gate.kernel`, `layers.mlp.down.kernel.codes`)
    has no weight in `layer`: experts of a dense layer, the dense MLP of a sparse one (a
    model with both kinds holds both stacks at every layer; those layers' slots are zeros,
    never read)."""
    if c.moe is None or layer is None or not path.startswith("layers."):
        return False
    sparse = c.moe.sparse_layers[layer]
    if path.startswith("layers.moe."):
        return not sparse
    return path.startswith("layers.mlp.") and sparse


def _param(value: jax.Array, split: tuple | None) -> nnx.Param:
    """A weight placed as `split` names (`models.common._param`), held whole across the
    layer scan (`whole`)."""
    meta: dict[str, Any] = {"eager_sharding": False, "whole": True}
    if split is not None:
        meta["out_sharding"] = split
    return nnx.Param(value, **meta)


class Stack(nnx.Module):
    """Every expert's matrix of one projection, `kernel` `[E, in, out]` (PyTorch's `[E, out,
    in]` transposed), at the path the loaders fill (`moe.gate.kernel`)."""

    def __init__(
        self, experts: int, din: int, dout: int, split: tuple, *, dtype: Any, rngs: nnx.Rngs
    ) -> None:
        value = nnx.initializers.normal(0.02)(rngs.params(), (experts, din, dout), dtype)
        self.kernel = _param(value, split)


class MoE(nnx.Module):
    """The router `[E, hidden]` (as the checkpoint's `mlp.gate.weight`, never quantized) and
    the experts' SwiGLU stacks `gate`, `up`, `down`."""

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        m = config.moe
        assert m is not None
        h, i, e = config.hidden_size, m.intermediate_size, m.num_experts
        a = sharding.AXIS
        column: tuple[str | None, ...]
        row: tuple[str | None, ...]
        if m.expert_parallel:  # whole experts a device
            column = row = (a, None, None)
        else:  # each expert's intermediate dimension split, as the dense MLP's
            column, row = (None, None, a), (None, a, None)
        router = nnx.initializers.normal(0.02)(rngs.params(), (e, h), dtype)
        self.router = nnx.Param(router, eager_sharding=False)
        self.gate = Stack(e, h, i, column, dtype=dtype, rngs=rngs)
        self.up = Stack(e, h, i, column, dtype=dtype, rngs=rngs)
        self.down = Stack(e, i, h, row, dtype=dtype, rngs=rngs)
        self.moe = m
        self.act = config.hidden_act

    def __call__(
        self,
        x: jax.Array,  # [T, hidden], normed
        index: jax.Array | None,  # int32 []: the layer (its experts' place in their stacks)
        mesh: Mesh | None = None,
        impl: str | None = None,
    ) -> jax.Array:
        weights, ids = route(x, self.router[...], self.moe)
        stacks = (self.gate.kernel, self.up.kernel, self.down.kernel)
        act = functools.partial(activation, self.act)
        if mesh is None or not self.moe.expert_parallel:
            read = functools.partial(take, layer=index, dtype=x.dtype)
            dot = functools.partial(dot_one, layer=index, dtype=x.dtype)
            e, k = self.moe.num_experts, self.moe.top_k
            pairs = None  # the routed kernel's products, where it serves the stacks
            if index is not None and routed(stacks, x.shape[0], k):
                pairs = functools.partial(dot_pairs, layer=index)
            return experts(x, weights, ids, stacks, read, act, e, impl, dot, pairs)
        return _expert_parallel(x, weights, ids, stacks, index, act, self.moe, mesh, impl)


def route(x: jax.Array, router: jax.Array, m: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's experts `[T, k]` (int32) and their weights `[T, k]` in `x`'s dtype."""
    logits = jnp.einsum("th,eh->te", x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = lax.top_k(probs, m.top_k)
    if m.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), ids.astype(jnp.int32)


def activation(act: str, gate: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)


def take(w: Any, ids: jax.Array, *, layer: jax.Array | None, dtype: Any) -> jax.Array:
    """The float matrices `[*ids.shape, in, out]` of experts `ids` of stack `w` (a float
    `nnx.Param` `[E, in, out]`, or `[L, E, in, out]` held whole and read at `layer`; a
    `quant.QuantWeight`, `quant.MixedWeight`): only those experts read (and dequantized)."""
    if isinstance(w, quant.MixedWeight):
        branches = [
            functools.partial(take, stack, layer=w.slot[...], dtype=dtype) for stack in w.stacks
        ]
        return lax.switch(w.which[...], branches, ids)
    if isinstance(w, quant.QuantWeight):
        parts, at = w.held()
        at = layer if at is None and parts[0].ndim == 4 else at
        picked = tuple(p[ids] if at is None else p[at, ids] for p in parts)
        return quant.dense(quant.one_level(picked, -2), -2, dtype)
    value = w[...] if isinstance(w, nnx.Variable) else w
    return (value[ids] if value.ndim == 3 else value[layer, ids]).astype(dtype)


def dot_one(
    x: jax.Array, w: Any, e: jax.Array, *, layer: jax.Array | None, dtype: Any
) -> jax.Array:
    """`x [rows, in]` @ expert `e`'s (int32 `[]`) matrix of stack `w` (as `take` reads it):
    where the CPU kernels serve a quantized stack (`qdot.usable`), theirs on the codes where
    they lie (the stacks `[layers, E, ...]` seen as `[layers * E, ...]`, the expert's index
    `layer * E + e`: nothing dequantized, no copy); elsewhere `take`'s matrix."""
    if isinstance(w, quant.MixedWeight):
        slot = w.slot[...]
        branches = [
            lambda x, e, stack=stack: dot_one(x, stack, e, layer=slot, dtype=dtype)
            for stack in w.stacks
        ]
        return lax.switch(w.which[...], branches, x, e)
    if isinstance(w, quant.QuantWeight):
        parts, at = w.held()
        at = layer if at is None and parts[0].ndim == 4 else at
        int8 = quant.int8_inputs(w)  # (`activations="int8"`: the codes in the kernels' order)
        tiled = qdot.ordered(parts[0], x.shape[-1], int8, w.tiled)
        if parts[0].ndim == 4 and at is not None:
            flat = tuple(p.reshape(-1, *p.shape[2:]) for p in parts)
            if qdot.usable(x, flat, int8, tiled):
                index = at * parts[0].shape[1] + e
                return qdot.dot(x, flat, index, int8, tiled).astype(x.dtype)
    return x @ take(w, e[None], layer=layer, dtype=dtype)[0]


def routed(stacks: tuple[Any, Any, Any], tokens: int, k: int) -> bool:
    """Whether the CPU kernel's routed products (`dot_pairs`) serve `tokens` tokens' `k`
    experts each through the stacks gate, up and down (decided while tracing)."""

    def serves(w: Any, rows: int) -> bool:
        if isinstance(w, quant.MixedWeight):
            return all(serves(stack, rows) for stack in w.stacks)
        if not isinstance(w, quant.QuantWeight) or w.axis != -2:
            return False
        parts, _ = w.held()
        return qdot.usable_id(rows, w.rows, parts, quant.int8_inputs(w), w.tiled)

    gate, up, down = stacks
    return serves(gate, tokens) and serves(up, tokens) and serves(down, tokens * k)


def dot_pairs(x: jax.Array, w: Any, ids: jax.Array, *, layer: jax.Array) -> jax.Array:
    """Each (token t, expert ids[t, j]) pair's input, `x [T, in]` (a token's for all its
    experts) or `[T, k, in]` (a pair's own), times that expert's matrix of stack `w` (as
    `take` reads it): float32 `[T, k, out]`, by the CPU kernel (`qdot.dot_id`, where
    `routed` says it serves) on the codes where they lie: only the routed pairs' products,
    an expert's pairs reading its codes once, in one call (not a loop over tiles)."""
    if isinstance(w, quant.MixedWeight):
        slot = w.slot[...]
        branches = [
            lambda x, ids, stack=stack: dot_pairs(x, stack, ids, layer=slot) for stack in w.stacks
        ]
        return lax.switch(w.which[...], branches, x, ids)
    parts, at = w.held()
    at = layer if at is None else at
    return qdot.dot_id(x, ids, parts, at, quant.int8_inputs(w), w.tiled)


def experts(
    x: jax.Array,
    weights: jax.Array,  # [T, k], 0 for a pair that adds nothing (another device's)
    ids: jax.Array,  # int32 [T, k] in [0, E)
    stacks: tuple[Any, Any, Any],  # gate, up, down
    read: Any,  # (stack, ids) -> float [*ids.shape, in, out] (`take`)
    act: Any,
    num_experts: int,
    impl: str | None = None,
    dot: Any = None,  # (x [rows, in], stack, e) -> x @ expert e (`dot_one`); None: `read`'s
    pairs: Any = None,  # (x [T, in] or [T, k, in], stack, ids) -> the pairs' products
    # float32 [T, k, out] (`dot_pairs`); None: `read`'s experts gathered
) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): `[T, hidden]` in `x`'s dtype; `impl`
    (`IMPLS`, None: `IMPL`): "auto" gathers up to `GATHER_PAIRS` pairs (on a CPU up to
    `ROUTED_PAIRS`, by `pairs`' kernel), else groups."""
    t, k = ids.shape
    impl = impl or IMPL
    if impl == "auto":  # on a CPU, without `pairs`, tiles win from one token on
        # (gathering each pair's weights: benchmarks/bench_moe.py)
        cpu = jax.default_backend() == "cpu"
        few = t * k <= (ROUTED_PAIRS if cpu else GATHER_PAIRS)
        impl = "gather" if few and (pairs is not None or not cpu) else "grouped"
    gate, up, down = stacks
    if impl == "dense":
        every = jnp.arange(num_experts, dtype=jnp.int32)
        g = jnp.einsum("th,ehi->tei", x, read(gate, every))
        u = jnp.einsum("th,ehi->tei", x, read(up, every))
        y = jnp.einsum("tei,eih->teh", act(g) * u, read(down, every))
        scatter = jnp.zeros((t, num_experts), x.dtype).at[jnp.arange(t)[:, None], ids].add(weights)
        return jnp.einsum("teh,te->th", y, scatter).astype(x.dtype)
    if impl == "gather":
        if pairs is None:
            pairs = functools.partial(_gathered, read=read)
        g = pairs(x, gate, ids).astype(x.dtype)
        u = pairs(x, up, ids).astype(x.dtype)
        y = pairs(act(g) * u, down, ids).astype(x.dtype)
        # the weighted sum as a contraction: XLA:CPU hands `sum(y * w, axis=1)` to YNNPACK,
        # which took 148 us for one token's [1, 8, 2048] (the einsum 7 us; 30B-A3B's decode
        # step, 12 layers: 1.7 of 34 ms)
        return jnp.einsum("tkh,tk->th", y, weights).astype(x.dtype)
    if impl != "grouped":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if dot is None:
        dot = lambda x, w, e: x @ read(w, e[None])[0]  # noqa: E731
    return _grouped(x, weights, ids, stacks, dot, act, num_experts)


def _gathered(x: jax.Array, w: Any, ids: jax.Array, *, read: Any) -> jax.Array:
    """`dot_pairs`' products by `read`'s experts gathered: a vector times a matrix a pair (t
    and k batch dimensions, float32 sums as a GEMM's), which XLA makes a multiply and reduce
    reading the gathered experts in place (a GEMM over "th,tkhi" wrote the gathered gate and
    up out first)."""
    t, k = ids.shape
    xs = x if x.ndim == 3 else jnp.broadcast_to(x[:, None, :], (t, k, x.shape[-1]))
    return jnp.einsum("tkh,tkhi->tki", xs, read(w, ids), preferred_element_type=jnp.float32)


def _grouped(
    x: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    stacks: tuple[Any, Any, Any],
    dot: Any,
    act: Any,
    num_experts: int,
) -> jax.Array:
    """The pairs sorted by expert, each expert's padded to whole tiles of `TILE` rows: a
    tile's rows one expert's, its weights read once a tile (`dot`)."""
    t, k = ids.shape
    pairs = t * k
    tiles = -(-pairs // TILE) + min(num_experts, pairs)  # every group's padding at most
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    padded = -(-counts // TILE) * TILE
    end = jnp.cumsum(padded)
    start = end - padded
    first = jnp.cumsum(counts) - counts  # each group's first place in `order`
    by_expert = flat[order]
    dest = start[by_expert] + jnp.arange(pairs, dtype=jnp.int32) - first[by_expert]
    # the pair each row holds (`pairs`: padding)
    rows = jnp.full(tiles * TILE, pairs, jnp.int32).at[dest].set(order.astype(jnp.int32))
    tile_expert = jnp.searchsorted(end, jnp.arange(tiles) * TILE, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1).astype(jnp.int32)
    token = jnp.minimum(rows // k, t - 1).reshape(tiles, TILE)
    scale = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[rows]
    gate, up, down = stacks

    used = end[-1] // TILE  # tiles holding pairs: those past them (padding) are skipped
    # (on a CPU alone: a GPU would evaluate each tile's condition on the host)
    skip = jax.default_backend() == "cpu"

    def one(c: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        i, tok, e = c
        xs = x[tok]  # [TILE, hidden]

        def run(xs: jax.Array) -> jax.Array:
            return dot(act(dot(xs, gate, e)) * dot(xs, up, e), down, e)

        return lax.cond(i < used, run, jnp.zeros_like, xs) if skip else run(xs)

    every = jnp.arange(tiles, dtype=jnp.int32)
    y = lax.map(one, (every, token, tile_expert)).reshape(tiles * TILE, -1)
    y = y * scale[:, None]
    out = jnp.zeros_like(x).at[rows // k].add(y, mode="drop")
    return out.astype(x.dtype)


def _expert_parallel(
    x: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    stacks: tuple[Any, Any, Any],
    index: jax.Array | None,
    act: Any,
    m: MoEConfig,
    mesh: Mesh,
    impl: str | None,
) -> jax.Array:
    """Each device its own experts' share of every token's sum (the others' pairs weighed
    0), the shares added across devices."""
    local = m.num_experts // mesh.size
    held = [quant.held(w)[0] if isinstance(w, quant.QuantWeight) else (w[...],) for w in stacks]
    forms = [w if isinstance(w, quant.QuantWeight) else None for w in stacks]
    if any(isinstance(w, quant.MixedWeight) for w in stacks):
        raise ValueError("expert parallelism holds one form an expert stack")
    counts = [len(h) for h in held]
    flat = [a for h in held for a in h]
    specs = [P(*([None] * (a.ndim - 3)), sharding.AXIS, None, None) for a in flat]
    layer = jnp.int32(0) if index is None else index

    def shard(
        x: jax.Array, w: jax.Array, ids: jax.Array, layer: jax.Array, *arrays: jax.Array
    ) -> jax.Array:
        mine = ids - lax.axis_index(sharding.AXIS) * local
        inside = (mine >= 0) & (mine < local)
        w = jnp.where(inside, w, jnp.zeros_like(w))
        mine = jnp.where(inside, mine, 0)
        it = iter(arrays)
        parts = [tuple(next(it) for _ in range(n)) for n in counts]

        def read(stack: Any, sel: jax.Array) -> jax.Array:
            i = next(j for j, s in enumerate(stacks) if s is stack)
            p = parts[i]
            picked = tuple(a[sel] if a.ndim == 3 else a[layer, sel] for a in p)
            if forms[i] is None:
                return picked[0].astype(x.dtype)
            return quant.dense(quant.one_level(picked, -2), -2, x.dtype)

        y = experts(x, w, mine, stacks, read, act, local, impl)
        return lax.psum(y, sharding.AXIS)

    run = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(), *specs),
        out_specs=P(),
        check_vma=False,
    )
    return run(x, weights, ids, layer, *flat)


def moe_config(hf: dict, num_layers: int) -> MoEConfig:
    """A Hugging Face config.json's experts (`Qwen3MoeConfig`'s defaults)."""
    return MoEConfig(
        num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 128))),
        top_k=int(hf.get("num_experts_per_tok", 8)),
        intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse_layers(hf, num_layers),
    )
