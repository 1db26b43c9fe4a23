"""Runner shape buckets: ladders, and that warm-up lists every bucket serving produces."""

from __future__ import annotations

import numpy as np
import pytest

import models
from jpaged.config import EngineConfig
from jpaged.engine import runner as runner_mod
from jpaged.engine.engine import make_cache
from jpaged.engine.runner import PREFILL_TILE, Row, Runner, StepResult


@pytest.mark.parametrize("limit", [1, 5, 48, 12288])
def test_half_octave_ladder_pads_at_most_a_half(limit: int) -> None:
    ladder = runner_mod._half_octave_ladder(limit)
    assert ladder == sorted(set(ladder)) and ladder[-1] == limit
    assert all(runner_mod._bucket(n, ladder) <= 1.5 * n for n in range(1, limit + 1))


def test_batch_ladder_follows_vllm_sizes() -> None:
    assert runner_mod._batch_ladder(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert runner_mod._batch_ladder(5) == [1, 2, 4, 5]
    assert runner_mod._batch_ladder(256)[-4:] == [96, 128, 192, 256]


@pytest.mark.parametrize(
    "backend,impl", [("paged", "xla"), ("contiguous", "xla"), ("paged", "pallas")]
)
def test_warmup_lists_every_bucket_run_produces(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, backend: str, impl: str
) -> None:
    """Random decode and prefill calls, with the device step replaced by a recorder."""
    model = models.load(str(tiny_llama_dir), dtype="float32")
    config = EngineConfig(
        backend=backend, max_batch_size=6, max_seq_len=256, block_size=8,
        max_num_batched_tokens=96, attention_impl=impl, warmup=False, dtype="float32",
    )  # fmt: skip
    cache = make_cache(config, config.usable_blocks(model.config))
    runner = Runner(model, config, cache)
    seen = []

    def record(shape, packed, sampler):  # noqa: ANN001, ANN202 - stands in for the device
        f = shape.unpack(packed)  # one int32 array carries every field
        assert packed.shape == (shape.size(),) and packed.dtype == np.int32
        assert f["slot_mapping"].shape == f["tokens"].shape == (shape.rows, shape.lq)
        out = np.zeros((shape.rows, 12), np.int32)
        out[:, 0] = np.arange(shape.rows)
        return out

    monkeypatch.setattr(runner, "_execute", record)
    shapes = set(runner.warmup_shapes())
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, config.max_batch_size + 1))
        lens = rng.integers(1, 200, n)
        seqs = []
        for length in lens.tolist():
            seqs.append(cache.allocate_slot(length))
            cache.append(seqs[-1], length)
        if rng.random() < 0.5:
            rows = [Row(s, [7]) for s in seqs]
        else:  # chunks within the token budget, at most one tile of padding each
            budget = config.max_num_batched_tokens
            chunks = [min(int(x), budget // n) or 1 for x in rng.integers(1, 64, n)]
            rows = [
                Row(s, [3] * min(c, int(length)))
                for s, c, length in zip(seqs, chunks, lens, strict=True)
            ]
        result: StepResult = runner.run(rows)
        assert result.shape in shapes, result.shape
        seen.append(result.shape)
        # each row gets the token of its own (last) tile back
        assert len(result.tokens) == len(rows)
        if result.shape.lq == PREFILL_TILE:
            tiles = np.cumsum([-(-len(r.token_ids) // PREFILL_TILE) for r in rows]) - 1
            np.testing.assert_array_equal(result.tokens, tiles)
        for s in seqs:
            cache.free_slot(s)
    assert {s.lq for s in seen} == {1, PREFILL_TILE}
    assert any(s.pages for s in seen) == (impl == "xla")
