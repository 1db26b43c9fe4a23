"""What the jitted step programs are, read from XLA's own dump, and how the host drives them.

The step's GPU rules (docs/development.md, "The GPU rules"), pinned on CPU: no op copies a
layer of the KV pool, no device-side conditional, float32 dots in IEEE float32; one transfer
each way per step; the host dispatches step N + 1 before it reads step N's tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from flax import nnx

from jpaged import LLM, SamplingParams, models
from jpaged.engine import programs
from jpaged.engine import runner as runner_mod
from jpaged.engine.buckets import Shape
from jpaged.engine.contract import StepResult
from jpaged.engine.interface import PromptRequest
from jpaged.engine.runner import Pending, Runner

# Small enough to compile fast; the pool is big enough that nothing else in a step
# (logits, gathered pages) reaches one of its layers, so a layer-sized array is a copy.
WORKLOAD = """
import json, sys
import jpaged
from jpaged import models
from jpaged import SamplingParams as P
model = models.load(sys.argv[1], dtype="float32")
common = dict(dtype="float32", warmup=False, compilation_cache_dir=None, block_size=4,
              max_batch_size=4, max_num_batched_tokens=64)
prompts = [[5, 17, 99, 3], list(range(30, 53)), [200, 7], list(range(7, 16))]
params = [P(max_tokens=6, temperature=0, ignore_eos=True),
          P(max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, seed=1, ignore_eos=True),
          P(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True),
          P(max_tokens=4, temperature=0.7, logprobs=2, seed=2, ignore_eos=True)]
paged = jpaged.LLM(model, backend="paged", num_blocks=4096, max_seq_len=64, **common)
paged.generate(prompts, params)
paged.generate([list(range(40, 50))], P(max_tokens=4, temperature=0.9, n=3, seed=3))
# prompt logprobs: the step variants that score prompt tokens (with and without alternatives)
for k in (0, 3):
    paged.generate([list(range(60, 90))], P(max_tokens=2, temperature=0, prompt_logprobs=k))
contiguous = jpaged.LLM(model, backend="contiguous", max_seq_len=4096, **common)
contiguous.generate(prompts, params)
# 1-byte values: a layer of their scales outgrows the others' value layers, so a copy of
# the scales is caught too
int8 = jpaged.LLM(model, backend="paged", num_blocks=32768, max_seq_len=64,
                  kv_cache_dtype="int8", **common)
int8.generate(prompts, params)
pools = {name: llm.engine.runner.kv.k.shape for name, llm in
         (("paged", paged), ("contiguous", contiguous))}
print(json.dumps(pools))
"""
STEP_MODULES = re.compile(r"\.jit__(step|sample)\.|\.jit_copy_blocks\.")
VIEWS = {"parameter", "bitcast", "reshape", "tuple", "get-tuple-element"}
IN_PLACE = {"scatter", "dynamic-update-slice"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _split_shape(rest: str) -> tuple[str, str]:
    """'f32[2,3]{1,0} dot(...)' -> ('f32[2,3]{1,0}', 'dot(...)'); tuple shapes too."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def instructions(text: str) -> Iterator[tuple[str, str, str, str]]:
    """(name, shape, opcode, the rest) of every instruction of an HLO text module."""
    for line in text.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        shape, tail = _split_shape(m.group(2))
        opcode = tail.split("(", 1)[0]
        yield m.group(1), shape, opcode, tail


def elements(shape: str) -> int:
    m = re.match(r"^\w+\[([\d,]*)\]", shape)
    if not m:
        return 0  # a tuple or a token
    return int(np.prod([int(d) for d in m.group(1).split(",") if d]))


def leading(dims: str) -> bool:
    """'0, 1,3' -> whether the dimensions are 0, 1, ... in order. XLA on GPU brings the
    indexed dimensions of a gather or scatter to the front of the operand first: a
    transpose of the whole pool, and back, unless they are there already."""
    numbers = [int(d) for d in re.findall(r"\d+", dims)]
    return numbers == list(range(len(numbers)))


