"""The step program as an H100 runs it, compiled on this machine and read from XLA's dump.

XLA compiles for a CUDA GPU without one (deviceless AOT: JAX's CUDA plugin and `ptxas`,
the `[gpu-aot]` extra, and an H100's target proto, `data/h100_sxm.txtpb`): fusion, the
Pallas kernel to PTX for sm_90a, command buffers (CUDA graphs) all run, nothing executes.
What launches cost and what bytes move can then be counted where no GPU is at hand:
fusions a decoder layer, while loops, kernels outside command buffers, weight- or
pool-sized copies, collectives. GEMMs are not autotuned here, so their tiles may differ
from a compile on the card; nothing counted below depends on them.

    ./.gpu-aot.sh                                                 # the plugin, once
    PYTHONPATH=.gpu-aot JAX_PLATFORMS=cpu python -m benchmarks.gpu_structure [--full]
        [--lowering mosaic|both]   # the Pallas kernel under Mosaic GPU (default Triton)

`JAX_PLATFORMS=cpu`: the plugin registers the platform without initialising it (there is
no GPU to find).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jpaged.cache import kv_pool
from jpaged.cache.groups import KVGroups
from jpaged.engine import programs
from jpaged.engine.buckets import Shape
from jpaged.engine.sampling import SamplingArrays
from jpaged.kernels import ragged_attention
from jpaged.models import fused, loader, moe, quant, qwen3_moe, sharding
from jpaged.models.config import ModelConfig
from jpaged.models.gemma3_vision import Gemma3Vision, Gemma3VisionConfig, encode
from jpaged.models.siglip import SiglipConfig

PROTO = Path(__file__).parent / "data" / "h100_sxm.txtpb"

# Real geometries (Llama-3.2-1B, Llama-3.1-8B, Qwen3-30B-A3B); `layers` picks how many are
# compiled.
SHAPES = {
    "1b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    ),
    # Qwen3-30B-A3B's config.json: 48 layers, every one 128 experts of 768, 8 routed a token
    "30b-a3b": qwen3_moe.model_config({
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    }),
}  # fmt: skip

# A copy this large or larger is counted (a weight slice, a merged weight, a pool layer).
BIG_BYTES = 1 << 20
# Fused computations that only move data: a fusion made of these alone is a copy.
MOVES = {
    "parameter", "copy", "concatenate", "slice", "dynamic-slice", "bitcast", "reshape",
    "transpose", "constant", "tuple", "get-tuple-element", "broadcast", "convert",
}  # fmt: skip
# Thunks that hold others (a while's body, a command buffer's kernels)
CONTAINERS = {"kCommandBuffer", "kWhile", "kSequential", "kConditional", "kDynamicSliceFusion"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}  # fmt: skip


@functools.cache
def topology(devices: int = 1) -> Any:
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", target_config=PROTO.read_text(), topology=f"1x1x{devices}"
    )


def available() -> str | None:
    """None when this machine can compile for an H100, else why not."""
    try:
        topology()
    except Exception as e:  # no plugin, no ptxas, a proto this jaxlib cannot read
        return f"{type(e).__name__}: {e}"
    return None


@dataclasses.dataclass
class Structure:
    """What one compiled step program launches, per step (while bodies times their trips)."""

    fusions: int  # fusion kernels (GEMM fusions included; not inside other fusions)
    whiles: int  # while loops
    copies: list[tuple[str, int]]  # (instruction, bytes a step) of copies >= BIG_BYTES
    custom_calls: collections.Counter  # custom-call targets (the Pallas kernel, cuBLAS)
    collectives: int  # collective ops a step
    thunks: collections.Counter  # kernels, copies, custom calls a step, by thunk kind
    outside: int  # of those, launched outside command buffers (CUDA graphs)
    graphs: int  # command buffer launches a step
    conditionals: int
    compile_s: float
    ptx: bool  # the Pallas kernel's PTX is in the dump (compiled for sm_90a)
    # bytes of the weights (and other parameters) each kernel reads, by instruction
    # (`weight_reads`: the attention kernel's pool reads left out)
    reads: dict[str, int] = dataclasses.field(default_factory=dict)
    # (instruction, bytes a step) of fusions that gather rows and write them out >= BIG_BYTES
    # (not copies of a whole weight: a mixture's routed experts, read again by a GEMM)
    gathered: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def copied_bytes(self) -> int:
        return sum(b for _, b in self.copies)

    @property
    def read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def gathered_bytes(self) -> int:
        return sum(b for _, b in self.gathered)


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


def _computations(text: str) -> dict[str, list[str]]:
    """HLO text module -> its computations' instruction lines, by name."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[name]
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            comps[name].append(line)
    return comps


