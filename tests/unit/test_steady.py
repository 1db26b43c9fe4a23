"""The steady decode step (`jpaged.engine.steady`): scheduled as columns, it does what the
whole schedule does row by row, step for step."""

import numpy as np
import pytest

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.paged import PagedKVCache
from jpaged.config import EngineConfig
from jpaged.engine.contract import CoreOutputs, Decodes, StepResult
from jpaged.engine.request import Request
from jpaged.engine.sampling import SamplingParams
from jpaged.engine.scheduler import Scheduler

EOS = 7


def requests() -> list[Request]:
    """A mix: prompts that start their pages at different steps, ends by max_tokens and
    by EOS, a request of two choices (forked, copy-on-write), logprobs, penalties (never
    steady), and more requests than the batch holds (they wait for a slot)."""
    reqs = []
    for i in range(14):
        params = SamplingParams(
            max_tokens=4 if i == 11 else 6 + 5 * i,
            n=2 if i == 3 else 1,
            logprobs=2 if i == 5 else None,
            presence_penalty=0.5 if i == 11 else 0.0,
        )
        prompt = list(range(100 * i, 100 * i + 3 + i))
        req = Request(prompt, params, (EOS,), request_id=f"r{i}")
        if params.n > 1:
            req.group = [req] + [
                Request(prompt, params, (EOS,), request_id=f"r{i}", index=k) for k in (1,)
            ]
            for choice in req.group:
                choice.group = req.group
        reqs.append(req)
    return reqs


def drive(steady: bool, backend: str) -> tuple[list, int, int]:
    """Step a scheduler as the engine does under async scheduling (step N + 1 scheduled
    before step N's tokens are taken); returns what every step did, how many steps were
    steady ones, and how many of those dropped rows that finished."""
    config = EngineConfig(
        block_size=4, num_blocks=60, max_seq_len=128, max_batch_size=8, warmup=False
    )
    cache = (
        PagedKVCache(num_blocks=61, block_size=4)
        if backend == "paged"
        else ContiguousKVCache(max_batch_size=8, max_seq_len=128, block_size=4)
    )
    sched = Scheduler(config, cache)
    if not steady:
        sched._schedule_steady = lambda: None  # type: ignore[method-assign]
    reqs = requests()
    trace, moved, dropped, previous = [], 0, 0, None
    for step in range(90):
        if step < len(reqs) and step % 2 == 0:  # arrivals, two steps apart
            sched.add(reqs[step])
            sched.add(reqs[step + 1])
        schedule = sched.schedule()
        if isinstance(schedule.rows, Decodes):
            moved += 1
            dropped += isinstance(previous.rows, Decodes) and len(previous.rows) > len(
                schedule.rows
            )
        rows = [
            (r.req.id, r.req.index, r.token_ids, r.on_device, r.sample_index, r.computed, r.epoch)
            for r in schedule.rows
        ]
        tables = None
        if isinstance(cache, PagedKVCache) and sched.running:
            seqs = [r.seq_id for r in sched.running]
            tables = [a.tolist() for a in cache.page_tables(seqs, 32)]
        trace.append((rows, schedule.copies, [r.id for r in schedule.failed], tables))
        if previous is not None:
            trace.append(take(sched, previous, step))
        previous = schedule
        if not sched.has_unfinished():
            break
    return trace, moved, dropped


def take(sched: Scheduler, schedule, step: int) -> tuple:
    """A step's tokens: EOS now and then, else a token of the row's request and step."""
    n = len(schedule.rows)
    indices = [(r.req.index + 3 * int(r.req.id[1:])) for r in schedule.rows]
    tokens = np.array([EOS if (step + i) % 37 == 0 else 10 + (i + step) % 50 for i in indices])
    result = StepResult(
        tokens.astype(np.int32),
        np.linspace(-1, 0, n).astype(np.float32),
        np.zeros((n, 2), np.int32),
        np.zeros((n, 2), np.float32),
        shape=None,  # type: ignore[arg-type]
    )
    out = CoreOutputs()
    appended = sched.postprocess(schedule.rows, result, out)
    return (
        appended,
        [(r.id, r.index) for r in out.reqs],
        out.tokens,
        out.logprobs,
        sorted(out.top),
        sorted((r.id, r.index, f) for r, f in out.finished.items()),
    )


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_steady_step_schedules_what_the_whole_schedule_does(backend: str) -> None:
    whole, none, _ = drive(steady=False, backend=backend)
    moved, steps, dropped = drive(steady=True, backend=backend)
    assert none == 0
    assert steps >= 20 and dropped >= 2  # (of ~48: the set changes every few steps here)
    assert len(moved) == len(whole)
    for k, (a, b) in enumerate(zip(moved, whole, strict=True)):
        assert a == b, k
