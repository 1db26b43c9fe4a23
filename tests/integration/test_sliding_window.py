"""Sliding-window KV groups end to end on a tiny Gemma 3 whose window (16 tokens) the
sequences outgrow many times over: parity with transformers, with the contiguous
backend and with every layer keeping the whole context; admission that counts what the
windows give back; prefix hits only where the window's blocks survive."""

from __future__ import annotations

import pytest
import torch

from jpaged import LLM, SamplingParams

WINDOW = 16
SMALL = dict(dtype="float32", warmup=False, max_seq_len=256, max_batch_size=4, block_size=4)
# 200-token sequences: prompts of 60 to 150 tokens, then greedy tokens up to 200
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((150, 60, 97))]
GREEDY = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tiny_checkpoint):
    from jpaged import models

    path = tiny_checkpoint("gemma3", sliding_window=WINDOW)
    return path, models.load(str(path), dtype="float32")


def ids(completions):
    return [c.token_ids for c in completions]


def test_windows_free_blocks_and_match_transformers(gemma, hf_reference):
    path, model = gemma
    hybrid = LLM(model, **SMALL)
    out = ids(hybrid.generate(PROMPTS, GREEDY))
    stats = hybrid.stats()
    # 7 layers, 1 global: one full group and six sliding groups of one layer each
    assert hybrid.engine.groups.windows == (None,) + (WINDOW,) * 6
    assert stats["kv_window_frees"] > 0 and stats["kv_blocks_used"] == 0
    assert hybrid.engine.cache.audit() == []
    assert ids(LLM(model, hybrid_kv_cache=False, **SMALL).generate(PROMPTS, GREEDY)) == out
    assert ids(LLM(model, backend="contiguous", **SMALL).generate(PROMPTS, GREEDY)) == out
    hf = hf_reference(path)
    for prompt, got in zip(PROMPTS, out, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt)),
            max_new_tokens=50,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert got == ref[0, len(prompt) :].tolist()


def test_long_sequences_fit_where_whole_context_would_not(gemma):
    """Memory for about 2 sequences of 200 tokens in every layer: with windows the sliding
    groups hold ~5 blocks each (and a prompt chunk's while it is computed), so all 4 run
    at once without preemption; keeping every layer's context, the same bytes preempt
    (and recompute) to cope."""
    _, model = gemma
    budget = dict(
        SMALL,
        kv_memory_bytes=2 * 200 * 7 * 2 * 32 * 4,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    prompts = [*PROMPTS, PROMPTS[0][::-1]]
    hybrid = LLM(model, **budget)
    whole = LLM(model, hybrid_kv_cache=False, **budget)
    assert hybrid.stats()["kv_block_bytes"] * 7 == whole.stats()["kv_block_bytes"]
    out = ids(hybrid.generate(prompts, GREEDY))
    assert ids(whole.generate(prompts, GREEDY)) == out
    assert hybrid.stats()["preemptions"] == 0 < whole.stats()["preemptions"]
    assert hybrid.stats()["kv_blocks_used_peak"] < hybrid.stats()["kv_blocks_total"]


def test_prefix_hits_only_where_the_window_survived(gemma):
    """A prompt's blocks cached, then other prompts evict the oldest cached blocks (the
    sliding groups' early ones, given back first): the same prompt again hits less than
    the full group alone would allow, recomputes the rest, and generates the same."""
    _, model = gemma
    prompt = PROMPTS[0]
    cold = ids(LLM(model, enable_prefix_caching=False, **SMALL).generate([prompt], GREEDY))
    llm = LLM(model, **dict(SMALL, num_blocks=7 * 60))
    assert ids(llm.generate([prompt], GREEDY)) == cold
    cache = llm.engine.cache
    whole = len(prompt) - 1 - (len(prompt) - 1) % 4  # every full block before the last token
    assert cache.num_cached_tokens(prompt) == whole  # the window's blocks are still cached
    llm.generate([PROMPTS[1], PROMPTS[2]], GREEDY)  # their blocks evict the oldest
    hit = cache.num_cached_tokens(prompt)
    assert hit < whole
    before = llm.stats()["kv_prefix_cache_hits"]
    assert ids(llm.generate([prompt], GREEDY)) == cold
    assert llm.stats()["kv_prefix_cache_hits"] - before == hit
    assert cache.audit() == [] and llm.stats()["kv_blocks_used"] == 0