def read_hlo(text: str) -> dict[str, Any]:
    """Counts over the optimized module `text`, each while body weighted by its trips."""
    comps = _computations(text)
    counts: dict[str, Any] = collections.Counter()
    copies: list[tuple[str, int]] = []
    gathered: list[tuple[str, int]] = []
    targets: collections.Counter = collections.Counter()
    loops: list[int] = []

    def split(line: str) -> tuple[str, str]:
        """(result shape, opcode) of an instruction line; tuple shapes whole."""
        rest = line.split("=", 1)[1].strip()
        if rest.startswith("("):
            depth = 0
            for i, ch in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    return rest[: i + 1], rest[i + 1 :].strip().split("(", 1)[0]
        shape, _, tail = rest.partition(" ")
        return shape, tail.split("(", 1)[0]

    def opcode(line: str) -> str:
        return split(line)[1]

    def moves_only(fused: str, also: tuple[str, ...] = ()) -> bool:
        return all(opcode(line) in MOVES or opcode(line) in also for line in comps.get(fused, []))

    def gathers_only(fused: str) -> bool:
        """A fusion that gathers and writes, computing nothing heavier than its indices."""
        ops = {opcode(line) for line in comps.get(fused, [])}
        return "gather" in ops and not ops & {"dot", "reduce", "custom-call", "fusion"}

    def walk(comp: str, times: int) -> None:
        for line in comps.get(comp, []):
            shape, op = split(line)
            name = line.split("=", 1)[0].split()[-1].lstrip("%")
            if op == "fusion":
                counts["fusions"] += times
                called = re.search(r"calls=%?([\w.\-]+)", line)
                if called and moves_only(called.group(1)) and _bytes(shape) >= BIG_BYTES:
                    copies.append((name, _bytes(shape) * times))
                elif (
                    called and gathers_only(called.group(1)) and _bytes(shape) >= BIG_BYTES
                ):  # rows gathered and written out (a mixture's routed experts)
                    gathered.append((name, _bytes(shape) * times))
            elif op == "copy" and _bytes(shape) >= BIG_BYTES:
                copies.append((name, _bytes(shape) * times))
            elif op == "while":
                counts["whiles"] += times
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                loops.append(n)
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                if body:
                    walk(body.group(1), times * n)
                if cond:
                    walk(cond.group(1), times * n)
            elif op == "conditional":
                counts["conditionals"] += times
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                targets[target.group(1) if target else "?"] += times
            elif op.removesuffix("-start") in COLLECTIVES:
                counts["collectives"] += times
            elif op == "call":
                called = re.search(r"to_apply=%?([\w.\-]+)", line)
                if called:
                    walk(called.group(1), times)

    walk("__entry__", 1)
    return {
        **counts,
        "copies": copies,
        "gathered": gathered,
        "custom_calls": targets,
        "trips": loops,
        "weight_reads": weight_reads(comps, split),
    }


# What a kernel reads of an operand it only indexes: the rows these ops take of it
INDEXING = {"gather", "dynamic-slice", "slice"}


def _operands(line: str, op: str) -> list[str]:
    """The operand names of an instruction line of opcode `op`."""
    rest = line.split("=", 1)[1]
    start = rest.index(f" {op}(") + len(op) + 1
    depth, end = 0, len(rest)
    for i in range(start, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[start:end])


