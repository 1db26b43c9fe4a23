"""Scheduler policy over the real caches, with requests that never touch a model."""

import numpy as np
import pytest

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.groups import KVGroups
from jpaged.cache.paged import PagedKVCache
from jpaged.config import EngineConfig
from jpaged.engine.contract import CoreOutputs, StepResult
from jpaged.engine.request import Request, Status
from jpaged.engine.sampling import SamplingParams
from jpaged.engine.scheduler import Scheduler


def request(n_prompt, max_tokens=64, first=0):
    ids = list(range(first, first + n_prompt))
    return Request(ids, SamplingParams(max_tokens=max_tokens), ())


def run(sched, schedule):
    """Pretend the model ran and sampled token 1 on every row."""
    n = len(schedule.rows)
    result = StepResult(
        np.ones(n, np.int32),
        np.zeros(n, np.float32),
        np.zeros((n, 5), np.int32),
        np.zeros((n, 5), np.float32),
        shape=None,
    )
    sched.postprocess(schedule.rows, result, CoreOutputs())


def chunks(schedule):
    """Each row's request and the tokens it computes (1 for a decode)."""
    return [(r.req, len(r.token_ids)) for r in schedule.rows]


def paged(num_blocks, **kw):
    cfg = EngineConfig(block_size=4, num_blocks=num_blocks, max_seq_len=256, **kw)
    cache = PagedKVCache(
        num_blocks=num_blocks + 1, block_size=4, enable_prefix_caching=cfg.enable_prefix_caching
    )
    return Scheduler(cfg, cache)


def test_admits_under_batch_and_token_budget_and_chunks_long_prompts():
    s = paged(100, max_batch_size=3, max_num_batched_tokens=100, admission_reserve=0.0)
    reqs = [request(40), request(70), request(3), request(3)]
    for r in reqs:
        s.add(r)
    first = s.schedule()
    # the budget's 60 tokens left cut the second prompt (chunked prefill)
    assert chunks(first) == [(reqs[0], 40), (reqs[1], 60)]
    run(s, first)
    second = s.schedule()
    # the first decodes in the same step as the second's last chunk and a new prompt
    assert chunks(second) == [(reqs[0], 1), (reqs[1], 10), (reqs[2], 3)]
    assert len(s.running) == 3 and list(s.waiting) == [reqs[3]]  # batch budget of 3


def test_admission_reserve_keeps_room_for_running_decodes():
    s = paged(10, max_batch_size=8, admission_reserve=0.5)  # 40 tokens
    a, b = request(8), request(16, first=100)  # no shared prefix
    s.add(a)
    run(s, s.schedule())
    s.add(b)
    sched = s.schedule()  # 28 tokens free after a's 3 blocks: half is 14 < 16
    assert chunks(sched) == [(a, 1)] and list(s.waiting) == [b]


def test_sliding_groups_schedule_the_chunks_they_hold_and_never_preempt():
    """A tiny Gemma 3's groups (one full, six sliding over 16 tokens): 8 requests of 300
    + 64 tokens hold 8 x (23 + 6 x 2) = 280 blocks decoding, but a 300-token chunk holds
    19 blocks in each sliding group while it is computed. Chunks are granted only as far
    as they fit, so nobody is preempted and all 8 decode side by side."""
    cfg = EngineConfig(num_blocks=348, max_seq_len=512, max_batch_size=8)
    groups = KVGroups.of(7, [i % 6 != 5 for i in range(7)], 16)
    s = Scheduler(cfg, PagedKVCache(349, cfg.block_size, groups=groups))
    for i in range(8):
        s.add(request(300, first=1000 * i))
    decoding = 0
    step = s.schedule()
    while s.has_unfinished():  # as the engine does, the next step is scheduled first
        step, last = s.schedule(), step
        run(s, last)
        decoding = max(decoding, sum(r.prefilled for r in s.running))
    assert s.num_preemptions == 0 and decoding == 8
    assert s.cache.stats()["blocks_used_peak"] <= 348 and s.cache.audit() == []


