"""Prefix caching and parallel sampling (n > 1) end to end on a tiny Llama.

Caching must never change what greedy decoding produces: every case compares an
engine with prefix caching on against one with it off, token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.engine.interface import PromptRequest
from jpaged.engine.sampling import choice_seed

SMALL = dict(dtype="float32", warmup=False, max_seq_len=64, max_batch_size=4, block_size=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def ids(completions):
    return [c.token_ids for c in completions]


def one_by_one(llm, prompts, params=GREEDY):
    """Each prompt in its own generate call, so later ones can hit earlier ones' blocks."""
    return [llm.generate([p], params)[0] for p in prompts]


def test_caching_on_equals_off_for_prompts_sharing_none_one_many_and_all_blocks(model):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 24).tolist()  # 6 blocks of 4
    prompts = [
        base,
        rng.integers(0, 256, 13).tolist(),  # shares nothing
        base[:4] + rng.integers(0, 256, 9).tolist(),  # shares 1 block
        base[:20] + rng.integers(0, 256, 3).tolist(),  # shares 5 blocks
        base[:21],  # a prefix of base: 5 blocks + 1 token
        base,  # all of it (at a block boundary: the last block is recomputed)
        base + [7],  # all of base's 6 blocks
        base[:16] + base[:16],  # its second half repeats content under another prefix
    ]
    roomy = dict(SMALL, num_blocks=128)  # nothing gets evicted
    off = LLM(model, enable_prefix_caching=False, **roomy)
    on = LLM(model, **roomy)
    expected = ids(one_by_one(off, prompts))
    assert ids(one_by_one(on, prompts)) == expected
    s = on.stats()
    # hits, in blocks of 4: 0, 0, 1, 5, 5, 5, 6, 4
    assert s["kv_prefix_cache_hits"] == 4 * (1 + 5 + 5 + 5 + 6 + 4)
    assert s["kv_prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert off.stats()["kv_prefix_cache_hits"] == 0
    # all at once too: hits on the blocks earlier requests published, same tokens
    assert ids(on.generate(prompts, GREEDY)) == expected
    assert on.stats()["kv_blocks_used"] == 0 and on.engine.cache.audit() == []


def test_a_prefix_hit_right_after_eviction_and_refill(model):
    small = dict(SMALL, num_blocks=12)  # 48 tokens: a 24-token prompt + 10 fit twice
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 24).tolist()
    others = [rng.integers(0, 256, 24).tolist() for _ in range(2)]
    on = LLM(model, **small)
    off = LLM(model, enable_prefix_caching=False, **small)
    sequence = [a, *others, a, a]
    expected = ids(one_by_one(off, sequence))
    got = []
    got.append(on.generate([a], GREEDY)[0].token_ids)
    cache = on.engine.cache
    assert cache.num_cached_tokens(a) == 20
    for p in others:  # push a's blocks out
        got.append(on.generate([p], GREEDY)[0].token_ids)
    s = on.stats()
    assert s["kv_prefix_cache_evicted_blocks"] > 0 and s["kv_prefix_cache_evictions"] > 0
    assert cache.num_cached_tokens(a) == 0  # no stale hit on reused blocks
    hits = s["kv_prefix_cache_hits"]
    got.append(on.generate([a], GREEDY)[0].token_ids)  # a miss: recomputed, cached again
    assert on.stats()["kv_prefix_cache_hits"] == hits
    got.append(on.generate([a], GREEDY)[0].token_ids)  # and a hit
    assert on.stats()["kv_prefix_cache_hits"] == hits + 20
    assert got == expected