def weight_reads(comps: dict[str, list[str]], split: Any) -> dict[str, int]:
    """Bytes each top-level kernel of the entry computation reads of the program's
    parameters (weights, pools), by instruction: an operand a fusion only gathers or
    slices counts the rows taken (a routed expert's, a layer's), any other its whole
    size. The attention kernel's custom call (Triton, Mosaic: it reads the pool's pages of
    the step's sequences, bounded by their context) and bitcasts are left out."""
    entry = comps["__entry__"]
    shapes: dict[str, str] = {}
    aliases: dict[str, str] = {}  # bitcast / get-tuple-element of a parameter -> it
    for line in entry:
        shape, op = split(line)
        name = line.split("=", 1)[0].split()[-1].lstrip("%")
        shapes[name] = shape
        if op == "parameter":
            aliases[name] = name
        elif op in ("bitcast", "get-tuple-element", "reshape"):
            src = _operands(line, op)
            if src and src[0] in aliases:
                aliases[name] = aliases[src[0]]
    reads: dict[str, int] = {}
    for line in entry:
        shape, op = split(line)
        name = line.split("=", 1)[0].split()[-1].lstrip("%")
        if op not in ("fusion", "custom-call"):
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if (
            op == "custom-call"
            and target
            and ("triton" in target.group(1) or "mosaic" in target.group(1))
        ):
            continue
        called = re.search(r"calls=%?([\w.\-]+)", line) if op == "fusion" else None
        body = comps.get(called.group(1), []) if called else []
        params = {}
        for inner in body:
            number = re.search(r"parameter\((\d+)\)", inner)
            if number and split(inner)[1] == "parameter":
                params[int(number.group(1))] = inner.split("=", 1)[0].split()[-1].lstrip("%")
        total = 0
        for j, operand in enumerate(_operands(line, op)):
            if operand not in aliases:
                continue
            full = _bytes(shapes[operand])
            inner_name = params.get(j)
            users = [
                u for u in body
                if inner_name and re.search(rf"%{re.escape(inner_name)}\b", u.split("=", 1)[1])
            ]  # fmt: skip
            if users and all(
                split(u)[1] in INDEXING and _operands(u, split(u)[1])[:1] == [inner_name]
                for u in users
            ):
                total += sum(_bytes(split(u)[0]) for u in users)
            else:
                total += full
        if total:
            reads[name] = total
    return reads


