"""Several decode steps a call (`EngineConfig.num_scheduler_steps`): outputs equal one step
a call, token for token, and the steps the host must see between tokens stay one a call."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig
from jpaged.engine.beam import BeamSearchParams
from jpaged.engine.engine import Engine
from jpaged.engine.interface import PromptRequest
from jpaged.engine.sampling import StructuredOutputsParams

SMALL = dict(
    dtype="float32",
    warmup=False,
    max_seq_len=96,
    max_batch_size=8,
    block_size=4,
    compilation_cache_dir=None,
)
rng = np.random.default_rng(0)
PROMPTS = [[int(t) for t in rng.integers(3, 250, int(n))] for n in rng.integers(3, 20, 5)]
PROMPTS.append(PROMPTS[0] + [7, 8, 9])  # a shared prefix for the prefix cache


def run(model, params, k, **options):
    llm = LLM(model, **SMALL | options, num_scheduler_steps=k)
    out = llm.generate(PROMPTS, params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and llm.engine.cache.audit() == []
    return [(c.token_ids, c.finish_reason) for o in out for c in o.choices], stats


def mixed(**fields):
    """Each prompt its own max_tokens: rows finish in the middle of a call."""
    return [SamplingParams(max_tokens=m, **fields) for m in (5, 17, 30, 9, 2, 23)]


@pytest.mark.parametrize(
    ("family", "params", "options"),
    [
        ("llama", mixed(temperature=0), {}),
        ("llama", mixed(temperature=0.9, seed=3), {}),
        ("llama", SamplingParams(max_tokens=21, temperature=0.9, seed=5, n=3), {}),
        ("llama", mixed(temperature=0), {"async_scheduling": False}),
        ("llama", mixed(temperature=0.9, seed=3), {"enable_prefix_caching": False}),
        # a pool that preempts (and, tight, leaves calls of one step)
        ("llama", SamplingParams(max_tokens=40, temperature=0, n=2), {"num_blocks": 40}),
        ("llama", mixed(temperature=0), {"backend": "contiguous"}),
        ("gemma3", mixed(temperature=0.9, seed=1), {}),  # KV groups: windows
        ("qwen3", mixed(temperature=0), {}),
    ],
)
def test_outputs_equal_one_step_a_call(family, params, options, loaded):
    model = loaded(family)
    one, one_stats = run(model, params, 1, **options)
    four, four_stats = run(model, params, 4, **options)
    assert four == one
    assert four_stats["decode_calls"] < one_stats["decode_calls"]  # several steps a call ran
    if "num_blocks" in options:
        assert one_stats["preemptions"] > 0


def test_stop_tokens_in_the_middle_of_a_call(loaded):
    model = loaded("llama")
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=False)
    plain, _ = run(model, greedy, 1)
    # tokens each output reaches at various points of a call
    stops = sorted({ids[j] for ids, _ in plain for j in (3, 6, 9) if len(ids) > j})
    params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=stops)
    one, _ = run(model, params, 1)
    four, _ = run(model, params, 4)
    assert four == one
    assert any(reason == "stop" for _, reason in one)


def test_stop_strings_in_the_middle_of_a_call(loaded):
    model = loaded("llama")
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    text = LLM(model, **SMALL).generate(PROMPTS, greedy)
    stops = [o.text[len(o.text) // 3 :][:2] for o in text[:3] if len(o.text) > 6]
    assert stops
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=stops)

    def texts(k):
        out = LLM(model, **SMALL, num_scheduler_steps=k).generate(PROMPTS, params)
        return [(o.text, o.token_ids, o.finish_reason) for o in out]

    one = texts(1)
    assert texts(4) == one
    assert any(reason == "stop" for _, _, reason in one)


def test_requests_arriving_while_others_decode(loaded):
    """A request added between steps is admitted at the next step: its prompt waits for
    the call in flight, not for the decoding ones to end."""

    def serve(k):
        engine = Engine(loaded("llama"), EngineConfig(**SMALL, num_scheduler_steps=k))
        outs: dict[str, list[int]] = {}
        params = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
        for p in PROMPTS[:2]:
            engine.add(engine.prepare(PromptRequest(p, params, f"r{len(outs)}")))
            outs[f"r{len(outs)}"] = []
        steps = 0
        while engine.has_unfinished():
            steps += 1
            if steps in (4, 7, 11) and len(outs) < len(PROMPTS):
                prompt = PromptRequest(PROMPTS[len(outs)], params, f"r{len(outs)}")
                engine.add(engine.prepare(prompt))
                outs[f"r{len(outs)}"] = []
            for o in engine.step():
                outs[o.request_id] += o.token_ids
        return outs, engine.stats()

    one, one_stats = serve(1)
    four, stats = serve(4)
    assert four == one
    assert stats["kv_blocks_used"] == 0 and stats["decode_calls"] < one_stats["decode_calls"]


@pytest.mark.parametrize(
    ("params", "options"),
    [
        (SamplingParams(max_tokens=12, temperature=0, logprobs=2), {}),
        (SamplingParams(max_tokens=12, temperature=0.9, seed=2, presence_penalty=0.5), {}),
        (SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=[9]), {}),
        (SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1), {}),
        (
            SamplingParams(
                max_tokens=12, temperature=0, structured=StructuredOutputsParams(regex="[ab]{8}")
            ),
            {},
        ),
        (
            SamplingParams(max_tokens=12, temperature=0),
            {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
        ),
    ],
)
def test_steps_the_host_must_see_stay_one_a_call(params, options, loaded):
    model = loaded("llama")
    one, _ = run(model, params, 1, **options)
    four, stats = run(model, params, 4, **options)
    assert four == one
    _, several = run(model, SamplingParams(max_tokens=12, temperature=0), 4)
    assert stats["decode_calls"] > several["decode_calls"]  # (every call one step)


def test_beam_search_with_several_steps_set(loaded):
    model = loaded("llama")
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)

    def beams(k):
        llm = LLM(model, **SMALL, num_scheduler_steps=k)
        return [[b.token_ids for b in o.sequences] for o in llm.beam_search(PROMPTS[:2], params)]

    assert beams(4) == beams(1)


def test_one_plain_request_among_others_waits_for_none(loaded):
    """A request with logprobs among plain ones: every call is one step, outputs unchanged."""
    model = loaded("llama")
    params = [*mixed(temperature=0)[:5], SamplingParams(max_tokens=20, logprobs=1)]
    one, _ = run(model, params, 1)
    four, _ = run(model, params, 4)
    assert four == one


def test_nothing_compiles_after_warmup(loaded):
    llm = LLM(
        loaded("llama"),
        **SMALL | {"warmup": True, "max_num_batched_tokens": 32},
        num_scheduler_steps=4,
    )
    params = [
        SamplingParams(max_tokens=m, temperature=t, seed=1)
        for m, t in zip((5, 17, 30, 9, 2, 23), (0, 0.8, 0, 0.8, 0, 0), strict=True)
    ]
    llm.generate(PROMPTS, params)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=9, temperature=0))
    stats = llm.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["decode_calls"] < sum(p.max_tokens for p in params)


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)


def test_the_server_flag_sets_it():
    from server.cli import build_parser

    assert build_parser().parse_args([]).num_scheduler_steps == 1
    assert build_parser().parse_args(["--num-scheduler-steps", "4"]).num_scheduler_steps == 4