def check_module(text: str, layer_elements: int) -> list[str]:
    """What breaks the GPU rules in one module: layer-sized copies (also those XLA on GPU
    makes of a gather's or scatter's operand), conditionals, f32 dots without HIGHEST."""
    problems, shapes = [], {}
    for name, shape, opcode, tail in instructions(text):
        shapes[name] = shape
        inside = tail[tail.find("(") + 1 : tail.find(")")]
        operands = [o.split()[-1].lstrip("%") for o in inside.split(",") if o.strip()]
        if opcode == "conditional":
            problems.append(f"{name}: a device-side conditional")
        if elements(shape) >= layer_elements and opcode not in VIEWS | IN_PLACE:
            problems.append(f"{name}: {opcode} makes {shape}, a pool layer or more")
        index_map = re.search(
            r"(?:scatter_dims_to_operand_dims|start_index_map)=\{([\d,]*)\}", tail
        )
        pool_operand = operands and elements(shapes.get(operands[0], "")) >= layer_elements
        if index_map and pool_operand and not leading(index_map.group(1)):
            problems.append(f"{name}: {opcode} indexes the pool at {index_map.group(0)}")
        if opcode == "dot":
            kinds = {shapes.get(o, "?").split("[", 1)[0] for o in operands[:2]}
            if kinds == {"f32"} and "operand_precision={highest,highest}" not in tail:
                problems.append(f"{name}: float32 dot without precision HIGHEST")
    return problems


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_step_programs_copy_no_pool_layer_branch_nowhere_and_keep_float32(
    tmp_path, tiny_checkpoint, family
):
    """gemma3: sliding-window layers in KV groups of their own, each layer reading its
    group's page tables (a pool of one-layer blocks: the smallest layer to catch)."""
    dump = tmp_path / "dump"
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
        "JAX_ENABLE_COMPILATION_CACHE": "false",
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKLOAD), str(tiny_checkpoint(family))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    pools = json.loads(out.stdout.strip().splitlines()[-1])
    layer = min(int(np.prod(shape[1:])) for shape in pools.values())
    files = sorted(p for p in dump.glob("*before_optimizations.txt") if STEP_MODULES.search(p.name))
    names = {STEP_MODULES.search(p.name).group(0) for p in files}  # type: ignore[union-attr]
    assert names == {".jit__step.", ".jit__sample.", ".jit_copy_blocks."}, names
    assert len(files) > 10
    problems = {p.name: check_module(p.read_text(), layer) for p in files}
    assert not {k: v for k, v in problems.items() if v}
    # XLA's copy insertion, after optimizations: a loop that reads the pool without
    # carrying it makes XLA copy the whole pool first
    optimized = [p for p in dump.glob("*after_optimizations.txt") if STEP_MODULES.search(p.name)]
    assert len(optimized) == len(files)
    copies = {
        p.name: [
            f"{name}: {shape}"
            for name, shape, opcode, _ in instructions(p.read_text())
            if opcode.startswith("copy") and elements(shape) >= layer
        ]
        for p in optimized
    }
    assert not {k: v for k, v in copies.items() if v}


def test_the_checker_finds_what_it_looks_for():
    """The three patterns, as JAX lowers them, are caught (so the test above can fail)."""
    import jax.numpy as jnp
    from jax import lax

    def bad(pool, layer, x):
        page = pool[layer]  # a layer-sized dynamic slice
        y = lax.cond(x.sum() > 0, lambda: x @ x, lambda: x)
        pool = pool.at[layer, 3, :, 1].set(1.0)  # (layer, block, offset): not leading
        return page.sum() + y.sum(), pool

    pool = jnp.zeros((2, 64, 4, 4, 16))
    lowered = jax.jit(bad).lower(pool, 1, jnp.ones((4, 4)))
    found = " ".join(check_module(lowered.as_text(dialect="hlo"), 64 * 4 * 4 * 16))
    assert "dynamic-slice" in found and "conditional" in found and "HIGHEST" in found
    assert "scatter indexes the pool" in found
    found = " ".join(mlir_problems(lowered.as_text(), 64 * 4 * 4 * 16)[0])
    assert "dynamic_slice" in found and "stablehlo.case" in found and "HIGHEST" in found
    assert "stablehlo.scatter indexes the pool" in found

    def loop_reads_pool(pool, ids, n):  # a loop over pages that does not carry the pool
        def layer(pool, i):
            pool = pool.at[i, ids[0]].set(pool[i, ids[0]] + 1.0)
            flat = pool.reshape(-1, *pool.shape[2:])
            pages = lambda j, acc: acc + flat[lax.dynamic_slice(ids, (j,), (4,)) + i * 64].sum(0)
            return pool, lax.fori_loop(0, n, pages, jnp.zeros(pool.shape[2:]))

        return lax.scan(layer, pool, jnp.arange(2))

    ids = jnp.arange(8, dtype=jnp.int32)
    optimized = jax.jit(loop_reads_pool, donate_argnums=0).lower(pool, ids, 3).compile().as_text()
    assert any(
        opcode.startswith("copy") and elements(shape) >= 64 * 4 * 4 * 16
        for _, shape, opcode, _ in instructions(optimized)
    )