def read_thunks(text: str, trips: list[int]) -> tuple[collections.Counter, int, int]:
    """(leaf thunk kinds, those launched outside command buffers, command buffer launches)
    a step, of a thunk sequence; `trips`: the while loops' trip counts, in order."""
    kinds: collections.Counter = collections.Counter()
    outside = graphs = 0
    stack: list[tuple[int, str, int]] = []  # (indent, kind, times) of the enclosing thunks
    loops = iter(trips)
    for line in text.splitlines():
        m = re.match(r"^(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        times = stack[-1][2] if stack else 1
        if kind == "kWhile":
            times *= next(loops, 1)
        elif kind == "kCommandBuffer":
            graphs += times
        elif kind not in CONTAINERS:
            kinds[kind] += times
            if all(k != "kCommandBuffer" for _, k, _ in stack):
                outside += times
        stack.append((indent, kind, times))
    return kinds, outside, graphs


def compile_dumped(
    fn: Any, args: tuple, kwargs: dict, options: dict[str, Any] | None = None
) -> Structure:
    """Compile `fn(*args, **kwargs)` (abstract args placed on the H100 topology) and read
    the dump of its largest module."""
    cache = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)  # compiled, never looked up
    with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_DUMP_KEEP")) as dump:
        start = time.perf_counter()
        try:
            compiled = fn.lower(*args, **kwargs).compile(
                compiler_options={"xla_dump_to": dump, **(options or {})}
            )
        finally:
            jax.config.update("jax_enable_compilation_cache", cache)
        compile_s = time.perf_counter() - start
        hlo = read_hlo(compiled.as_text())
        # a program without command buffers has no thunk passes to dump after
        seqs = sorted(glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")))
        seqs = seqs or sorted(glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
        thunk_text = max((Path(s).read_text() for s in seqs), key=len, default="")
        if os.environ.get("GPU_DUMP_KEEP"):
            import shutil

            shutil.copytree(dump, dump + ".kept")
        kinds, outside, graphs = read_thunks(thunk_text, hlo["trips"])
        ptx = bool(glob.glob(os.path.join(dump, "*.ptx"))) or "sm_90a" in "".join(
            Path(p).read_text(errors="ignore")[:4096]
            for p in glob.glob(os.path.join(dump, "*triton*"))
        )
    return Structure(
        fusions=hlo.get("fusions", 0),
        whiles=hlo.get("whiles", 0),
        copies=hlo["copies"],
        custom_calls=hlo["custom_calls"],
        collectives=hlo.get("collectives", 0),
        thunks=kinds,
        outside=outside,
        graphs=graphs,
        conditionals=hlo.get("conditionals", 0),
        compile_s=compile_s,
        ptx=ptx,
        reads=hlo["weight_reads"],
        gathered=hlo["gathered"],
    )


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One step program: a model geometry, its weights' form, a token bucket."""

    shape: str = "1b"  # a key of SHAPES
    layers: int = 2  # decoder layers compiled (per-layer counts are differences)
    tokens: int = 1  # the bucket's tokens
    seqs: int = 1  # its sequences: tokens for decode, fewer for a mixed prefill
    width: int = 64  # page-table width (pages a sequence)
    num_blocks: int = 4096
    block_size: int = 16
    dtype: str = "bfloat16"
    quantization: str = "none"  # or "int8", "fp8" (weights)
    kv_cache_dtype: str = "auto"
    devices: int = 1  # tensor parallelism
    fused: bool = True  # q/k/v and gate/up one matrix each (`models.fused`)
    lowering: str = "triton"  # the Pallas kernel's (`ragged_attention.LOWERINGS`)
    # the step and its sampler (greedy) in one program, as a GPU runs a step without
    # penalties, biases, grammar or logprobs (`programs.step_sampled_fn`); False: the step alone
    sampled: bool = True

    def config(self) -> ModelConfig:
        c = SHAPES[self.shape]
        per_layer: dict[str, Any] = {}  # the per-layer tuples cut to `layers`
        if c.sliding_layers:
            per_layer["sliding_layers"] = c.sliding_layers[: self.layers]
        if c.moe is not None:
            moe = dataclasses.replace(c.moe, sparse_layers=c.moe.sparse_layers[: self.layers])
            per_layer["moe"] = moe
        return dataclasses.replace(
            c, num_layers=self.layers, fused_projections=self.fused, **per_layer
        )


def abstract_args(case: StepCase) -> tuple[tuple, dict]:
    c = case.config()
    topo = topology(case.devices)
    mesh = (
        None if case.devices == 1 else Mesh(np.asarray(topo.devices).reshape(-1), (sharding.AXIS,))
    )
    if mesh is not None:
        c = sharding.sharded_config(c, case.devices)
    module = loader.abstract(c, jnp.dtype(case.dtype))
    if case.quantization != "none":
        layout = loader._weight_only_layout(c, case.devices, case.quantization)
        quant.quantize(module, fused.layout(layout, c), case.devices)
    graphdef, state = nnx.split(module)
    on_gpu = SingleDeviceSharding(topo.devices[0])

    def where(spec: PartitionSpec) -> Any:
        return on_gpu if mesh is None else NamedSharding(mesh, spec)

    def placed(w: nnx.Variable) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=where(sharding.spec_of(w)))

    is_weight = lambda x: isinstance(x, nnx.Variable)
    weights = nnx.to_pure_dict(jax.tree.map(placed, state, is_leaf=is_weight))
    pool = jax.eval_shape(
        functools.partial(
            kv_pool.create,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            block_size=case.block_size,
            num_blocks=case.num_blocks,
            dtype=case.dtype,
            kv_cache_dtype=case.kv_cache_dtype,
        )
    )
    pool = jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where(sharding.pool_spec()))
            if a.ndim >= 4
            else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where(PartitionSpec()))
        ),
        pool,
    )
    shape = Shape(case.tokens, case.seqs, case.width, "pallas")
    ring = jax.ShapeDtypeStruct((2 * case.seqs,), jnp.int32, sharding=where(PartitionSpec()))
    packed = jax.ShapeDtypeStruct((shape.size(),), jnp.int32, sharding=where(PartitionSpec()))
    out = jax.ShapeDtypeStruct(
        (shape.sample_rows, c.vocab_size), jnp.float32, sharding=where(PartitionSpec())
    )
    kwargs = dict(
        graphdef=programs.Static(graphdef),
        impl="pallas",
        shape=shape,
        mesh=mesh,
        groups=KVGroups.of(c.num_layers),
    )
    return (weights, pool, ring, packed, out), kwargs