def test_caching_on_equals_off_under_preemption(model):
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 12).tolist()
    prompts = [shared + rng.integers(0, 256, k).tolist() for k in (1, 5, 9, 2)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = LLM(model, enable_prefix_caching=False, **SMALL).generate(prompts, params)
    tight = LLM(model, num_blocks=20, **SMALL)  # 80 tokens for ~160 wanted at once
    assert ids(tight.generate(prompts, params)) == ids(free)
    s = tight.stats()
    assert s["preemptions"] > 0 and s["kv_prefix_cache_hits"] > 0
    assert s["kv_blocks_used"] == 0 and tight.engine.cache.audit() == []


def test_n8_shares_one_prompt_of_blocks_and_samples_each_choice_independently(model):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 256, 512).tolist()
    config = dict(SMALL, max_seq_len=560, max_batch_size=8, block_size=16)
    params = SamplingParams(max_tokens=20, temperature=30.0, seed=7, ignore_eos=True, n=8)
    llm = LLM(model, **config)
    engine = llm.engine
    engine.add(req := engine.prepare(PromptRequest(prompt, params)))
    shared_seen = 0
    while engine.has_unfinished():
        engine.step()
        shared_seen = max(shared_seen, engine.stats()["kv_shared_blocks"])
    s = engine.stats()
    # 31 full prompt blocks shared by 8; block 31 holds prompt tokens 496..510 when the
    # choices fork and each writes token 511 into its own copy (7 copies + the original);
    # each choice's 19 computed output tokens (positions 512..530) take 2 more blocks.
    assert s["kv_blocks_used_peak"] == 31 + 8 + 8 * 2
    assert s["kv_cow_copies"] == 7 and shared_seen == 31
    assert s["kv_blocks_used"] == 0 and engine.cache.audit() == []
    choices = [c.output_ids for c in req.group]
    assert len({tuple(c) for c in choices}) == 8  # independent seeds
    # each choice samples exactly what a lone request with its seed does
    alone = LLM(model, **config).generate(
        [prompt] * 8,
        [
            SamplingParams(max_tokens=20, temperature=30.0, seed=choice_seed(7, i), ignore_eos=True)
            for i in range(8)
        ],
    )
    assert ids(alone) == choices
    assert choice_seed(7, 0) == 7


def test_n_greedy_and_completion_choices(model):
    prompt = list(range(40, 63))
    llm = LLM(model, **SMALL)
    single = llm.generate([prompt], GREEDY)[0]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3, logprobs=2)
    out = llm.generate([prompt, [5, 6]], params)
    assert len(out) == 2
    first = out[0]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids for c in first.choices)
    assert first.token_ids == first.choices[0].token_ids and first.text == first.choices[0].text
    assert all(len(c.top_logprobs) == 10 and c.finish_reason == "length" for c in first.choices)
    assert first.ttft_s is not None and first.ttft_s <= first.latency_s
    assert llm.stats()["requests_finished"] == 3  # requests, not choices
    assert llm.stats()["kv_blocks_used"] == 0


def test_group_preemption_recomputes_and_keeps_every_choice(model):
    prompts = [list(range(10, 30)), list(range(100, 117))]
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=30.0, seed=5, ignore_eos=True, n=3),
    ]
    free = LLM(model, **SMALL).generate(prompts, params)
    for caching in (True, False):
        # the group alone needs 4 shared + 3 x 6 blocks; both at once need 11 more
        tight = LLM(model, num_blocks=24, enable_prefix_caching=caching, **SMALL)
        out = tight.generate(prompts, params)
        assert [ids(c.choices) for c in out] == [ids(c.choices) for c in free]
        s = tight.stats()
        assert s["preemptions"] > 0, caching
        assert s["kv_blocks_used"] == 0 and tight.engine.cache.audit() == []


def test_abort_of_a_group_frees_every_choice(model):
    llm = LLM(model, **SMALL)
    engine = llm.engine
    engine.add(
        req := engine.prepare(
            PromptRequest(list(range(9)), SamplingParams(max_tokens=30, n=3, seed=1))
        )
    )
    for _ in range(3):
        engine.step()
    assert all(c.seq_id is not None for c in req.group)
    engine.abort(req.id)
    outs = engine.step()
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0
    assert engine.cache.audit() == []


def test_n_on_both_backends_and_batch_room(model):
    contiguous = LLM(model, backend="contiguous", **SMALL)
    # a contiguous fork copies its parent's region: the same seeded choices as paged
    sampled = SamplingParams(n=2, max_tokens=8, temperature=30.0, seed=3, ignore_eos=True)
    want = LLM(model, **SMALL).generate([[1, 2, 3]], sampled)[0].choices
    got = contiguous.generate([[1, 2, 3]], sampled)[0].choices
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert got[0].token_ids != got[1].token_ids
    with pytest.raises(ValueError, match="^n: .*max_batch_size"):
        LLM(model, **SMALL).generate([[1, 2, 3]], SamplingParams(n=5))
    out = contiguous.generate([[1, 2, 3], [1, 2, 3, 4]], GREEDY)
    s = contiguous.stats()
    assert s["kv_prefix_cache_hits"] == 0 and len(out[0].choices) == 1
