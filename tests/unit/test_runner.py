"""Runner token buckets: the ladder, and that warm-up lists every bucket serving produces."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jpaged import models
from jpaged.cache.groups import KVGroups
from jpaged.config import EngineConfig
from jpaged.engine import buckets
from jpaged.engine import compile as compile_mod
from jpaged.engine.contract import Row, StepResult
from jpaged.engine.engine import make_cache
from jpaged.engine.runner import Runner
from jpaged.engine.sampling import NUM_TOP_LOGPROBS
from jpaged.engine.sizing import cache_size


def test_token_ladder() -> None:
    assert buckets.token_ladder(512) == [1, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert buckets.token_ladder(5) == [1, 4, 5]
    ladder = buckets.token_ladder(12288)
    assert ladder == sorted(set(ladder)) and ladder[-1] == 12288
    # at most a third of a step above 32 tokens is padding
    assert all(buckets.bucket(n, ladder) <= max(32, 1.5 * n) for n in range(1, 12289))


@pytest.mark.parametrize(
    "backend,impl", [("paged", "xla"), ("contiguous", "xla"), ("paged", "pallas")]
)
def test_warmup_lists_every_bucket_run_produces(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, backend: str, impl: str
) -> None:
    """Random steps of decodes and prompt chunks, with the device replaced by a recorder."""
    model = models.load(str(tiny_llama_dir), dtype="float32")
    config = EngineConfig(
        backend=backend,
        max_batch_size=6,
        max_seq_len=256,
        block_size=8,
        max_num_batched_tokens=96,
        attention_impl=impl,
        warmup=False,
        dtype="float32",
    )
    cache = make_cache(config, config.usable_blocks(1))  # the default sizes ignore bytes
    runner = Runner(model, config, cache)
    seen = []
    calls = []

    def record(shape, packed, features=None):  # noqa: ANN001, ANN202 - stands in for the device
        f = shape.unpack(packed)  # one int32 array carries every field
        assert packed.shape == (shape.size(),) and packed.dtype == np.int32
        calls.append(f)
        # a row of results: the token, its logprob, then K top ids and K top logprobs
        out = np.zeros((shape.seqs, 2 + 2 * NUM_TOP_LOGPROBS), np.int32)
        out[:, 0] = f["tokens"][f["last"]]  # "sample" each sequence's last token
        return out, None, None

    def sample(pending, mask=None):  # noqa: ANN001, ANN202 - the results are the "logits"
        pending.packed, pending.unsampled = pending.unsampled[0], None

    monkeypatch.setattr(runner, "_forward", record)
    monkeypatch.setattr(runner, "sample", sample)
    shapes = set(runner.warmup_shapes())
    assert len(shapes) == len(runner.token_ladder)
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, config.max_batch_size + 1))
        lens = rng.integers(1, 200, n)
        budget = config.max_num_batched_tokens - n
        rows, seqs = [], []
        for i, length in enumerate(lens.tolist()):
            seqs.append(cache.allocate_seq(length))
            cache.append(seqs[-1], length)
            chunk = 1 if rng.random() < 0.5 else min(length, 1 + int(rng.integers(0, budget + 1)))
            budget -= chunk - 1
            rows.append(Row(seqs[-1], [1000 + i] * chunk))
        result: StepResult = runner.run(rows)
        assert result.shape in shapes, result.shape
        seen.append(result.shape)
        # each row gets back the token its own last position held
        np.testing.assert_array_equal(result.tokens, 1000 + np.arange(n))
        f = calls[-1]
        lens = [len(r.token_ids) for r in rows]
        np.testing.assert_array_equal(f["seq_of"][: sum(lens)], np.repeat(np.arange(n), lens))
        assert (f["seq_of"][sum(lens) :] == result.shape.seqs).all()
        for s in seqs:
            cache.free_seq(s)
    assert len({s.tokens for s in seen}) > 3


def test_warmup_progress_is_a_few_lines_in_a_log(capsys: pytest.CaptureFixture[str]) -> None:
    progress = compile_mod.Progress(29, "compiling 29 programs")
    for _ in range(29):
        progress.advance()
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err  # stderr is no terminal here: plain lines, never run together
    lines = err.splitlines()
    assert lines[0] == "jpaged: warm-up: compiling 29 programs" and len(lines) == 5
    assert lines[-1].startswith("jpaged: warm-up 29/29 programs")


def test_compilation_cache_is_set_only_when_asked(tiny_llama_dir, tmp_path) -> None:
    """JAX's cache settings are the whole process's: a library user's engine leaves them
    alone unless its config names a directory."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {n: getattr(jax.config, n) for n in names}
    model = models.load(str(tiny_llama_dir), dtype="float32")
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        config = EngineConfig(max_seq_len=32, max_batch_size=2, warmup=False, dtype="float32")
        Runner(model, config, make_cache(config, config.usable_blocks(1)))
        assert {n: getattr(jax.config, n) for n in names} == {**saved, names[0]: None}
        config = EngineConfig(**{**vars(config), "compilation_cache_dir": str(tmp_path)})
        Runner(model, config, make_cache(config, config.usable_blocks(1)))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)