def compile_step(
    case: StepCase, options: dict[str, Any] | None = None, eager: bool = False
) -> Structure:
    """The engine's step program (`programs.step_sampled_fn`, or `programs.step_fn` where not
    `case.sampled`; with `eager` their `enforce_eager` ones) of `case`, compiled for H100s."""
    backend, jax.default_backend = jax.default_backend, lambda: "gpu"
    try:  # traced as on a GPU: the Pallas kernel, bf16 pools, no CPU kernels
        with pallas_lowering(case.lowering):
            args, kwargs = abstract_args(case)
            if case.sampled:
                kwargs |= {"greedy": True, "top": 0}
                program = programs.eager_step_sampled_fn if eager else programs.step_sampled_fn
            else:
                program = programs.eager_step_fn if eager else programs.step_fn
            return compile_dumped(program, args, kwargs, options)
    finally:
        jax.default_backend = backend


@contextlib.contextmanager
def pallas_lowering(lowering: str) -> Any:
    """Steps traced meanwhile take the Pallas kernel's `lowering` (the engine's knob,
    `ragged_attention.pallas_lowering`)."""
    old = os.environ.get("JPAGED_PALLAS_LOWERING")
    if lowering == ragged_attention.pallas_lowering():
        yield
        return
    os.environ["JPAGED_PALLAS_LOWERING"] = lowering
    jax.clear_caches()  # a step traced under the other one is cached on the same arguments
    try:
        yield
    finally:
        if old is None:
            del os.environ["JPAGED_PALLAS_LOWERING"]
        else:
            os.environ["JPAGED_PALLAS_LOWERING"] = old
        jax.clear_caches()


def compile_sampler(rows: int, vocab: int) -> Structure:
    """The engine's sampler (`programs.sample_fn`, greedy) at `rows` rows, compiled for H100s."""
    on_gpu = SingleDeviceSharding(topology().devices[0])
    fields = len(dataclasses.fields(SamplingArrays))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_gpu)  # noqa: E731
    args = (
        spec((rows, vocab), jnp.float32),
        (spec((fields, rows), jnp.int32), spec((), jnp.int32)),
        spec((2 * rows,), jnp.int32),
        None,
        None,
    )
    return compile_dumped(programs.sample_fn, args, {"greedy": True, "top": 0})


