"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' teacher forcing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jpaged
from jpaged import LLM, SamplingParams

PROMPTS = [list(range(60, 105)), [5, 17, 99, 3], [200, 7], list(range(30, 53))]
# 8-token steps: the 45-token prompt is scored in six chunks, beside the others' decodes
CHUNKED = dict(
    dtype="float32",
    warmup=False,
    max_seq_len=64,
    max_batch_size=4,
    block_size=4,
    max_num_batched_tokens=8,
)


def teacher_forced(hf, prompt: list[int]) -> np.ndarray:
    """float32 [len(prompt), vocab]: log-softmax of the logits at each position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def own(logprobs: np.ndarray, prompt: list[int]) -> list[float]:
    return [float(logprobs[i - 1, t]) for i, t in enumerate(prompt) if i]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_prompt_logprobs_match_transformers_across_chunks(
    family, loaded, tiny_checkpoint, hf_reference
):
    hf = hf_reference(tiny_checkpoint(family))
    outs = jpaged.generate(
        PROMPTS, model=loaded(family), max_tokens=3, temperature=0, prompt_logprobs=0, **CHUNKED
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        np.testing.assert_allclose(
            out.prompt_logprobs[1:], own(teacher_forced(hf, prompt), prompt), atol=1e-4
        )
        assert out.prompt_top_logprobs is None  # 0 alternatives asked for
        assert len(out.token_ids) == 3  # generation is unaffected


def test_top_alternatives_n_choices_backends_and_the_prefix_cache(
    loaded, tiny_checkpoint, hf_reference
):
    """k alternatives; n = 2 choices share one scoring of the prompt; the contiguous backend;
    a prompt whose blocks are cached is still scored in full (cached blocks hold no logits)."""
    model = loaded("llama")
    expected = teacher_forced(hf_reference(tiny_checkpoint("llama")), PROMPTS[0])
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2)
    paged = LLM(model, backend="paged", enable_prefix_caching=True, **CHUNKED)
    first = paged.generate(PROMPTS[0], params)[0]
    again = paged.generate(PROMPTS[0], params)[0]
    contiguous = LLM(model, backend="contiguous", **CHUNKED).generate(
        PROMPTS[0], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    )[0]
    vocab_text = [model.tokenizer.decode([t]) for t in range(expected.shape[1])]
    for out in (first, again, contiguous):
        np.testing.assert_allclose(out.prompt_logprobs[1:], own(expected, PROMPTS[0]), atol=1e-4)
        assert out.prompt_top_logprobs[0] is None
        for i, top in enumerate(out.prompt_top_logprobs[1:]):
            best = np.argsort(-expected[i])[:3]
            want = {vocab_text[t]: float(expected[i, t]) for t in best}
            assert top.keys() == want.keys()
            np.testing.assert_allclose([top[k] for k in want], list(want.values()), atol=1e-4)
    assert len(first.choices) == 2
    # the second run found the prompt's blocks cached (published by the first) but used none
    assert paged.stats()["kv_prefix_cache_hits"] == 0


def test_prompt_logprobs_survive_preemption(loaded, tiny_checkpoint, hf_reference):
    """A pool too small for all four: sequences are preempted and recomputed, and each
    prompt's logprobs are still those of one teacher-forced pass."""
    model = loaded("qwen3")
    hf = hf_reference(tiny_checkpoint("qwen3"))
    llm = LLM(model, backend="paged", num_blocks=20, admission_reserve=0.0, **CHUNKED)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0))
    assert llm.stats()["preemptions"] > 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        np.testing.assert_allclose(
            out.prompt_logprobs[1:], own(teacher_forced(hf, prompt), prompt), atol=1e-4
        )


def test_prompt_logprobs_are_refused_beyond_the_cap():
    with pytest.raises(jpaged.RequestError, match="prompt_logprobs") as err:
        SamplingParams(prompt_logprobs=6)
    assert err.value.field == "prompt_logprobs"
