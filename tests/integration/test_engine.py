"""The engine end to end on tiny checkpoints: parity, budgets, preemption, failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jpaged
from jpaged import LLM, SamplingParams
from jpaged.cache import kv_pool
from jpaged.engine import programs
from jpaged.engine.interface import PromptRequest

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = [[5, 17, 99, 3], list(range(30, 53)), [200], list(range(7, 16)), [42] * 17]
SMALL = dict(dtype="float32", warmup=False, max_seq_len=64, max_batch_size=4, block_size=4)


def ids(completions):
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3moe"])
def test_greedy_paged_equals_contiguous_equals_transformers(
    family, loaded, tiny_checkpoint, hf_reference
):
    model = loaded(family)
    # 45 tokens: a prompt that spans two prefill tiles, prefilled in one call with the others
    prompts = [*PROMPTS, list(range(60, 105))]
    paged = LLM(model, backend="paged", **SMALL).generate(prompts, GREEDY)
    contiguous = LLM(model, backend="contiguous", **SMALL).generate(prompts, GREEDY)
    assert ids(paged) == ids(contiguous)
    hf = hf_reference(tiny_checkpoint(family))
    eos = list(model.config.eos_token_ids)
    for prompt, got in zip(prompts, paged, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt)),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
        assert got.token_ids == out[0, len(prompt) :].tolist()
        assert got.finish_reason == ("stop" if got.token_ids[-1] in eos else "length")


def test_enforce_eager_serves_the_same_tokens_through_its_own_programs(loaded, monkeypatch):
    calls = []
    eager = programs.eager_step_fn
    counted = lambda *a, **k: calls.append(1) or eager(*a, **k)  # noqa: E731
    monkeypatch.setattr(programs, "eager_step_fn", counted)
    default = LLM(loaded("llama"), **SMALL).generate(PROMPTS, GREEDY)
    assert not calls
    assert ids(LLM(loaded("llama"), enforce_eager=True, **SMALL).generate(PROMPTS, GREEDY)) == ids(
        default
    )
    assert calls


def test_a_step_with_its_sampler_in_one_launch_samples_what_two_launches_do(loaded, monkeypatch):
    """A GPU's path (`Runner.one_launch`), forced here: greedy and seeded rows sample the
    tokens of the two-program path, and a batch asking for alternatives or penalties takes
    the two programs."""
    params = [
        SamplingParams(max_tokens=9, temperature=t, seed=3, ignore_eos=True, **extra)
        for t, extra in ((0, {}), (0.9, {}), (0.9, {"logprobs": 2, "presence_penalty": 0.5}))
    ]
    few_buckets = {**SMALL, "max_num_batched_tokens": 16}
    two = LLM(loaded("llama"), **few_buckets)
    one = LLM(loaded("llama"), **few_buckets)
    one.engine.runner.one_launch = True
    one.engine.runner.warmup()
    warm = one.engine.runner.compilations
    calls = []
    fused = programs.step_sampled_fn
    monkeypatch.setattr(
        programs, "step_sampled_fn", lambda *a, **k: calls.append(k["greedy"]) or fused(*a, **k)
    )
    for p in params:
        expected = two.generate(PROMPTS[:2], p)
        got = one.generate(PROMPTS[:2], p)
        assert ids(got) == ids(expected)
        assert [c.logprobs for c in got] == [c.logprobs for c in expected]
        if not p.presence_penalty:  # (penalties' sampler compiles when first needed)
            assert one.engine.runner.compilations == warm
    assert set(calls) == {True, False}  # (the third took two)
    assert not two.engine.runner.one_launch  # a CPU's default


def test_zero_compilations_after_warmup(loaded):
    llm = LLM(
        loaded("llama"),
        dtype="float32",
        max_seq_len=128,
        max_batch_size=2,
        block_size=4,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.runner
    # one step program per token bucket, one sampler per sequence count and variant
    assert [s.tokens for s in runner.warmup_shapes()] == runner.token_ladder == [1, 4, 8, 16, 32]
    assert llm.engine.warmup_compilations <= 5 + 2 * 4 + 1  # + the block copy
    rng = np.random.default_rng(0)
    # lengths that hit every chunk, width and batch bucket, chunking (40 > 32) and sampling
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 3, 9, 16, 17, 33, 40, 20)]
    # every sampler variant: greedy or not, with and without logprobs
    params = [
        SamplingParams(max_tokens=int(m), temperature=t, ignore_eos=True, seed=1, logprobs=lp)
        for m, t, lp in zip(
            (14, 3, 20, 1, 8, 5, 8, 27), (0, 0.8) * 4, (None, None, 2, 2) * 2, strict=True
        )
    ]
    out = llm.generate(prompts, params)
    assert [len(c.token_ids) for c in out] == [p.max_tokens for p in params]
    assert llm.stats()["compilations_after_warmup"] == 0


def test_preemption_recomputes_and_matches_unconstrained(loaded):
    model = loaded("llama")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = LLM(model, **SMALL).generate(PROMPTS, params)
    tight = LLM(model, num_blocks=16, **SMALL)  # 64 tokens for ~110 wanted at once
    assert ids(tight.generate(PROMPTS, params)) == ids(free)
    stats = tight.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_used"] == 0 and tight.engine.cache.audit() == []


def test_chunked_prefill_matches_one_shot(loaded):
    model = loaded("qwen3")
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [list(range(3, 50)), [9, 8, 7]]
    whole = LLM(model, **SMALL).generate(prompts, params)
    chunked = LLM(model, max_num_batched_tokens=8, **SMALL)
    assert ids(chunked.generate(prompts, params)) == ids(whole)


def test_prompt_too_big_for_the_pool_is_refused_and_nothing_else_breaks(loaded):
    llm = LLM(loaded("llama"), num_blocks=4, **SMALL)  # 16 tokens
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([list(range(20))], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=63))
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) > 0


def test_failed_step_fails_only_its_requests_and_frees_blocks(loaded, monkeypatch):
    llm = LLM(loaded("llama"), **SMALL)
    real = programs.step_fn
    calls = {"n": 0}

    def flaky(params, kv, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            kv.k.delete()  # as if the donated pool died with the step
            raise RuntimeError("boom")
        return real(params, kv, *args, **kwargs)

    monkeypatch.setattr(programs, "step_fn", flaky)
    engine = llm.engine
    engine.add(
        first := engine.prepare(
            PromptRequest([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
        )
    )
    engine.step()  # prefill of the first
    engine.add(
        second := engine.prepare(
            PromptRequest([4, 5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
        )
    )
    outputs = engine.step()  # one call: the first's decode and the second's prefill fail
    failed = {o.request_id: o for o in outputs if o.finish_reason == "error"}
    assert set(failed) == {first.id, second.id} and "boom" in failed[second.id].error
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.audit() == [] and engine.stats()["kv_blocks_used"] == 0
    again = llm.generate([[4, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))
    expected = LLM(loaded("llama"), **SMALL).generate(
        [[4, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0)
    )
    assert ids(again) == ids(expected)


def test_failed_block_copy_fails_its_step_and_the_engine_keeps_serving(loaded, monkeypatch):
    llm = LLM(loaded("llama"), **SMALL)
    real = kv_pool.copy_blocks_jit

    def broken(kv, pairs):
        kv.k.delete()  # as if the donated pool died with the copy
        raise RuntimeError("copy failed")

    monkeypatch.setattr(kv_pool, "copy_blocks_jit", broken)
    # two choices share the prompt's partial last block: the second to write it copies it
    out = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=4, temperature=0, n=2))
    assert [c.finish_reason for c in out[0].choices] == ["error", "error"]
    assert "copy failed" in out[0].choices[0].error
    engine = llm.engine
    assert engine.cache.audit() == [] and engine.stats()["kv_blocks_used"] == 0
    monkeypatch.setattr(kv_pool, "copy_blocks_jit", real)
    expected = LLM(loaded("llama"), **SMALL).generate(PROMPTS[:2], GREEDY)
    assert ids(llm.generate(PROMPTS[:2], GREEDY)) == ids(expected)


def test_seeded_sampling_is_reproducible_and_batch_independent(loaded):
    model = loaded("gemma3")
    params = SamplingParams(
        max_tokens=10, temperature=30.0, top_p=0.95, top_k=100, seed=123, ignore_eos=True
    )
    alone = LLM(model, **SMALL).generate([PROMPTS[1]], params)
    crowd = LLM(model, **SMALL).generate(PROMPTS, [GREEDY, params, GREEDY, GREEDY, GREEDY])
    assert alone[0].token_ids == crowd[1].token_ids
    other = LLM(model, **SMALL).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=10, temperature=30.0, seed=124, ignore_eos=True)
    )
    assert other[0].token_ids != alone[0].token_ids


def test_logprobs_stop_strings_and_generate_api(loaded):
    model = loaded("llama")
    out = jpaged.generate(
        ["hello", [3, 4, 5]],
        model=model,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        ignore_eos=True,
        **SMALL,
    )
    assert len(out) == 2
    for c in out:
        assert len(c.logprobs) == len(c.token_ids) == 6
        assert all(len(top) <= 3 for top in c.top_logprobs)
        assert max(c.top_logprobs[0].values()) == pytest.approx(c.logprobs[0], abs=1e-5)
        assert c.ttft_s is not None and 0 < c.ttft_s <= c.latency_s
    assert out[0].prompt_token_ids == model.tokenizer.encode("hello")
    text = out[0].text
    assert len(text) > 2, text  # the stop check below needs a piece of it
    stopped = jpaged.generate(
        ["hello"],
        model=model,
        max_tokens=6,
        temperature=0,
        stop=[text[1:3]],
        ignore_eos=True,
        **SMALL,
    )[0]
    # stop on a piece of what greedy produces: cut before it
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.find(text[1:3])]
    with pytest.raises(TypeError, match="bogus"):
        jpaged.generate(["x"], model=model, bogus=1)
    # one prompt, its parameters in a list of one
    assert len(LLM(model, **SMALL).generate("hello", [GREEDY])) == 1


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_long_prompt_never_stalls_running_sequences(loaded, async_scheduling):
    """A long prompt prefilled in chunks beside 32 decoding sequences: every step hands
    each of them a token (decodes and chunks share the step)."""
    llm = LLM(
        loaded("llama"),
        dtype="float32",
        warmup=False,
        max_seq_len=512,
        max_batch_size=40,
        block_size=8,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    running = [engine.prepare(PromptRequest([3 + i, 7, 11], params)) for i in range(32)]
    for r in running:
        engine.add(r)
    while any(len(r.output_ids) < 2 for r in running):
        engine.step()
    prompt = [5 + i % 300 for i in range(400)]
    engine.add(
        long := engine.prepare(PromptRequest(prompt, SamplingParams(max_tokens=2, temperature=0)))
    )
    steps = 0
    while not long.output_ids:
        outputs = engine.step()
        steps += 1
        got = {o.request_id: len(o.token_ids) for o in outputs}
        assert all(got.get(r.id) == 1 for r in running), got
    # 400 prompt tokens at 64 - 32 decodes per step: chunked over 13 steps at least
    assert steps >= 400 // 32
    while engine.has_unfinished():
        engine.step()
    alone = LLM(loaded("llama"), dtype="float32", warmup=False, max_seq_len=512, block_size=8)
    assert long.output_ids == alone.generate([prompt], long.params)[0].token_ids


def test_pallas_engine_matches_xla_token_for_token(loaded):
    """The Pallas ragged kernel (interpreted on CPU) serves the engine: mixed steps of
    decodes and chunked prompts give the XLA path's tokens."""
    model = loaded("qwen3")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[0], list(range(3, 43))]
    out = {
        impl: ids(
            LLM(model, attention_impl=impl, max_num_batched_tokens=24, **SMALL).generate(
                prompts, params
            )
        )
        for impl in ("xla", "pallas")
    }
    assert out["pallas"] == out["xla"]


def test_a_stream_cut_by_a_stop_string_carries_a_scripts_text_and_frees_its_blocks(loaded):
    """The output processor reads token ids alone (`CoreOutputs`), whoever steps: a stream
    through the async front and the offline API cut the same text at a stop string, and
    the request's blocks are free once its last output is out."""
    import asyncio

    from jpaged.config import EngineConfig
    from jpaged.engine.async_engine import AsyncEngine
    from jpaged.engine.engine import Engine

    model = loaded("llama")
    prompt = list(range(30, 53))
    whole = LLM(model, **SMALL).generate([prompt], SamplingParams(max_tokens=24, temperature=0))
    text = whole[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=24, temperature=0, stop=[stop])
    [offline] = LLM(model, **SMALL).generate([prompt], params)
    assert offline.finish_reason == "stop" and len(offline.text) < len(text)

    engine = Engine(model, EngineConfig(**SMALL))

    async def stream():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            return [out async for out in aengine.generate(PromptRequest(prompt, params))]
        finally:
            aengine.stop()

    outs = asyncio.run(stream())
    assert "".join(o.text for o in outs) == offline.text
    assert outs[-1].finish_reason == "stop" and outs[-1].request_finished
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0