def test_prompts_that_fill_the_pool_between_them_do_not_wait_forever():
    """Two prompts, each admitted with its chunk cut to what was left, fill a pool of 13
    blocks (one full group, two sliding over 8 tokens) between them: neither can go on.
    Once a step moved nothing, the older preempts the younger, which recomputes after."""
    cfg = EngineConfig(block_size=4, num_blocks=13, max_num_batched_tokens=17)
    groups = KVGroups(((0,), (1,), (2,)), (None, 8, 8))
    s = Scheduler(cfg, PagedKVCache(14, 4, enable_prefix_caching=False, groups=groups))
    old, young = request(17, 4), request(5, 4, first=100)
    s.add(old)
    s.add(young)
    first = s.schedule()  # 5 + 2 x 2 blocks, then 2 + 2 x 1
    assert chunks(first) == [(old, 8), (young, 2)]
    assert s.cache.stats()["blocks_free"] == 0
    run(s, first)
    for _ in range(2):  # the younger's next tokens fill its first blocks, no more fit
        run(s, s.schedule())
    assert s.schedule().rows == [] and s.num_preemptions == 0  # waiting, not preempting
    for _ in range(20):
        run(s, s.schedule())
    assert not s.has_unfinished() and s.num_preemptions == 1 and young.num_preemptions == 1


def test_preempts_youngest_when_blocks_run_out_and_recomputes_it():
    # (without a prefix cache: the preempted blocks would be found again)
    s = paged(4, max_batch_size=4, admission_reserve=0.0, enable_prefix_caching=False)
    old, young = request(8), request(8)
    s.add(old)
    s.add(young)
    run(s, s.schedule())  # 2 full blocks each: decoding the first token needs a third
    sched = s.schedule()
    assert chunks(sched) == [(old, 1)]
    assert young.status is Status.WAITING and s.waiting[0] is young
    assert young.num_computed == 0 and not young.prefilled and s.num_preemptions == 1
    assert s.cache.get_seq_len(old.seq_id) == 9
    run(s, sched)
    s.finish([old], "abort")
    again = s.schedule()  # recompute: prompt + the token it had generated
    assert chunks(again) == [(young, 9)]


def test_request_alone_outgrowing_the_pool_fails_cleanly():
    s = paged(2, max_batch_size=2)  # 8 tokens
    r = request(8)
    s.add(r)
    run(s, s.schedule())
    sched = s.schedule()
    assert sched.failed == [r] and r.finish_reason == "error"
    assert s.running == [] and s.cache.stats()["blocks_used"] == 0


def test_contiguous_admits_by_slots():
    cfg = EngineConfig(backend="contiguous", block_size=4, max_batch_size=2, max_seq_len=32)
    s = Scheduler(cfg, ContiguousKVCache(max_batch_size=2, max_seq_len=32, block_size=4))
    for _ in range(3):
        s.add(request(5))
    sched = s.schedule()
    assert len(sched.rows) == 2 and len(s.waiting) == 1


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"backend": "x"}, "backend"),
        ({"block_size": 0}, "block_size"),
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"admission_reserve": 1.0}, "admission_reserve"),
        ({"dtype": "int8"}, "dtype"),
        ({"attention_impl": "cuda"}, "attention_impl"),
        ({"num_blocks": 4, "kv_memory_bytes": 10}, "kv_memory_bytes"),
        ({"backend": "contiguous", "num_blocks": 4}, "num_blocks"),
    ],
)
def test_engine_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


# -- groups (n > 1) and prefix caching ---------------------------------------------------


def group(n_prompt, n, max_tokens=64):
    """A request with `n` choices, as Engine.prepare builds it."""
    params = SamplingParams(max_tokens=max_tokens, n=n)
    lead = Request(list(range(n_prompt)), params, ())
    lead.group += [Request(lead.prompt_ids, params, (), lead.id, index=i) for i in range(1, n)]
    for r in lead.group:
        r.group = lead.group
    return lead


