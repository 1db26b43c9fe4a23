"""The models are `flax.nnx` modules: the engine's step consumes their split state, and
the module `models.load` returns scores outside the engine as the engine does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpaged
from jpaged import models
from jpaged.models import gemma3, llama, qwen3

CLASSES = {"llama": llama.Llama, "qwen3": qwen3.Qwen3, "gemma3": gemma3.Gemma3}


@pytest.mark.parametrize("family", list(CLASSES))
def test_step_consumes_the_split_module(family: str, tiny_checkpoint: Callable[..., Path]) -> None:
    llm = jpaged.LLM(str(tiny_checkpoint(family)), max_batch_size=2, max_seq_len=32, warmup=False)
    module = llm.model
    assert isinstance(module, nnx.Module) and type(module) is CLASSES[family]
    runner = llm.engine.runner
    assert runner.graphdef.value == nnx.graphdef(module)
    # the state the step takes (a pure dict) is the module's weights themselves, not a copy
    weights = jax.tree.leaves(nnx.state(module))
    assert all(a is b for a, b in zip(jax.tree.leaves(runner.state), weights, strict=True))
    out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3
    # no Flax state is mutated across steps
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(module)), weights, strict=True))


@pytest.mark.parametrize("family", list(CLASSES))
def test_loaded_module_scores_like_the_engine(
    family: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    path = str(tiny_checkpoint(family))
    module = models.load(path, dtype="float32").model
    prompts = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 1, 6, 10, 12, 2]]
    logits = jax.jit(models.logits)(module, jnp.asarray(prompts, jnp.int32))
    assert logits.shape == (2, 7, module.config.vocab_size)
    ours = jax.nn.log_softmax(logits, axis=-1)
    llm = jpaged.LLM(path, max_batch_size=2, max_seq_len=32, warmup=False, dtype="float32")
    params = jpaged.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for row, out in zip(prompts, llm.generate(prompts, params), strict=True):
        i = prompts.index(row)
        want = [ours[i, p - 1, row[p]] for p in range(1, len(row))]
        np.testing.assert_allclose(out.prompt_logprobs[1:], want, atol=1e-5)
        assert out.token_ids[0] == int(jnp.argmax(logits[i, -1]))
