"""Qwen3-MoE on 8 fake CPU devices: tensor parallelism (each expert's intermediate
dimension split) and expert parallelism (one expert a device) give one device's tokens.
Run in a subprocess with 8 devices, as tests/multidevice/test_tensor_parallel.py is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jpaged
from jpaged import SamplingParams, models
from jpaged.models import sharding

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: tests/integration/test_tensor_parallel.py"
)

ENGINE = dict(
    dtype="float32", block_size=4, max_seq_len=64, max_batch_size=4, max_num_batched_tokens=8,
    warmup=False, compilation_cache_dir=None,
)  # fmt: skip
PROMPTS = [[5, 17, 99, 3], list(range(30, 43)), [200, 7]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_tensor_and_expert_parallel_give_one_devices_tokens(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    # 8 query heads (2 KV heads, repeated) so that N = 8 splits attention too
    path = tiny_checkpoint("qwen3moe", num_attention_heads=8)
    want = [c.token_ids for c in jpaged.LLM(models.load(path, dtype="float32"), **ENGINE)
            .generate(PROMPTS, GREEDY)]  # fmt: skip
    assert len({t for ids in want for t in ids}) >= 4
    for expert_parallel in (False, True):
        model = models.load(
            path, dtype="float32", tensor_parallel=8, expert_parallel=expert_parallel
        )
        down = model.model.layers.moe.down.kernel[...]
        spec = (None, sharding.AXIS, None, None) if expert_parallel else (None, None, "tp", None)
        assert down.sharding.is_equivalent_to(NamedSharding(model.mesh, PartitionSpec(*spec)), 4)
        got = jpaged.LLM(model, tensor_parallel=8, **ENGINE).generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in got] == want, f"expert_parallel={expert_parallel}"