def test_group_prefills_once_then_forks_and_copies_the_partial_block_on_write(pages_of):
    s = paged(100, max_batch_size=8)
    lead = group(10, 3)
    s.add(lead)
    first = s.schedule()
    assert chunks(first) == [(lead, 9)]  # all but the last prompt token
    assert s.running == [lead] and first.copies == []
    run(s, first)
    assert lead.output_ids == []  # no token before the fork
    second = s.schedule()
    assert s.running == lead.group  # forked, next to the leader
    assert [(r.index, n) for r, n in chunks(second)] == [(0, 1), (1, 1), (2, 1)]
    tables = [pages_of(s.cache, r.seq_id) for r in lead.group]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks shared
    assert len({t[2] for t in tables}) == 3  # the half-full one copied on first write
    assert len(second.copies) == 2 and s.cache.stats()["blocks_used"] == 2 + 3
    run(s, second)
    assert all(r.prefilled and len(r.output_ids) == 1 for r in lead.group)
    third = s.schedule()
    assert chunks(third) == [(r, 1) for r in lead.group] and third.copies == []


def test_one_token_prompt_forks_at_admission():
    s = paged(100, max_batch_size=8)
    lead = group(1, 4)
    s.add(lead)
    sched = s.schedule()
    assert [n for _, n in chunks(sched)] == [1, 1, 1, 1] and sched.copies == []
    assert s.cache.stats()["blocks_used"] == 4


def test_group_admission_needs_batch_room_for_every_choice():
    s = paged(100, max_batch_size=3)
    single, lead, last = request(4), group(4, 3), request(4)
    for r in (single, lead, last):
        s.add(r)
    run(s, s.schedule())
    # 1 + 3 sequences > 3: the group waits, and keeps its place ahead of the last one
    assert s.running == [single] and list(s.waiting) == [lead, last]
    s.finish([single], "abort")
    run(s, s.schedule())
    run(s, s.schedule())
    assert s.running == lead.group and list(s.waiting) == [last]


def test_forked_choices_are_preempted_and_readmitted_one_by_one():
    s = paged(8, max_batch_size=8, admission_reserve=0.0, enable_prefix_caching=False)
    old = request(8)
    lead = group(6, 3)
    s.add(old)
    s.add(lead)
    run(s, s.schedule())  # old: 8 tokens (2 blocks), lead: 5 (2 blocks)
    run(s, s.schedule())  # old decodes into a 3rd block; lead forks, 2 copies: 7 used
    assert len(s.running) == 4
    for _ in range(4):  # every choice opens a new block soon: the youngest must go
        sched = s.schedule()
        if s.waiting:
            break
        run(s, sched)
    last = lead.group[2]
    assert list(s.waiting) == [last] and s.running == [old, *lead.group[:2]]
    assert last.seq_id is None and last.num_computed == 0 and last.num_preemptions == 1
    assert chunks(sched) == [(old, 1), (lead, 1), (lead.group[1], 1)]  # the others go on
    assert s.num_preemptions == 1 and s.cache.audit() == []
    run(s, sched)
    s.finish([old], "abort")
    again = s.schedule()
    # alone, it recomputes the prompt and the tokens it had sampled, no other choice's
    assert chunks(again) == [(lead, 1), (lead.group[1], 1), (last, 6 + len(last.output_ids))]
    assert len(last.output_ids) < len(lead.output_ids)


@pytest.mark.parametrize(("max_tokens", "reason"), [(4, "length"), (64, "error")])
def test_group_the_pool_cannot_hold_runs_its_choices_apart(max_tokens, reason):
    s = paged(4, max_batch_size=8)  # 16 tokens
    lead = group(8, 3, max_tokens)  # 12 tokens a choice: one at a time fits
    s.add(lead)
    failed = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        sched = s.schedule()
        failed += sched.failed
        run(s, sched)
    # a choice fails only when it outgrows the pool alone: one after another
    assert [r.finish_reason for r in lead.group] == [reason] * 3
    assert len(failed) == (3 if reason == "error" else 0) and s.num_preemptions > 0
    assert s.running == [] and s.cache.stats()["blocks_used"] == 0 and s.cache.audit() == []


