"""Speculative decoding's host parts: the n-gram proposer, acceptance, the config, rollback."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.paged import PagedKVCache
from jpaged.config import EngineConfig
from jpaged.engine.speculative import accepted, from_flags, propose


def test_proposer_takes_the_longest_ngram_and_its_last_occurrence():
    contexts = [
        [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3],  # 3-gram [1 2 3] last seen before 4 5
        [7, 8, 1, 7, 9, 2, 7],  # only the 1-gram [7] matches, last at index 3
        [5, 6, 7, 8],  # no repeat
        [4, 4, 4, 4, 4, 4],  # a run: drafts continue it
        [3],  # too short for any n-gram
    ]
    got = [d.tolist() for d in propose(contexts, k=3, lo=1, hi=3)]
    assert got == [[4, 5, 1], [9, 2, 7], [], [4, 4, 4], []]
    # with 2-grams at least, the 1-gram match does not count
    assert [d.tolist() for d in propose(contexts[:2], k=3, lo=2, hi=3)] == [[4, 5, 1], []]
    # a continuation that reaches the end goes on as the loop the match implies
    assert propose([[1, 2, 9, 1, 2]], k=5, lo=2, hi=2)[0].tolist() == [9, 1, 2, 9, 1]
    assert propose([], k=3, lo=1, hi=2) == []


def test_proposer_matches_a_loop_per_context_on_random_batches():
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 5, int(n)).tolist() for n in rng.integers(1, 40, 30)]
    for ctx, d in zip(contexts, propose(contexts, k=4, lo=2, hi=4), strict=True):
        want: list[int] = []
        for n in range(4, 1, -1):
            starts = [i for i in range(len(ctx) - n) if ctx[i : i + n] == ctx[-n:]]
            if len(ctx) > n and starts:
                follow = ctx[starts[-1] + n :]
                want = [follow[j % len(follow)] for j in range(4)]
                break
        assert d.tolist() == want


def test_acceptance_is_the_prefix_equal_to_what_was_sampled():
    assert accepted([5, 6, 7], np.array([5, 6, 7, 8])) == 3
    assert accepted([5, 6, 7], np.array([5, 9, 7, 8])) == 1
    assert accepted([5, 6, 7], np.array([1, 6, 7, 8])) == 0


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": True}, "prompt_lookup_max"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ("ngram", "must be None or a dict"),
    ],
)
def test_bad_speculative_config_names_the_field(spec, field):
    with pytest.raises(ValueError, match=rf"EngineConfig\.speculative.*{field}"):
        EngineConfig(speculative=spec, max_batch_size=16)


def test_speculative_config_defaults_follow_vllm():
    c = EngineConfig(speculative={"num_speculative_tokens": 3}).speculative
    assert c is not None
    assert (c["method"], c["prompt_lookup_min"], c["prompt_lookup_max"]) == ("ngram", 5, 5)
    c = EngineConfig(speculative=from_flags(3, hi=4)).speculative
    assert c is not None and (c["prompt_lookup_min"], c["prompt_lookup_max"]) == (4, 4)
    assert from_flags(None) is None
    with pytest.raises(ValueError, match="--speculative-ngram"):
        from_flags(None, 2)


def test_truncate_gives_back_the_blocks_only_rejected_tokens_took():
    cache = PagedKVCache(num_blocks=16, block_size=4)
    seq = cache.allocate_seq(6)
    cache.append(seq, 6)  # the prompt
    used = cache.allocator.num_used  # 2 blocks: 6 tokens
    cache.append(seq, 1 + 5)  # a step's token and 5 drafts: 12 tokens, a third block
    assert cache.allocator.num_used == used + 1
    cache.truncate(seq, 8)  # 1 draft accepted: 8 tokens fill 2 blocks exactly
    assert cache.allocator.num_used == used and cache.get_seq_len(seq) == 8
    assert cache.audit() == []
    cache.append(seq, 1)  # grows again where it left off
    assert cache.allocator.num_used == used + 1 and cache.get_seq_len(seq) == 9
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(seq, 10)
    cache.free_seq(seq)
    assert cache.allocator.num_used == 0 and cache.audit() == []


def test_truncate_contiguous_only_shortens():
    cache = ContiguousKVCache(max_batch_size=2, max_seq_len=32, block_size=4)
    seq = cache.allocate_seq(5)
    cache.append(seq, 5 + 4)
    cache.truncate(seq, 7)
    assert cache.get_seq_len(seq) == 7
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(seq, 8)
