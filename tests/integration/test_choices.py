"""n > 1 on SmolLM2 under preemption: a seeded choice's tokens depend on its prompt, seed
and index only, whatever the pool, the drafts or the overlap of steps.

A real model at a moderate temperature: a choice restarted on K/V that is not its own
(another choice's output blocks) samples other tokens, which the random tiny models at
high temperatures cannot show.
"""

from __future__ import annotations

import pytest

from jpaged import LLM, SamplingParams
from jpaged.engine.interface import PromptRequest
from jpaged.engine.llm import Completion

# repetitive enough for n-gram drafts to be proposed and some accepted at temperature 0.9
PROMPTS = [
    "Count: one, two,",
    "Name a color and repeat it: red red red red. Now you:",
]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True, n=4),
]
NGRAM = {
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 8,
}
SMALL = dict(dtype="float32", warmup=False, max_seq_len=64, max_batch_size=8, block_size=4)


def run(llm: LLM) -> tuple[list[list[tuple[list[int], str]]], dict[str, float]]:
    """Every choice's tokens and finish reason; a request that never finishes fails."""
    engine = llm.engine
    states = [
        engine.add(engine.prepare(PromptRequest(p, sp)))
        for p, sp in zip(PROMPTS, PARAMS, strict=True)
    ]
    for _ in range(300):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "a request never finished"
    s = engine.stats()
    assert s["kv_blocks_used"] == 0 and engine.cache.audit() == []
    return [[(c.token_ids, c.finish_reason) for c in Completion.of(st).choices] for st in states], s


@pytest.fixture(scope="module")
def smol(demo_model):
    return demo_model("smollm2-135m")


@pytest.fixture(scope="module")
def roomy(smol):
    return run(LLM(smol, **SMALL))[0]


# 26 blocks of 4 tokens: the group (~23 blocks) fits alone, not beside the other request,
# whose decodes preempt it; 14: one choice (8 blocks) fits, the group together never does.
# Drafts make choices run ahead of each other, and async scheduling reads tokens a step late.
@pytest.mark.parametrize(
    ("num_blocks", "speculative", "async_scheduling"),
    [(26, None, True), (14, None, True), (14, NGRAM, True), (14, NGRAM, False)],
)
def test_seeded_choices_under_preemption_equal_a_roomy_pool(
    smol, roomy, num_blocks, speculative, async_scheduling
):
    llm = LLM(
        smol,
        num_blocks=num_blocks,
        speculative=speculative,
        async_scheduling=async_scheduling,
        **SMALL,
    )
    got, s = run(llm)
    assert got == roomy
    assert s["preemptions"] > 0
    if speculative:
        assert s["spec_accepted_tokens"] > 0