def compile_experts(tokens: int, impl: str = "gather", codes: bool = False) -> Structure:
    """One mixture layer's experts (`moe.experts`, `impl`) at `tokens` tokens, Qwen3-30B-A3B's
    geometry (bf16 stacks `[2 layers, E, in, out]` read at a layer index, as the step reads
    them; `codes`: Q8_0's, int8 codes and float16 scales a block of 32), compiled for H100s."""
    c = SHAPES["30b-a3b"]
    assert c.moe is not None
    m, h = c.moe, c.hidden_size
    on_gpu = SingleDeviceSharding(topology().devices[0])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_gpu)  # noqa: E731
    shapes = [(h, m.intermediate_size)] * 2 + [(m.intermediate_size, h)]
    stacks: list[tuple[jax.ShapeDtypeStruct, ...]] = [
        (
            spec((2, m.num_experts, i, o), jnp.int8),
            spec((2, m.num_experts, i // 32, o), jnp.float16),
        )
        if codes
        else (spec((2, m.num_experts, i, o), jnp.bfloat16),)
        for i, o in shapes
    ]

    def layer(
        x: jax.Array, weights: jax.Array, ids: jax.Array, index: jax.Array, stacks: list
    ) -> jax.Array:
        gate, up, down = (
            quant.QuantWeight(s[0], s[1], None, axis=-2, dtype=x.dtype, metadata={})
            if codes
            else s[0]
            for s in stacks
        )
        read = functools.partial(moe.take, layer=index, dtype=x.dtype)
        act = functools.partial(moe.activation, c.hidden_act)
        return moe.experts(x, weights, ids, (gate, up, down), read, act, m.num_experts, impl)

    args = (
        spec((tokens, h), jnp.bfloat16),
        spec((tokens, m.top_k), jnp.bfloat16),
        spec((tokens, m.top_k), jnp.int32),
        spec((), jnp.int32),
        stacks,
    )
    backend, jax.default_backend = jax.default_backend, lambda: "gpu"
    try:
        return compile_dumped(jax.jit(layer), args, {})
    finally:
        jax.default_backend = backend


# Gemma 3 4B-27B's vision half: SigLIP So400m at 896 px, 256 image tokens, the 4B's width
VISION = Gemma3VisionConfig(
    SiglipConfig(1152, 4304, 27, 16, image_size=896, patch_size=14), 2560, 256
)


def compile_vision(images: int, layers: int = VISION.tower.num_layers) -> Structure:
    """The image encoder (`gemma3_vision.encode`, bf16) on `images` images, with
    `layers` tower layers, compiled for H100s."""
    config = dataclasses.replace(VISION, tower=dataclasses.replace(VISION.tower, num_layers=layers))
    on_gpu = SingleDeviceSharding(topology().devices[0])
    module = nnx.eval_shape(lambda: Gemma3Vision(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    placed = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu), nnx.to_pure_dict(state)
    )
    size = config.tower.image_size
    pixels = jax.ShapeDtypeStruct((images, 3, size, size), jnp.float32, sharding=on_gpu)
    backend, jax.default_backend = jax.default_backend, lambda: "gpu"
    try:
        return compile_dumped(encode, (graphdef, placed, pixels), {})
    finally:
        jax.default_backend = backend


@dataclasses.dataclass
class Counted:
    """A step program's counts at its model's full depth, from two shallow compiles."""

    case: StepCase
    layer: dict[str, float]  # what one decoder layer adds
    step: dict[str, float]  # the whole step at the model's real number of layers
    shallow: Structure  # the compile of `case` itself


COUNTS = (
    "fusions", "copied_bytes", "collectives", "outside", "graphs", "whiles", "read_bytes",
    "gathered_bytes",
)  # fmt: skip


def count(case: StepCase, options: dict[str, Any] | None = None) -> Counted:
    """`case` and one layer more compiled: a layer's counts are their difference, the real
    depth's are extrapolated (every layer compiles alike)."""
    a = compile_step(case, options)
    b = compile_step(dataclasses.replace(case, layers=case.layers + 1), options)
    depth = SHAPES[case.shape].num_layers - case.layers
    layer = {k: getattr(b, k) - getattr(a, k) for k in COUNTS}
    step = {k: getattr(a, k) + depth * layer[k] for k in COUNTS}
    return Counted(case, layer, step, a)


CASES = {
    "1b-1 (1B decode, 1 user)": StepCase(tokens=4, seqs=4),
    "1b-256 (256 users)": StepCase(tokens=256, seqs=256),
    "1b-prefill (512 tokens, 8 sequences)": StepCase(tokens=512, seqs=8),
    "1b-int8 (int8 weights, 1 user)": StepCase(tokens=4, seqs=4, quantization="int8"),
    "1b-fp8 (fp8 weights, 1 user)": StepCase(tokens=4, seqs=4, quantization="fp8"),
    "8b-1 (8B decode, 1 user)": StepCase(shape="8b", tokens=4, seqs=4),
    "8b-256 (256 users)": StepCase(shape="8b", tokens=256, seqs=256),
    "8b-tp8 (8 GPUs, 1 user)": StepCase(shape="8b", tokens=4, seqs=4, devices=8),
    "30b-a3b-4 (Qwen3-30B-A3B decode, 4 tokens)": StepCase(shape="30b-a3b", tokens=4, seqs=4),
    "30b-a3b-256 (256 users)": StepCase(shape="30b-a3b", tokens=256, seqs=256),
}


def floor_bytes(case: StepCase) -> tuple[int, int]:
    """(the routed experts' bytes, every other weight's) a step of `case` at its model's
    depth must read at least: each layer's distinct routed experts (at most `tokens * k`),
    attention's and the router's matrices, the LM head (the embedding rows are noise)."""
    c = SHAPES[case.shape]
    size = jnp.dtype(case.dtype).itemsize
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (2 * q + 2 * kv)
    head = c.vocab_size * c.hidden_size
    if c.moe is None:
        mlp = 3 * c.hidden_size * c.intermediate_size
        return 0, size * (c.num_layers * (attention + mlp) + head)
    m = c.moe
    experts = min(case.tokens * m.top_k, m.num_experts)
    routed = c.num_layers * experts * 3 * c.hidden_size * m.intermediate_size
    rest = c.num_layers * (attention + m.num_experts * c.hidden_size) + head
    return size * routed, size * rest


def moe_table(rows: list[tuple[str, Counted]]) -> str:
    """What a mixture's step reads of its weights against what it must (`floor_bytes`)."""
    lines = [
        "| step program | weight bytes read a step (GiB) | routed experts' (GiB) "
        "| attention, router, LM head (GiB) | read / (routed + rest) "
        "| routed experts gathered and written out (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in rows:
        routed, rest = floor_bytes(c.case)
        read = c.step["read_bytes"]
        if c.step["whiles"]:  # (reads inside a loop's body are not counted)
            lines.append(f"| {name} | not counted: {c.step['whiles']:.0f} while loops | ... |")
            continue
        lines.append(
            f"| {name} | {read / 2**30:.2f} | {routed / 2**30:.2f} | {rest / 2**30:.2f} "
            f"| {read / (routed + rest):.2f}x | {c.step['gathered_bytes'] / 2**30:.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[tuple[str, Counted]]) -> str:
    lines = [
        "| step program | fusions a layer | while loops | weight/pool copies a step (MiB) "
        "| kernels outside CUDA graphs a step | graph launches | Pallas kernels "
        "| collectives a layer | compile s (shallow) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in rows:
        s = c.shallow
        pallas = s.custom_calls.get("__gpu$xla.gpu.triton", 0) + s.custom_calls.get(
            "mosaic_gpu_v2", 0
        )
        lines.append(
            f"| {name} | {c.layer['fusions']:.0f} | {c.step['whiles']:.0f} "
            f"| {c.step['copied_bytes'] / 2**20:,.0f} | {c.step['outside']:.0f} "
            f"| {c.step['graphs']:.0f} | {pallas} ({c.case.layers} layers) "
            f"| {c.layer['collectives']:.0f} | {s.compile_s:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases", default=",".join(k.split()[0] for k in CASES), help="e.g. 1b-1,8b-256"
    )
    p.add_argument("--one-token", action="store_true", help="decode in a 1-token bucket")
    p.add_argument(
        "--full", action="store_true", help="also time a whole 1B step program's compile"
    )
    p.add_argument(
        "--vision", action="store_true", help="also Gemma 3's image encoder (1 and 4 images)"
    )
    p.add_argument(
        "--lowering",
        choices=(*ragged_attention.LOWERINGS, "both"),
        default="triton",
        help="the Pallas kernel's GPU lowering (both: a row each)",
    )
    args = p.parse_args()
    rows = []
    names = {k.split()[0]: k for k in CASES}
    lowerings = ragged_attention.LOWERINGS if args.lowering == "both" else (args.lowering,)
    for name in (names[n] for n in args.cases.split(",")):
        for lowering in lowerings:
            case = dataclasses.replace(CASES[name], lowering=lowering)
            if args.one_token and case.tokens == 4:
                case = dataclasses.replace(case, tokens=1, seqs=1)
            rows.append((f"{name} [{lowering}]" if len(lowerings) > 1 else name, count(case)))
    print(table(rows))
    mixtures = [(n, c) for n, c in rows if SHAPES[c.case.shape].moe is not None]
    if mixtures:
        print(moe_table(mixtures))
    if args.vision:
        for images in (1, 4):
            v = compile_vision(images)
            print(
                f"Gemma 3 image encoder, {images} image(s), 27 layers: {v.fusions} fusions, "
                f"{v.whiles} while loops, {v.graphs} CUDA graphs, {v.outside} kernels "
                f"outside them, {v.copied_bytes / 2**20:,.0f} MiB copied, "
                f"compile {v.compile_s:.1f} s"
            )
    if args.full:
        for tokens in (4, 256):
            s = compile_step(StepCase(layers=16, tokens=tokens, seqs=tokens))
            print(f"whole 1B step ({tokens} tokens, 16 layers): compile {s.compile_s:.1f} s")


if __name__ == "__main__":
    main()
