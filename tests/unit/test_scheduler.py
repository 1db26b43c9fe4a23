"""Scheduler policy over the real cache pools, with requests that never touch a model."""

import pytest

from jpaged.cache.contiguous import SlottedKVCache
from jpaged.cache.paged import PagedKVCachePool
from jpaged.config import EngineConfig
from jpaged.engine.request import Request, Status
from jpaged.engine.sampling import SamplingParams
from jpaged.engine.scheduler import Scheduler


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def request(n_prompt, max_tokens=64):
    return Request(list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), Tok(), ())


def run(sched, schedule):
    """Pretend the model ran: advance prefill chunks and decode one token."""
    for req, n in schedule.prefill:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.prefilled = True
            req.append(1, 0.0, None)
    for req in schedule.decode:
        req.num_computed += 1
        req.append(1, 0.0, None)


def paged(num_blocks, **kw):
    cfg = EngineConfig(block_size=4, num_blocks=num_blocks, max_seq_len=256, **kw)
    return Scheduler(cfg, PagedKVCachePool(num_blocks=num_blocks + 1, block_size=4))


def test_admits_under_batch_and_token_budget_and_chunks_long_prompts():
    s = paged(100, max_batch_size=3, max_num_batched_tokens=16, admission_reserve=0.0)
    reqs = [request(10), request(10), request(3), request(3)]
    for r in reqs:
        s.add(r)
    first = s.schedule()
    # 10 + 6 of the second prompt fill the 16-token budget
    assert [(r, n) for r, n in first.prefill] == [(reqs[0], 10), (reqs[1], 6)]
    run(s, first)
    second = s.schedule()
    assert second.decode == [reqs[0]]
    assert [(r, n) for r, n in second.prefill][:2] == [(reqs[1], 4), (reqs[2], 3)]
    assert len(s.running) == 3 and list(s.waiting) == [reqs[3]]  # batch budget of 3


def test_admission_reserve_keeps_room_for_running_decodes():
    s = paged(10, max_batch_size=8, admission_reserve=0.5)  # 40 tokens
    a, b = request(8), request(16)
    s.add(a)
    run(s, s.schedule())
    s.add(b)
    sched = s.schedule()  # 28 tokens free after a's 3 blocks: half is 14 < 16
    assert [r for r, _ in sched.prefill] == [] and list(s.waiting) == [b]


def test_preempts_youngest_when_blocks_run_out_and_recomputes_it():
    s = paged(4, max_batch_size=4, admission_reserve=0.0)  # 16 tokens
    old, young = request(8), request(8)
    s.add(old)
    s.add(young)
    run(s, s.schedule())  # 2 full blocks each: decoding the first token needs a third
    sched = s.schedule()
    assert sched.decode == [old]
    assert young.status is Status.WAITING and s.waiting[0] is young
    assert young.num_computed == 0 and not young.prefilled and s.num_preemptions == 1
    assert s.cache.get_seq_len(old.seq_id) == 9
    run(s, sched)
    s.free(old)
    again = s.schedule()  # recompute: prompt + the token it had generated
    assert [(r, n) for r, n in again.prefill] == [(young, 9)]


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
    s = Scheduler(cfg, SlottedKVCache(max_batch_size=2, max_seq_len=32, block_size=4))
    for _ in range(3):
        s.add(request(5))
    sched = s.schedule()
    assert len(sched.prefill) == 2 and len(s.waiting) == 1


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
