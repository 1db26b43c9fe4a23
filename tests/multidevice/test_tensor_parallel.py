"""Tensor parallelism on 8 fake CPU devices: the same tokens as one device, 1/N of the memory.

Needs `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts, so the
suite runs this module in a subprocess (tests/integration/test_tensor_parallel.py);
collected in the main process it skips.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jpaged
from jpaged import SamplingParams, models
from jpaged.engine import programs
from jpaged.engine.buckets import Shape
from jpaged.models import sharding

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: tests/integration/test_tensor_parallel.py"
)

# Few, small programs: compiling is most of this module's time.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_seq_len=64,
    max_batch_size=4,
    max_num_batched_tokens=8,
    warmup=False,
    compilation_cache_dir=None,
)
SHARED = [40, 41, 42, 43, 44, 45, 46, 47]  # two full blocks
PROMPTS = [[5, 17, 99, 3], list(range(30, 43)), [*SHARED, 9], [200, 7]]
LATER = [*SHARED, 60, 61]  # after the others: a prefix-cache hit
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# n > 1 forks sequences (copy-on-write on every device); greedy, so each choice is
# the n = 1 answer
PARAMS = [GREEDY, GREEDY, GREEDY, dataclasses.replace(GREEDY, n=2)]
# tiny configs as the test suite builds them; llama with 8 heads so N = 8 splits it (N = 4
# on llama's paged engine: the LoRA, collectives and server-split tests, and
# `assert_split` after the contiguous test)
FAMILIES = {
    "llama": ({"num_attention_heads": 8, "num_key_value_heads": 8}, (2, 8)),
    "qwen3": ({}, (4,)),  # 2 KV heads: N = 4 keeps a copy of one on each device
    "gemma3": ({}, (2,)),  # 1 KV head, sliding layers, soft caps
}
CASES = [(family, n) for family, (_, ns) in FAMILIES.items() for n in ns]
_references: dict[str, tuple[list[list[list[int]]], jpaged.LLM]] = {}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda family: tiny_checkpoint(family, **FAMILIES[family][0])


def run(llm: jpaged.LLM) -> list[list[list[int]]]:
    """Token ids of every choice of every prompt, LATER's last."""
    outs = [*llm.generate(PROMPTS, PARAMS), *llm.generate([LATER], GREEDY)]
    return [[c.token_ids for c in out.choices] for out in outs]


def reference(family: str, path: Path) -> tuple[list[list[list[int]]], jpaged.LLM]:
    """One device's tokens, and its engine."""
    if family not in _references:
        llm = jpaged.LLM(models.load(path, dtype="float32"), **ENGINE)
        _references[family] = run(llm), llm
        tokens = {t for out in _references[family][0] for choice in out for t in choice}
        assert len(tokens) >= 4, "outputs too uniform to tell two runs apart"
    return _references[family]


def per_device_bytes(array: jax.Array) -> list[int]:
    return [shard.data.nbytes for shard in array.addressable_shards]


def lies(array: jax.Array, spec: PartitionSpec) -> bool:
    """Whether `array` is split over its mesh as `spec` says."""
    expected = NamedSharding(array.sharding.mesh, spec)
    return array.sharding.is_equivalent_to(expected, array.ndim)


