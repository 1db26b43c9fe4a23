"""The engine's step programs as an H100 runs them, compiled here without one (deviceless
AOT, `benchmarks.gpu_structure`) and pinned from XLA's dump: one CUDA graph a step, no
while loop, no weight or pool copied, the Pallas kernel compiled for sm_90a, fusions a
decoder layer, collectives under tensor parallelism.

Runs in tests/multidevice's run beside the suite (started at collection): its compiles are
~1 minute on one core. Needs the `[gpu-aot]` extra (JAX's CUDA plugin and `ptxas`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from benchmarks import gpu_structure as gs
from jpaged import models
from jpaged.engine.buckets import token_ladder
from jpaged.models import moe

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: tests/integration/test_tensor_parallel.py"
)

# Fusions a decoder layer, as compiled today (the target is 10): a bound that
# catches a regression, lowered as the step sheds launches.
# The kernel writes the step's K/V, reads q, k, v token-major from one launch and, unsplit,
# stores its output token-major: no K/V scatters, no q tile layout, no output layout but
# the split merge (13 -> 11 at 1b-1, 14 -> 10 at 1b-256).
FUSIONS = {"1b-1": 11, "1b-256": 10, "1b-prefill": 10, "1b-int8": 11, "8b-1": 11, "8b-tp8": 13}
# The same with the kernel under Mosaic GPU (`ragged_attention.LOWERINGS`): XLA lays its q
# rows out, merges its output (split or not) and scatters the step's K/V before it.
MOSAIC_FUSIONS = {"1b-1": 13, "1b-256": 14}


@pytest.fixture(scope="module")
def counted() -> dict[str, gs.Counted]:
    why = gs.available()
    assert why is None, f"the [gpu-aot] extra is needed: {why}"
    names = {k.split()[0]: k for k in gs.CASES}
    return {short: gs.count(gs.CASES[names[short]]) for short in FUSIONS}


@pytest.fixture(scope="module")
def mosaic() -> dict[str, gs.Counted]:
    names = {k.split()[0]: k for k in gs.CASES}
    return {
        short: gs.count(dataclasses.replace(gs.CASES[names[short]], lowering="mosaic"))
        for short in MOSAIC_FUSIONS
    }


@pytest.mark.parametrize("case", [c for c in FUSIONS if c != "8b-tp8"])
def test_one_device_step_is_one_cuda_graph_copying_no_weight(
    counted: dict[str, gs.Counted], case: str
) -> None:
    c = counted[case]
    assert c.step["whiles"] == 0 and c.shallow.conditionals == 0
    assert c.step["graphs"] == 1 and c.step["outside"] == 0, c.shallow.thunks
    # int8 too: its stacks read at a layer index XLA cannot fold (`models.common`), so no
    # layer's weights are written out dequantized
    assert c.shallow.copied_bytes == 0, c.shallow.copies
    # one Triton ragged kernel a layer, compiled to PTX for the H100
    assert c.shallow.custom_calls["__gpu$xla.gpu.triton"] == c.case.layers
    assert c.shallow.ptx
    assert c.layer["fusions"] <= FUSIONS[case]


@pytest.mark.parametrize("case", sorted(MOSAIC_FUSIONS))
def test_the_mosaic_kernel_steps_as_one_cuda_graph_copying_no_pool(
    mosaic: dict[str, gs.Counted], case: str
) -> None:
    c = mosaic[case]
    assert c.step["whiles"] == 0 and c.shallow.conditionals == 0
    assert c.step["graphs"] == 1 and c.step["outside"] == 0, c.shallow.thunks
    # the scatter writes the pools in place, as the kernel's outputs alias nothing
    assert c.shallow.copied_bytes == 0, c.shallow.copies
    # one Mosaic GPU kernel a layer (shared memory checked as on the card), no Triton one
    assert c.shallow.custom_calls["mosaic_gpu_v2"] == c.case.layers
    assert c.shallow.custom_calls["__gpu$xla.gpu.triton"] == 0
    assert c.layer["fusions"] <= MOSAIC_FUSIONS[case]


def test_enforce_eager_steps_launch_every_kernel_without_a_cuda_graph(
    counted: dict[str, gs.Counted],
) -> None:
    case = counted["1b-1"].case
    eager = gs.compile_step(case, eager=True)
    assert eager.graphs == 0 and eager.outside == sum(eager.thunks.values()) > 0
    assert eager.fusions == counted["1b-1"].shallow.fusions  # the same program otherwise


def test_a_decode_step_and_its_sampler_are_one_program_and_one_cuda_graph(
    counted: dict[str, gs.Counted],
) -> None:
    """A GPU's decode step (`Runner.one_launch`): the cases above compile the step with its
    sampler, and the sampler's kernels are inside the step's one graph."""
    c = counted["1b-1"]
    assert c.case.sampled
    alone = gs.compile_step(dataclasses.replace(c.case, sampled=False))
    assert c.shallow.fusions > alone.fusions and alone.graphs == c.shallow.graphs == 1
    assert c.shallow.outside == alone.outside == 0


def test_the_sampler_launches_its_kernels_without_a_cuda_graph() -> None:
    # (the steps that take two programs: logprobs, penalties, a grammar) a graph's host-side
    # update at every call cost more than its launches (RESULTS)
    s = gs.compile_sampler(rows=4, vocab=128256)
    assert s.graphs == 0 and s.outside == s.fusions > 0


def test_the_image_encoder_is_one_cuda_graph_copying_no_weight() -> None:
    v = gs.compile_vision(images=1, layers=2)
    assert v.whiles == 0 and v.graphs == 1 and v.outside == 0, v.thunks  # layers unrolled
    # only the pixels move, cut into patches: no weight copied out of its stack or merged
    assert v.copied_bytes == 3 * 896 * 896 * 2, v.copies


def test_tensor_parallel_step_is_one_cuda_graph_all_reducing_twice_a_layer(
    counted: dict[str, gs.Counted],
) -> None:
    c = counted["8b-tp8"]
    assert c.layer["collectives"] == 2  # attention's and the MLP's row-parallel outputs
    assert c.step["whiles"] == 0 and c.layer["copied_bytes"] == 0
    assert c.step["graphs"] == 1 and c.step["outside"] == 0, c.shallow.thunks  # NCCL inside
    assert c.shallow.custom_calls["__gpu$xla.gpu.triton"] == c.case.layers
    assert c.layer["fusions"] <= FUSIONS["8b-tp8"]


def test_the_counts_see_what_the_fixes_removed(
    counted: dict[str, gs.Counted], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dump readers catch a merged-weight copy, projections apart and a layer loop
    (what the step had)."""
    apart = gs.StepCase(layers=2, tokens=4, seqs=4, fused=False)  # q, k, v their own
    merged = gs.compile_step(apart, {"xla_gpu_dot_merger_threshold_mb": 32})
    assert merged.copied_bytes >= 2 * 3 * 2048 * 512 * 2  # q, k and v concatenated
    # a GEMM each: more fusions than the fused 1b-1 program of the same depth (42 to 34
    # today; one compile, not `count`'s two: the programs differ only in their layers)
    fused = counted["1b-1"]
    assert fused.case == dataclasses.replace(apart, fused=True)
    separate = gs.compile_step(apart).fusions
    assert separate >= fused.shallow.fusions + 2 * apart.layers, (separate, fused.shallow.fusions)
    case = gs.StepCase(layers=2, tokens=4, seqs=4)
    monkeypatch.setattr(models.common, "on_gpu", lambda: False)  # the layer scan kept
    jax.clear_caches()  # (the step's trace is cached, keyed on its arguments)
    try:
        scanned = gs.compile_step(case)
    finally:
        jax.clear_caches()
    assert scanned.whiles == 1 and scanned.graphs >= 2


