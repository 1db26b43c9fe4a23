"""The batch's steady decode steps: the latest layout moved on, equal to a whole build."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.paged import PagedKVCache
from jpaged.config import EngineConfig
from jpaged.engine.batch import Batcher
from jpaged.engine.contract import Row


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_steady_decode_step_packs_as_a_whole_build_packs_it(backend: str, impl: str) -> None:
    config = EngineConfig(max_batch_size=8, max_seq_len=64, block_size=4, warmup=False)
    # (a contiguous region's page table is whole from the start: its pages never change)
    cache = (
        PagedKVCache(num_blocks=64, block_size=4)
        if backend == "paged"
        else ContiguousKVCache(max_batch_size=8, max_seq_len=64, block_size=4)
    )
    steady = Batcher(config, cache, impl, lora=False, gpu=False)
    planned, built = [], []
    plan = steady._plan
    steady._plan = lambda *a, **k: planned.append(1) or plan(*a, **k)  # type: ignore[method-assign]
    seqs = [cache.allocate_slots(None, n, num_tokens=n)[0] for n in (2, 9, 3, 6, 7)]
    for k in range(16):
        if k == 7:  # two sequences leave: the rest laid out anew, in a smaller bucket
            cache.free_seq(seqs.pop(3))
            cache.free_seq(seqs.pop(0))
        if k == 11:  # a sequence leaves, another comes: built whole again
            cache.free_seq(seqs.pop(0))
            seqs.append(cache.allocate_slots(None, 5, num_tokens=5)[0])
        rows = [
            Row(s, [0], temperature=0.5, seed=7, sample_index=k, on_device=True, block_eos=k < 3)
            for s in seqs
        ]
        for s in seqs:
            cache.allocate_slots(s, 1)
        ring_of = {s: i + 8 * (k % 2) for i, s in enumerate(seqs)}  # the ring's halves alternate
        slots = np.array([ring_of[s] for s in seqs])
        got = steady.steady(np.array(seqs), np.full(len(seqs), k), slots)
        if got is None:
            built.append(k)
            got = steady.build(rows, ring_of)
        whole = Batcher(config, cache, impl, lora=False, gpu=False).build(rows, ring_of)
        assert np.array_equal(got.pack(k % 3), whole.pack(k % 3)), k
    # steps 0-4 (EOS blocked until 3: no steady layout before 4) and 11 (the new sequence)
    # were built whole; the rest moved the latest layout on, planned anew where a row's
    # page starts (a paged cache's table grows then) or rows left
    assert built == [0, 1, 2, 3, 11]
    assert 7 <= len(planned) <= 14
