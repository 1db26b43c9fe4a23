"""The live requests and every transition of their state: queued (by priority, then
arrival), forked, preempted (freed and queued first, to be recomputed), moved on by a beam
search's step, finished (a token, a stop string, an abort, a failed step), their blocks
published to the prefix cache as steps compute them. The scheduler
(`jpaged.engine.scheduler`) builds its steps on it; nothing else moves a request.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np

from jpaged.cache.protocol import CacheProtocol
from jpaged.engine.lora import LoRASlots
from jpaged.engine.request import Request, Status


class Registry:
    def __init__(self, cache: CacheProtocol) -> None:
        self.cache = cache
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.requests: dict[str, Request] = {}  # live requests by id (their first choice)
        self._timed: dict[str, Request] = {}  # those of them with a deadline
        self.num_preemptions = 0
        self.num_finished = 0  # requests whose every choice finished, none with an error
        self.num_failed = 0
        self.loras: LoRASlots | None = None  # the runner's adapters, when LoRA is on

    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        if request.deadline is not None:
            self._timed[request.id] = request
        if request.beam is None:  # beams fork once the search picks them
            request.pending_fork = [r for r in request.group if r is not request]
        self._queue(request, first=False)

    def _queue(self, request: Request, first: bool) -> None:
        """Into the waiting queue by priority, then arrival: after those of its priority,
        or (`first`: preempted) before them. Equal priorities: first come, first served."""
        at = next(
            (
                i
                for i, r in enumerate(self.waiting)
                if r.priority > request.priority or (first and r.priority == request.priority)
            ),
            len(self.waiting),
        )
        self.waiting.insert(at, request)

    def expired(self, now: float) -> list[str]:
        """The live requests whose deadline has passed at perf_counter time `now`."""
        # (those with a deadline alone: a scan of every request would cost each step O(rows))
        return [i for i, r in self._timed.items() if r.deadline is not None and r.deadline < now]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish_requests(
        self, request_ids: Iterable[str], reason: str, error: str | None = None
    ) -> list[Request]:
        """Finish every choice of these requests still live (an abort); returns those."""
        live = [self.requests[i] for i in request_ids if i in self.requests]
        return self.finish([c for req in live for c in req.group], reason, error)

    def finish(
        self, reqs: Iterable[Request], reason: str, error: str | None = None
    ) -> list[Request]:
        """Finish these choices, whatever state they are in; returns those not finished before."""
        done = [r for r in reqs if not r.finished]
        for req in done:
            self._free(req)
            req.status = Status.FINISHED
            req.finish_reason, req.error = reason, error
            first = self.requests.get(req.id)
            if first is not None and all(c.finished for c in first.group):
                del self.requests[req.id]
                self._timed.pop(req.id, None)
                failed = any(c.finish_reason == "error" for c in first.group)
                self.num_failed += failed
                self.num_finished += not failed
                if first.lora_slot and self.loras is not None:
                    self.loras.release(first.lora)  # type: ignore[arg-type]
                if first.holds_lora and self.loras is not None:
                    self.loras.unhold(first.lora)  # type: ignore[arg-type]
                    first.holds_lora = False
        return done

    def fail(self, reqs: Iterable[Request], error: str) -> list[Request]:
        """A step of these choices failed: finish them with the error. A group leader that
        had not forked yet takes its choices down with it, a beam its whole search."""
        return self.finish(
            [c for r in reqs for c in (r.group if r.beam else (r, *r.pending_fork))], "error", error
        )

    def reset(self) -> None:
        """The device pool was lost: everyone running recomputes, no cached prefix survives."""
        for req in list(self.running):
            self.preempt(req)
        self.cache.reset_prefix_cache()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _free(self, request: Request) -> None:
        """Release a request's cache sequence, whatever state it is in."""
        if request.seq_id is not None:
            self.cache.free_seq(request.seq_id)
            request.seq_id = None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def preempt(self, request: Request) -> None:
        """Free the request (a beam search: its whole group) and queue it first."""
        if request.status is not Status.RUNNING:
            return
        members = [request]
        if request.beam is not None:  # the search starts over: every beam goes
            request.beam.restart()
            members = [r for r in request.group if not r.finished]
        for r in members:
            self._free(r)
            r.status = Status.WAITING
            if r.beam is not None:
                r.set_output([])
                r.cum_logprob, r.token_logprobs = 0.0, []
            r.num_computed = 0
            r.committed_blocks = 0
            r.prefilled = False
            r.num_pending = 0
            r.epoch += 1
            r.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(members[0], first=True)

    def _commit(self, request: Request, num_computed: int) -> None:
        """Publish the request's computed full blocks to the prefix cache (only once the
        step ran, so a failed step never leaves unwritten blocks findable)."""
        full = num_computed // self.cache.block_size
        if request.seq_id is not None and full > request.committed_blocks:
            self.cache.cache_blocks(request.seq_id, request.all_ids, num_computed)
            request.committed_blocks = full

    def _fork(self, leader: Request) -> None:
        """The leader computed all but the last prompt token: give each pending choice a
        sequence sharing its blocks, placed right after it in `running`."""
        assert leader.seq_id is not None
        pos = self.running.index(leader) + 1
        for k, choice in enumerate(leader.pending_fork):
            choice.seq_id = self.cache.fork(leader.seq_id)
            choice.num_computed = leader.num_computed
            choice.prefilled = False
            choice.status = Status.RUNNING
            self.running.insert(pos + k, choice)
        leader.pending_fork = []

    def search(
        self,
        beams: list[Request],  # the group's live beams
        top_ids: np.ndarray,  # int32 [beams, K]: each beam's likeliest next tokens
        top_logprobs: np.ndarray,  # f32 [beams, K]
    ) -> list[Request]:
        """One step of a beam search, once the host has read every beam's likeliest next
        tokens: the next beams take over the sequences of their parents (forked for every
        child after the first), the beams no child extends are freed. Returns the group
        once the search ended, each beam holding a hypothesis."""
        search, group = beams[0].beam, beams[0].group
        assert search is not None
        picked = search.select(
            [b.output_ids for b in beams],
            [b.cum_logprob for b in beams],
            top_ids,
            top_logprobs,
            [b.token_logprobs for b in beams],
        )
        if search.done:  # beam i shows the i-th best hypothesis
            for beam, hyp in zip(group, search.finished, strict=True):
                beam.set_output(hyp.token_ids)
                beam.token_logprobs, beam.cum_logprob = hyp.logprobs, hyp.cum_logprob
                self.finish([beam], hyp.finish_reason)
            return group
        parents = [
            (b.output_ids, b.token_logprobs, b.num_computed, b.committed_blocks) for b in beams
        ]
        extended = {c.parent for c in picked}
        for k, beam in enumerate(beams):
            if k not in extended:  # pruned: its blocks go back now
                self._free(beam)
                beam.status = Status.WAITING
        idle = (b for b in group if b.status is Status.WAITING)
        taken: set[int] = set()
        for c in picked:
            parent = beams[c.parent]
            beam = parent if c.parent not in taken else next(idle)
            if beam is not parent:  # a second child: a sequence sharing the parent's blocks
                assert parent.seq_id is not None
                beam.seq_id = self.cache.fork(parent.seq_id)
                beam.status, beam.prefilled = Status.RUNNING, True
                self.running.insert(self.running.index(parent) + 1, beam)
            taken.add(c.parent)
            output, logprobs, beam.num_computed, beam.committed_blocks = parents[c.parent]
            beam.set_output([*output, c.token])
            beam.token_logprobs = [*logprobs, c.logprob]
            beam.cum_logprob = c.cum_logprob
        return []


def unit(req: Request) -> int:
    """What is preempted and failed as one: a beam search's group, any other choice alone."""
    return id(req.group) if req.beam is not None else id(req)


def members(req: Request) -> list[Request]:
    """The sequences a queued or running request stands for: a beam search's live beams,
    any other choice itself and the choices it has yet to fork."""
    if req.beam is not None:
        return [r for r in req.group if not r.finished]
    return [req, *req.pending_fork]