# The step as a GPU compiles it: the Pallas kernel, exported for cuda (lowering only, so
# it runs here), checked on its StableHLO with the same rules.
# loops, calls and shard_map regions (tensor parallelism) carry the pool through
MLIR_VIEWS = {"stablehlo.reshape", "stablehlo.while", "func.call", "sdy.manual_computation"}
MLIR_IN_PLACE = {"stablehlo.scatter", "stablehlo.dynamic_update_slice"}


def mlir_problems(text: str, layer_elements: int) -> tuple[list[str], set[str]]:
    """(what breaks the GPU rules, every op name) in a StableHLO module."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    problems, names = [], set()

    def walk(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner.operation)
                    walk(inner.operation)

    def visit(op: ir.Operation) -> None:
        names.add(op.name)
        if op.name in ("stablehlo.case", "stablehlo.if"):
            problems.append(f"{op.name}: a device-side conditional")
        # a kernel's outputs that alias its operands are written in place (the Pallas
        # kernel writing the step's K/V into the pools)
        aliases = (
            str(op.attributes["output_operand_aliases"])
            if op.name == "stablehlo.custom_call" and "output_operand_aliases" in op.attributes
            else ""
        )
        aliased = {int(i) for i in re.findall(r"output_tuple_indices = \[(\d+)\]", aliases)}
        for i, result in enumerate(op.results):
            shape = getattr(result.type, "shape", ())
            in_place = op.name in MLIR_VIEWS | MLIR_IN_PLACE or i in aliased
            if int(np.prod(shape)) >= layer_elements and not in_place:
                problems.append(f"{op.name} makes {result.type}, a pool layer or more")
        dims = {
            "stablehlo.scatter": "scatter_dimension_numbers",
            "stablehlo.gather": "dimension_numbers",
        }
        if (
            op.name in dims
            and int(np.prod(getattr(op.operands[0].type, "shape", ()))) >= layer_elements
        ):
            index_map = re.search(
                r"(?:scatter_dims_to_operand_dims|start_index_map) = \[([\d, ]*)\]",
                str(op.attributes[dims[op.name]]),
            )
            if index_map and not leading(index_map.group(1)):
                problems.append(f"{op.name} indexes the pool at {index_map.group(0)}")
        if op.name == "stablehlo.dot_general":
            f32 = all(str(o.type).endswith("xf32>") for o in op.operands)
            precision = (
                str(op.attributes["precision_config"])
                if "precision_config" in op.attributes
                else ""
            )
            if f32 and precision.count("HIGHEST") != 2:
                problems.append(f"float32 dot_general without precision HIGHEST: {precision}")

    with mlir.make_ir_context():
        walk(ir.Module.parse(text).operation)
    return problems, names


@pytest.mark.parametrize(
    "family,dtype,kv_cache_dtype",
    [
        ("llama", "float32", "auto"),
        ("llama", "bfloat16", "auto"),
        ("llama", "bfloat16", "int8"),
        ("llama", "bfloat16", "fp8_e4m3"),
        ("llama", "bfloat16", "fp8_e5m2"),
        ("gemma3", "bfloat16", "auto"),
    ],
)
def test_gpu_step_hands_the_whole_pool_to_the_kernel(
    tiny_checkpoint, monkeypatch, family, dtype, kv_cache_dtype
):
    """1-byte pools too: their pages reach the kernel as stored (a dequantized layer would
    be a layer-sized array). gemma3: KV groups, each layer handing the kernel its group's
    tables."""
    from jpaged.cache import kv_pool
    from jpaged.cache.groups import KVGroups
    from jpaged.kernels import ragged_attention

    monkeypatch.setattr(ragged_attention, "on_gpu", lambda: True)  # the Triton kernel
    monkeypatch.setattr(kv_pool, "_storage_dtype", lambda d: d)  # bf16 as it is on a GPU
    model = models.load(str(tiny_checkpoint(family)), dtype=dtype)
    c, num_blocks, block_size = model.config, 512, 16
    groups = KVGroups.of(c.num_layers, c.sliding_layers, c.sliding_window)
    assert groups.num_groups == (7 if family == "gemma3" else 1)
    kv = kv_pool.create(
        num_layers=groups.size,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    # 64 pages: two of the kernel's chunks here, so the kernel splits them (and merges in XLA)
    shape = Shape(tokens=64, seqs=8, width=64, impl="pallas", groups=groups.num_groups)
    exported = jax.export.export(
        programs.step_fn,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(
        nnx.to_pure_dict(nnx.state(model.model)),
        kv,
        jax.numpy.zeros(16, np.int32),
        jax.numpy.zeros(shape.size(), np.int32),
        jax.numpy.zeros((shape.sample_rows, c.vocab_size), np.float32),
        graphdef=programs.Static(nnx.graphdef(model.model)),
        impl="pallas",
        shape=shape,
        groups=groups,
    )
    layer = num_blocks * c.num_kv_heads * block_size * c.head_dim
    problems, names = mlir_problems(exported.mlir_module(), layer)
    assert not problems
    # float pools are written by the kernel itself, 1-byte ones quantized and scattered
    assert "stablehlo.custom_call" in names
    assert ("stablehlo.scatter" in names) == (kv_cache_dtype != "auto")
    # (the split count follows the KV heads: tiny Gemma's one head gets more)
    assert re.search(r"grid_z = [2-9] : i32", exported.mlir_module())


# ------------------------------------------------------------------------- transfers


SMALL = dict(dtype="float32", max_seq_len=64, max_batch_size=4, block_size=4)


def test_one_transfer_each_way_per_step(model, monkeypatch):
    # no prefix cache: the second pass must run the first's token buckets, nothing new
    llm = LLM(model, max_num_batched_tokens=128, warmup=False, enable_prefix_caching=False, **SMALL)
    prompts = [[1, 2, 3], list(range(9, 20)), [4] * 5]
    params = [
        SamplingParams(max_tokens=6, temperature=0.5 * i, logprobs=i, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    llm.generate(prompts, params)  # compiles what the pass below runs
    compilations = llm.stats()["compilations"]
    # the runner's transfers: inputs put (`_arg`: as NumPy, into the jitted call) and
    # results read (`collect`); explicit ones would go through jax.device_put / device_get
    counts = {"put": 0, "get": 0, "explicit": 0}
    runner = llm.engine.runner

    def counting(fn, key):  # noqa: ANN001, ANN202
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[key] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(runner, "_arg", counting(runner._arg, "put"))
    monkeypatch.setattr(runner, "collect", counting(runner.collect, "get"))
    for name in ("device_put", "device_get"):
        monkeypatch.setattr(runner_mod.jax, name, counting(getattr(jax, name), "explicit"))
    engine = llm.engine
    for prompt, p in zip(prompts, params, strict=True):
        engine.add(engine.prepare(PromptRequest(prompt, p)))
    steps = []
    with jax.transfer_guard("disallow"):  # any transfer but those the runner allows raises
        while engine.has_unfinished():
            before = dict(counts)
            engine.step()
            steps.append(tuple(counts[k] - before[k] for k in counts))
    # one prefill call for the three prompts, then one decode call per step, then the last
    # step only reads the tokens of the one before
    assert len(steps) == 7 and all(put <= 1 and get <= 1 for put, get, _ in steps), steps
    assert sum(s[0] for s in steps) == sum(s[1] for s in steps) == 6
    assert sum(s[2] for s in steps) == 0
    assert llm.stats()["compilations"] == compilations


def test_a_bucket_writes_its_logits_where_its_last_ones_lay(model):
    """What keeps a CUDA graph's nodes where they were recorded (`programs.step_fn`): a
    bucket's logits, and XLA's temporaries with them, in one buffer from call to call."""
    llm = LLM(model, warmup=False, enable_prefix_caching=False, **SMALL)
    engine = llm.engine
    engine.add(
        engine.prepare(PromptRequest([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
    )
    where = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX's "Some donated buffers were not usable"
        while engine.has_unfinished():
            engine.step()
            spare = engine.runner._spares.get(1)  # a 1-row bucket's
            where.append(None if spare is None else spare.unsafe_buffer_pointer())
    decodes = where[1:]  # after the prefill's bucket
    assert len(decodes) >= 4 and len(set(decodes)) == 1, where


# ------------------------------------------------------------------------- overlap


class SlowDevice:
    """The runner's calls, on a device that takes `seconds` a call: collecting a call waits
    for it to be done. Logs dispatches and collects, in order."""

    def __init__(self, runner: Runner, seconds: float) -> None:
        self.seconds = seconds
        self.log: list[tuple[str, int]] = []
        self.calls = 0
        self._done_at: dict[int, tuple[int, float]] = {}  # id(pending) -> (call, done at)
        self._dispatch, self._collect = runner.dispatch, runner.collect

    def dispatch(self, rows, sample: bool = True) -> Pending:  # noqa: ANN001
        pending = self._dispatch(rows, sample)
        busy_until = max([t for _, t in self._done_at.values()], default=0.0)
        self.calls += 1
        self._done_at[id(pending)] = (
            self.calls,
            max(time.perf_counter(), busy_until) + self.seconds,
        )
        self.log.append(("dispatch", self.calls))
        return pending

    def collect(self, pending: Pending) -> StepResult:
        call, done_at = self._done_at.pop(id(pending))
        threading.Event().wait(max(0.0, done_at - time.perf_counter()))
        self.log.append(("collect", call))
        return self._collect(pending)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_host_dispatches_the_next_step_while_the_device_runs(model, monkeypatch, backend):
    prompts = [[5, 17, 99, 3], list(range(30, 53)), [200], list(range(7, 16)), [42] * 17]
    params = [
        SamplingParams(max_tokens=9, temperature=0),
        SamplingParams(max_tokens=7, temperature=0.9, top_k=50, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, logprobs=2, stop=["zz"]),
        SamplingParams(max_tokens=6, temperature=0.7, seed=5),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    ]
    options = dict(backend=backend, warmup=False, max_num_batched_tokens=32, **SMALL)
    sync = LLM(model, async_scheduling=False, **options).generate(prompts, params)
    llm = LLM(model, **options)
    device = SlowDevice(llm.engine.runner, seconds=0.01)
    monkeypatch.setattr(llm.engine.runner, "dispatch", device.dispatch)
    monkeypatch.setattr(llm.engine.runner, "collect", device.collect)
    overlapped = llm.generate(prompts, params)
    # token for token; a stopped request's extra row can change a step's row bucket, and
    # with it the order of float sums
    for a, b in zip(sync, overlapped, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
        for top_a, top_b in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert top_a.keys() == top_b.keys()
            np.testing.assert_allclose(list(top_a.values()), list(top_b.values()), atol=1e-5)
    # the host dispatched each call before it read the previous one's tokens
    log = device.log
    collected = [call for event, call in log if event == "collect"]
    assert len(collected) >= device.calls - 2
    for call in collected:
        if call < device.calls:
            assert log.index(("dispatch", call + 1)) < log.index(("collect", call)), log
    engine = llm.engine
    assert engine.cache.audit() == [] and engine.stats()["kv_blocks_used"] == 0