def test_a_gpu_never_decodes_in_a_one_token_bucket() -> None:
    assert token_ladder(256, gpu=True)[0] == 4 and token_ladder(256)[0] == 1


def test_a_mixture_decode_step_is_one_cuda_graph_reading_only_routed_experts() -> None:
    """Qwen3-30B-A3B's geometry (bf16, 128 experts, 8 routed) at 4 tokens: the experts are
    gathered by id inside the step's one graph, no expert stack copied, and the weights
    the step reads are the routed experts', attention's, the router's and the LM head's."""
    c = gs.count(gs.CASES["30b-a3b-4 (Qwen3-30B-A3B decode, 4 tokens)"])
    assert c.step["whiles"] == 0 and c.shallow.conditionals == 0
    assert c.step["graphs"] == 1 and c.step["outside"] == 0, c.shallow.thunks
    assert c.shallow.copied_bytes == 0, c.shallow.copies  # no stack sliced or copied out
    routed, rest = gs.floor_bytes(c.case)
    assert c.step["read_bytes"] <= 1.5 * (routed + rest)
    # each expert read where it lies by the GEMVs' own kernels: no gathered copy written
    # (9 GiB a step when the gathered gate and up were a GEMM's operands: RESULTS)
    assert c.step["gathered_bytes"] == 0, c.shallow.gathered
    assert c.layer["fusions"] <= 16


@pytest.mark.parametrize("codes", [False, True], ids=["bf16", "q8_0"])
def test_the_most_pairs_a_gpu_gathers_read_each_routed_expert_once_in_place(codes: bool) -> None:
    """`moe.experts`' gather at `GATHER_PAIRS` pairs (8 tokens, top-8), 30B-A3B's experts:
    four kernels, no loop, the routed experts' weights read once and never written out
    (Q8_0's codes neither: only their float16 scales, 1/16 of the codes' bytes)."""
    tokens = moe.GATHER_PAIRS // gs.SHAPES["30b-a3b"].moe.top_k  # type: ignore[union-attr]
    s = gs.compile_experts(tokens, codes=codes)
    c = gs.SHAPES["30b-a3b"]
    routed = moe.GATHER_PAIRS * 3 * c.hidden_size * c.moe.intermediate_size  # type: ignore[union-attr]
    assert s.whiles == 0 and s.conditionals == 0 and not s.copies
    assert s.fusions <= 5 and s.outside == s.fusions  # (too few kernels for a graph alone)
    if codes:
        assert s.gathered_bytes <= routed // 16, s.gathered
        assert s.read_bytes <= routed * (1 + 1 / 16) * 1.01
    else:
        assert s.gathered_bytes == 0, s.gathered
        assert s.read_bytes <= 2 * routed * 1.01  # bf16, once


def test_the_counts_see_a_gathered_expert_stack_written_out() -> None:
    """The gathered experts as a GEMM's operand (the gather path before), counted."""
    on_gpu = SingleDeviceSharding(gs.topology().devices[0])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_gpu)  # noqa: E731

    def gemm(x: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("th,tkhi->tki", x, w[ids])

    args = (spec((4, 2048), jnp.bfloat16), spec((4, 8), jnp.int32))
    s = gs.compile_dumped(jax.jit(gemm), (*args, spec((128, 2048, 768), jnp.bfloat16)), {})
    assert s.gathered_bytes == 32 * 2048 * 768 * 2, s.gathered
