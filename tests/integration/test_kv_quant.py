"""The engine on a 1-byte KV cache (kv_cache_dtype): both backends, sharing, capacity,
and a bound on what it costs a tiny model in perplexity."""

from __future__ import annotations

import math

import pytest

import jpaged
from jpaged import LLM, EngineConfig, SamplingParams

KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
SMALL = dict(dtype="float32", warmup=False, max_seq_len=96, max_batch_size=4, block_size=4)
PROMPTS = [list(range(60, 105)), [5, 17, 99, 3], list(range(30, 53)), [42] * 17]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def ids(completions):
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_equals_contiguous_and_sharing_keeps_scales(loaded, kv_dtype):
    """Gemma 3 (sliding window, soft caps): the paged and contiguous backends store the same
    1-byte values, so they agree token for token; n = 2 forks (copy-on-write block copies)
    and prefix-cache hits read the same values and scales as a fresh run."""
    model = loaded("gemma3")
    paged = LLM(model, backend="paged", kv_cache_dtype=kv_dtype, **SMALL)
    contiguous = LLM(model, backend="contiguous", kv_cache_dtype=kv_dtype, **SMALL)
    assert ids(paged.generate(PROMPTS, GREEDY)) == ids(contiguous.generate(PROMPTS, GREEDY))
    forked = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2)
    shared = paged.generate(PROMPTS[2:3], forked)[0]  # prompt blocks cached by the first run
    assert paged.stats()["kv_prefix_cache_hits"] > 0 and paged.stats()["kv_cow_copies"] > 0
    fresh = LLM(
        model, backend="paged", kv_cache_dtype=kv_dtype, enable_prefix_caching=False, **SMALL
    ).generate(PROMPTS[2:3], GREEDY)[0]
    assert [c.token_ids for c in shared.choices] == [fresh.token_ids] * 2
    assert paged.engine.cache.audit() == [] and paged.stats()["kv_blocks_used"] == 0


def test_the_same_bytes_hold_more_blocks(loaded):
    """head_dim 16, float32 scales: (2 x 16 x 4) / (2 x (16 + 4)) = 3.2x the blocks of a
    float32 pool in the same kv_memory_bytes."""
    model = loaded("llama")
    budget = dict(SMALL, kv_memory_bytes=1 << 20)
    full, int8 = (LLM(model, kv_cache_dtype=kv, **budget).stats() for kv in ("auto", "int8"))
    assert full["kv_block_bytes"] / int8["kv_block_bytes"] == 3.2
    assert int8["kv_blocks_total"] == (1 << 20) // int8["kv_block_bytes"]
    assert int8["kv_value_bits"] == 8 and full["kv_value_bits"] == 32


def test_perplexity_bound_on_a_tiny_model(loaded):
    """A broken scale shows here: the prompt logprobs of a quantized cache stay near the
    float32 cache's (looser than the real models' bound in RESULTS.md: random weights)."""
    model = loaded("qwen3")
    text = [list(range(i, i + 60)) for i in range(3, 240, 60)]

    def perplexity(kv: str) -> float:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outs = LLM(model, kv_cache_dtype=kv, **SMALL).generate(text, params)
        lps = [lp for c in outs for lp in c.prompt_logprobs[1:]]
        return math.exp(-sum(lps) / len(lps))

    reference = perplexity("auto")
    bounds = {"int8": 1.01, "fp8_e4m3": 1.05, "fp8_e5m2": 1.1}
    for kv, bound in bounds.items():
        ratio = perplexity(kv) / reference
        assert 1 / bound <= ratio <= bound, (kv, ratio)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype.*int8"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        jpaged.generate([[1, 2]], model="unused", kv_cache_dtype="int4")