def test_admission_counts_only_the_uncached_tokens():
    s = paged(10, max_batch_size=8, admission_reserve=0.5)  # 40 tokens
    a = request(17)  # 4 full blocks + 1
    s.add(a)
    sched = s.schedule()
    run(s, sched)  # publishes a's 4 full blocks
    # 35 tokens stay free (5 blocks held), half of them is 17.5: a second copy of the
    # 17-token prompt fits only because its 16 cached tokens cost nothing
    b = request(17)
    s.add(b)
    sched = s.schedule()
    assert chunks(sched) == [(a, 1), (b, 1)]
    assert b.num_computed == 16 + 1 and s.cache.stats()["prefix_cache_hits"] == 16  # + the chunk


def urgent(n_prompt, priority):
    r = request(n_prompt)
    r.priority = priority
    return r


def test_priority_admits_lower_first_then_by_arrival():
    s = paged(100, max_batch_size=1)
    first, low, high, high2 = urgent(4, 0), urgent(4, 5), urgent(4, -1), urgent(4, -1)
    for r in (first, low, high, high2):
        s.add(r)
    assert list(s.waiting) == [high, high2, first, low]
    run(s, s.schedule())
    assert s.running == [high]


def test_memory_pressure_preempts_the_least_urgent_not_the_youngest():
    s = paged(6, max_batch_size=4, admission_reserve=0.0, enable_prefix_caching=False)
    low, high = urgent(8, 3), urgent(8, 0)
    s.add(low)
    run(s, s.schedule())
    s.add(high)  # younger and more urgent
    while s.num_preemptions == 0:
        run(s, s.schedule())
    assert low.status is Status.WAITING and s.running == [high]


def test_deadlines_passed_are_reported_once_passed():
    s = paged(100)
    late, fine, none = request(4), request(4), request(4)
    late.deadline, fine.deadline = 10.0, 20.0
    for r in (late, fine, none):
        s.add(r)
    assert s.expired(9.0) == [] and s.expired(15.0) == [late.id]
    assert s.finish_requests(s.expired(25.0), "abort") == [late, fine]
    assert [r.finish_reason for r in (late, fine)] == ["abort", "abort"] and s.waiting[0] is none


def steps_scheduler(num_blocks):
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_seq_len=256, num_scheduler_steps=4)
    return Scheduler(cfg, PagedKVCache(num_blocks=num_blocks + 1, block_size=16))


def test_several_steps_a_call_grow_every_row_or_none():
    s = steps_scheduler(3)
    a, b = request(5), request(14, first=100)
    s.add(a)
    s.add(b)
    run(s, s.schedule())  # both prefill and sample their first token
    # a's 4 tokens fit its block; b's cross into a second, with 1 block free and room
    # counted for a copy of its partial block: an ordinary step, a grown back
    sched = s.schedule()
    assert [(r.req, r.steps) for r in sched.rows] == [(a, 1), (b, 1)]
    assert [s.cache.get_seq_len(r.seq_id) for r in (a, b)] == [6, 15]
    assert s.cache.audit() == []


def test_several_steps_a_call_take_their_tokens_in_order():
    s = steps_scheduler(20)
    a = request(5, max_tokens=3)
    b = Request(list(range(100, 114)), SamplingParams(max_tokens=9, stop_token_ids=[7]), ())
    s.add(a)
    s.add(b)
    run(s, s.schedule())
    sched = s.schedule()  # a has 2 tokens left: every row runs 2 steps
    assert [(r.req, r.steps, r.computed) for r in sched.rows] == [(a, 2, 7), (b, 2, 16)]
    assert [s.cache.get_seq_len(r.seq_id) for r in (a, b)] == [7, 16]
    out = CoreOutputs()
    tokens = np.array([3, 4, 7, 5], np.int32)  # a: 3, 4; b: 7 (a stop token), 5 (dropped)
    result = StepResult(
        tokens, np.arange(4, dtype=np.float32), np.zeros((4, 5), np.int32),
        np.zeros((4, 5), np.float32), shape=None,
    )  # fmt: skip
    assert s.postprocess(sched.rows, result, out) == 3
    assert a.output_ids == [1, 3, 4] and a.finish_reason == "length"
    assert b.output_ids == [1, 7] and b.finish_reason == "stop"
    assert out.reqs == [a, a, b] and out.tokens == [3, 4, 7] and out.logprobs == [0, 1, 2]
    assert set(out.finished) == {a, b} and not s.running