def test_a_compilation_cache_entry_appears_whole(tmp_path, monkeypatch) -> None:
    """Processes sharing the cache (the suite's workers) read an entry whole or not at all:
    it is written aside and renamed to its name."""
    from jax._src import lru_cache

    assert lru_cache.LRUCache.put is compile_mod._put_whole  # (tests/conftest.py's cache)
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    seen = []

    def replace(src: str, dst: str) -> None:
        seen.append((Path(src).read_bytes(), Path(dst).exists()))
        real_replace(src, dst)

    real_replace = compile_mod.os.replace
    monkeypatch.setattr(compile_mod.os, "replace", replace)
    cache.put("k", b"program")
    cache.put("k", b"another")  # an entry is never rewritten
    assert seen == [(b"program", False)]
    assert cache.get("k") == b"program"
    assert [p.name for p in tmp_path.iterdir()] == ["k-cache"]


def test_a_step_call_does_not_hash_the_model(tiny_llama_dir, monkeypatch) -> None:
    """jit hashes its static arguments (and a pytree argument's static parts) at every call:
    the model's GraphDef, ~125 us to hash, goes in hashed once (`programs.Static`)."""
    model = models.load(str(tiny_llama_dir), dtype="float32")
    config = EngineConfig(max_seq_len=32, max_batch_size=2, warmup=False, dtype="float32")
    runner = Runner(model, config, make_cache(config, config.usable_blocks(1)))
    shape = runner.shape(1)

    def call() -> None:
        jax.block_until_ready(runner._forward(shape, np.zeros(shape.size(), np.int32))[0])

    call()  # compiles
    compiled, hashed = runner.compilations, []
    graphdef = type(runner.graphdef.value)
    real = graphdef.__hash__
    monkeypatch.setattr(graphdef, "__hash__", lambda self: hashed.append(1) or real(self))
    call()
    assert not hashed and runner.compilations == compiled


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_runner_without_a_cache_sizes_its_pool_as_the_cache_does(backend: str) -> None:
    """Distributed workers build no host cache: their pool must still match process 0's."""
    config = EngineConfig(backend=backend, max_batch_size=3, max_seq_len=100, block_size=16)
    groups = KVGroups.of(4, (True, False) * 2, 32, hybrid=backend == "paged")
    cache = make_cache(config, 7, groups)
    size = cache_size(config, 7, groups)
    assert (size.num_blocks, size.num_groups) == (cache.num_blocks, cache.num_groups)
    with pytest.raises(RuntimeError, match="builds no steps"):
        size.page_tables([0], 4)


def test_the_pool_takes_its_fraction_of_the_device_after_weights_and_activations() -> None:
    from jpaged.engine.engine import blocks_in_budget

    gib = 1 << 30
    # 0.9 x 80 GiB = 72, less 2.5 in use, less 1.5 for a step: 68 GiB of 2 MiB blocks
    blocks, arithmetic = blocks_in_budget(80 * gib, 0.9, int(2.5 * gib), int(1.5 * gib), 2 << 20)
    assert blocks == 68 * 512 - 1  # the null block apart
    for part in ("0.9 x 80.00 GiB", "- 2.50 GiB in use", "- 1.50 GiB", "= 68.00 GiB", "34816 "):
        assert part in arithmetic, arithmetic
    with pytest.raises(ValueError, match="memory_fraction=0.1 .* no KV block"):
        blocks_in_budget(80 * gib, 0.1, 6 * gib, 2 * gib, 2 << 20)
    assert EngineConfig(dtype="float32").kv_fraction() is None  # a CPU keeps its default
    with pytest.raises(ValueError, match="memory_fraction"):
        EngineConfig(memory_fraction=1.5)
    with pytest.raises(ValueError, match="memory_fraction or num_blocks"):
        EngineConfig(memory_fraction=0.5, num_blocks=10)


def test_memory_fraction_sizes_the_pool_from_what_the_device_holds(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CPU, with the flag: a (fake) memory less the weights and a step's peak."""
    from jpaged.engine import engine as engine_mod

    model = models.load(str(tiny_llama_dir), dtype="float32")
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model)))
    monkeypatch.setattr(engine_mod, "device_memory", lambda device, w: (100 << 20, w))
    config = EngineConfig(
        max_seq_len=64, max_batch_size=2, warmup=False, dtype="float32", memory_fraction=0.5
    )
    engine = engine_mod.Engine(model, config)
    peak = engine.runner.activation_bytes(config.blocks_per_seq)
    assert 0 < peak < 50 << 20
    want, arithmetic = engine_mod.blocks_in_budget(
        100 << 20, 0.5, weights, peak, engine.block_bytes
    )
    assert engine.cache.num_blocks == want + 1 and want > config.usable_blocks(1)
    assert arithmetic in capsys.readouterr().err