def assert_split(state: nnx.State, stepped: dict, kv: Any, n: int) -> None:
    """Every big weight and the pool are 1/N on each device, as the module's partition
    specs say; only norms and the output biases of row-parallel layers are whole on every
    device. `stepped`, what the step takes, is the module's weights themselves."""
    assert all(
        a is b for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(state), strict=True)
    )
    whole = set()
    for path, w in nnx.to_flat_state(state):
        key, value = ".".join(map(str, path)), w[...]
        assert isinstance(value.sharding, NamedSharding), key
        assert lies(value, sharding.spec_of(w)), key
        assert len(value.addressable_shards) == n, key
        if value.sharding.is_fully_replicated:
            whole.add(key)
        else:
            assert per_device_bytes(value) == [value.nbytes // n] * n, key
    assert whole <= {
        "final_norm.scale",
        "layers.attn_norm.scale",
        "layers.mlp_norm.scale",
        "layers.post_attn_norm.scale",
        "layers.post_mlp_norm.scale",
        "layers.attn.q_norm.scale",
        "layers.attn.k_norm.scale",
        "layers.attn.o.bias",
        "layers.mlp.down.bias",
    }
    for pool in (kv.k, kv.v):
        assert lies(pool, sharding.pool_spec())
        assert per_device_bytes(pool) == [pool.nbytes // n] * n


@pytest.mark.parametrize(("family", "n"), CASES)
def test_split_model_generates_the_single_device_tokens(checkpoint, family, n):
    path = checkpoint(family)
    expected, single = reference(family, path)
    model = models.load(path, dtype="float32", tensor_parallel=n)  # loaded straight into shards
    llm = jpaged.LLM(model, tensor_parallel=n, **ENGINE)
    assert llm.engine.model.model is model.model  # not moved again
    assert llm.engine.mesh is model.mesh  # nor a second mesh built
    kv = llm.engine.runner.kv
    pointers = [s.data.unsafe_buffer_pointer() for s in kv.k.addressable_shards]
    assert run(llm) == expected
    stats = llm.engine.stats()
    assert stats["kv_prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0
    runner = llm.engine.runner
    assert_split(nnx.state(llm.model), runner.state, runner.kv, n)
    # the steps donated the pool: every device updated its shard where it lies
    assert [s.data.unsafe_buffer_pointer() for s in runner.kv.k.addressable_shards] == pointers
    one_device = single.engine.runner.kv.k
    if one_device.shape[2] % n == 0:  # KV heads split: 1/N of the single-device pool
        assert per_device_bytes(runner.kv.k) == [one_device.nbytes // n] * n
    else:  # a copy of one KV head on each device, as vLLM keeps them
        assert runner.kv.k.shape[2] == n
        assert per_device_bytes(runner.kv.k) == [one_device.nbytes // one_device.shape[2]] * n


@pytest.mark.parametrize(
    ("family", "n", "kv_dtype"), [("qwen3", 4, "int8"), ("gemma3", 2, "fp8_e4m3")]
)
def test_split_quantized_cache_generates_the_single_device_tokens(checkpoint, family, n, kv_dtype):
    """1-byte values and their scales split over KV heads alike (qwen3 at N = 4: a copy of
    one KV head each); each token's scale is its head's own, so the split changes nothing."""
    path = checkpoint(family)
    options = {**ENGINE, "kv_cache_dtype": kv_dtype}
    expected = run(jpaged.LLM(models.load(path, dtype="float32"), **options))
    model = models.load(path, dtype="float32", tensor_parallel=n)
    llm = jpaged.LLM(model, tensor_parallel=n, **options)
    assert run(llm) == expected
    kv = llm.engine.runner.kv
    for pool in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        assert lies(pool, sharding.pool_spec())
        assert per_device_bytes(pool) == [pool.nbytes // n] * n


def test_split_lora_adapters_generate_the_single_device_tokens(checkpoint, tmp_path):
    """Adapters split like the layers they attach to (B of a column-parallel layer on its
    outputs, A of a row-parallel one on its inputs): a step mixing two adapters and the
    base model gives one device's tokens and log-probabilities, and the adapters matter."""
    from benchmarks.serving.in_process import random_adapters

    path = checkpoint("llama")
    model = models.load(path, dtype="float32")
    adapters = random_adapters(model.config, 2, 4, tmp_path, scale=0.5)
    chosen = [adapters[0], adapters[1], None, adapters[0]]
    greedy = dataclasses.replace(GREEDY, logprobs=1)
    options = {**ENGINE, "lora": {"max_loras": 2, "max_lora_rank": 4}}
    one = jpaged.LLM(model, **options).generate(PROMPTS, greedy, lora_request=chosen)
    n = 4
    llm = jpaged.LLM(models.load(path, dtype="float32", tensor_parallel=n), tensor_parallel=n,
                     **options)  # fmt: skip
    split = llm.generate(PROMPTS, greedy, lora_request=chosen)
    for a, b in zip(one, split, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
    base = jpaged.LLM(model, **ENGINE).generate([PROMPTS[0]], greedy)[0]
    assert np.abs(np.subtract(base.logprobs, one[0].logprobs)).max() > 0.01
    for name, (a, b) in llm.engine.runner.lora.weights.items():
        split_on = a if name in ("o", "down") else b
        assert per_device_bytes(split_on) == [split_on.nbytes // n] * n, name


def test_contiguous_backend_split_four_ways_after_warmup_compiles_nothing(checkpoint):
    path = checkpoint("llama")
    expected = [out[0] for out in reference("llama", path)[0]]
    # a model on one device is resharded by the engine
    llm = jpaged.LLM(
        models.load(path, dtype="float32"),
        tensor_parallel=4,
        backend="contiguous",
        **{**ENGINE, "warmup": True},
    )
    outs = llm.generate([*PROMPTS, LATER], GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats()["compilations_after_warmup"] == 0
    assert_split(nnx.state(llm.model), llm.engine.runner.state, llm.engine.runner.kv, 4)


def test_bad_splits_are_refused_before_loading(checkpoint):
    path = checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"tensor_parallel=3 cannot split .*num_heads \(4\)"):
        models.load(path, dtype="float32", tensor_parallel=3)
    with pytest.raises(ValueError, match=r"tensor_parallel must be an int in \[1, 8\]"):
        jpaged.LLM(str(path), tensor_parallel=16, **ENGINE)
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel must be a positive int"):
        jpaged.LLM(str(path), tensor_parallel=0, **ENGINE)


def test_split_step_program_talks_only_megatron_collectives(checkpoint, integration):
    """Per device, the compiled step copies no layer of its pool shard, and the devices
    exchange only activations: an all-reduce of [tokens, hidden] after o and down (and
    the embedding), an all-gather of the [sequences, vocab] logits; never a weight."""
    checks = integration("test_step_programs")
    model = models.load(checkpoint("llama"), dtype="float32", tensor_parallel=4)
    # a big pool, so that nothing but a copy of it is as large as one of its layers
    llm = jpaged.LLM(model, tensor_parallel=4, **{**ENGINE, "num_blocks": 4096})
    r = llm.engine.runner
    shape = r.shape(8)
    packed = r._put(np.zeros(shape.size(), np.int32))
    lowered = programs.step_fn.lower(
        *(r.state, r.kv, r.ring, packed, r._out(shape)),
        graphdef=r.graphdef, impl=r.impl, shape=shape, mesh=r.mesh,
    )  # fmt: skip
    local_layer = int(np.prod(r.kv.k.addressable_shards[0].data.shape[1:]))
    assert checks.check_module(lowered.as_text(dialect="hlo"), local_layer) == []
    text = lowered.compile().as_text()  # one device's program, after XLA's copy insertion
    copies = [
        f"{name}: {shape_}"
        for name, shape_, opcode, _ in checks.instructions(text)
        if opcode.startswith("copy") and checks.elements(shape_) >= local_layer
    ]
    assert copies == []
    c = r.model_config
    collectives = sorted(
        (opcode, shape_.split("{")[0])  # without the layout
        for _, shape_, opcode, _ in checks.instructions(text)
        if opcode
        in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    )
    hidden, logits = f"f32[{shape.tokens},{c.hidden_size}]", f"f32[{shape.seqs},{c.vocab_size}]"
    assert collectives == [("all-gather", logits), *[("all-reduce", hidden)] * 3], collectives


def test_split_engine_on_the_pallas_kernel_matches(checkpoint):
    """The Pallas kernel (interpreted here) inside shard_map, each device on its heads."""
    path = checkpoint("qwen3")
    expected, _ = reference("qwen3", path)
    model = models.load(path, dtype="float32", tensor_parallel=2)
    llm = jpaged.LLM(model, tensor_parallel=2, **{**ENGINE, "attention_impl": "pallas"})
    assert run(llm) == expected


def test_split_step_exports_for_cuda_with_the_triton_kernel(checkpoint, monkeypatch, integration):
    """As a GPU compiles it: the Triton kernel inside shard_map, every pool argument
    whole (the kernel takes its device's shard of the pool, the layer as an index), the
    step's K/V written by the kernel itself."""
    from jpaged.cache import kv_pool
    from jpaged.kernels import ragged_attention

    checks = integration("test_step_programs")
    monkeypatch.setattr(ragged_attention, "on_gpu", lambda: True)  # the Triton kernel
    monkeypatch.setattr(kv_pool, "_storage_dtype", lambda d: d)  # bf16 as it is on a GPU
    model = models.load(checkpoint("llama"), dtype="bfloat16", tensor_parallel=2)
    mesh, c = sharding.make_mesh(2), model.config
    kv = kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=16,
        num_blocks=512,
        dtype="bfloat16",
        sharding=NamedSharding(mesh, sharding.pool_spec()),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    shape = Shape(tokens=64, seqs=8, width=16, impl="pallas")
    exported = jax.export.export(
        programs.step_fn,
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(
        nnx.to_pure_dict(nnx.state(model.model)),
        kv,
        jax.numpy.zeros(16, np.int32, device=replicated),
        jax.numpy.zeros(shape.size(), np.int32, device=replicated),
        jax.numpy.zeros((shape.sample_rows, c.vocab_size), np.float32, device=replicated),
        graphdef=programs.Static(nnx.graphdef(model.model)),
        impl="pallas",
        shape=shape,
        mesh=mesh,
    )
    assert exported.nr_devices == 2
    local_layer = 512 * (c.num_kv_heads // 2) * 16 * c.head_dim
    problems, names = checks.mlir_problems(exported.mlir_module(), local_layer)
    assert not problems
    # the Triton kernel writes the step's K/V itself (bf16 pools): no scatter beside it
    assert "stablehlo.custom_call" in names and "stablehlo.scatter" not in names


def test_split_engine_applies_sampling_controls_and_grammars_alike(checkpoint):
    """Penalties, a logit bias and a grammar mask reach the sampler replicated, like the
    ring: the split engine samples the single-device tokens (seeded sampling included)."""
    from jpaged.engine.sampling import StructuredOutputsParams

    path = checkpoint("llama")
    params = [
        SamplingParams(
            max_tokens=8,
            temperature=0,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            logit_bias={7: 5.0},
        ),
        SamplingParams(
            max_tokens=8,
            temperature=0.9,
            seed=4,
            ignore_eos=True,
            frequency_penalty=0.8,
            min_tokens=4,
        ),
        SamplingParams(
            max_tokens=12,
            temperature=0.7,
            seed=5,
            structured=StructuredOutputsParams(regex="(ab|ba){2,5}c"),
        ),
    ]
    prompts = PROMPTS[:3]

    def tokens(llm: jpaged.LLM) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(prompts, params)]

    expected = tokens(jpaged.LLM(models.load(path, dtype="float32"), **ENGINE))
    split = jpaged.LLM(
        models.load(path, dtype="float32", tensor_parallel=2), tensor_parallel=2, **ENGINE
    )
    assert tokens(split) == expected
    text = split.generate([prompts[2]], params[2])[0].text
    assert re.fullmatch("(ab|ba){2,5}c", text), text


def test_split_gguf_quantized_weights_generate_the_single_device_tokens(demo_gguf):
    """SmolLM2's Q4_1 kernels and Q8_0 embedding split over 3 devices as they are (codes,
    scales and offsets alike; a row-parallel kernel's sub-blocks whole on one device)."""
    path = demo_gguf("smollm2-135m")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9906]]
    greedy = dataclasses.replace(GREEDY, max_tokens=4)

    def tokens(n: int) -> list[list[int]]:
        model = models.load(path, dtype="float32", tensor_parallel=n)
        down = model.model.layers.mlp.down.kernel
        assert [s.data.shape for s in down.scale[...].addressable_shards] == [
            (30, 48 // n, 576)
        ] * n
        llm = jpaged.LLM(model, tensor_parallel=n, **ENGINE)
        return [out.token_ids for out in llm.generate(prompts, greedy)]

    assert tokens(3) == tokens(1)


@pytest.mark.skipif(not models.qdot.int8_kernel(), reason="no AVX2")
def test_a_model_with_int8_inputs_is_not_split(demo_gguf):
    """`activations="int8"` lays the codes in the CPU kernels' order (`qdot.tile`), which a
    split over devices does not keep: refused, by name, not served wrong."""
    model = models.load(demo_gguf("smollm2-135m"), activations="int8")
    with pytest.raises(ValueError, match="loaded with activations='int8' runs whole"):
        jpaged.LLM(model, tensor_parallel=2, **ENGINE)


@pytest.mark.skipif(not models.qdot.int8_kernel(), reason="no AVX2")
def test_a_model_with_codes_in_the_kernels_order_is_not_split(tmp_path):
    """Q4_K's codes, and Q6_K's held at their own six bits, lie in the kernels' order on one
    CPU device whatever the inputs: a split of the model after loading is refused, by name
    (loaded split, they lie as the file's and split as any)."""
    from benchmarks.bench_big import Shape, write

    path = tmp_path / "model.gguf"
    write(path, Shape(2, 256, 512, 4, 2, 64, tied=True, vocab=320), "q4_k_m")
    with pytest.raises(ValueError, match="holds its quantized codes in the CPU kernels' order"):
        jpaged.LLM(models.load(path), tensor_parallel=2, **ENGINE)
    split = models.load(path, tensor_parallel=2).model
    held = [w for _, w in nnx.iter_modules(split) if isinstance(w, models.quant.QuantWeight)]
    assert held and not any(w.narrow or w.transposed or w.tiled for w in held)
