"""Continuous batching: retire -> free -> admit under the budgets -> decode + prefill.

Decodes go first (one token each), admissions fill the rest of the step's
token budget with prompt chunks. When the pool runs dry mid-decode, the
youngest running request is preempted: its blocks are freed and it waits at
the head of the queue to be recomputed — vLLM's preemption by recompute.
"""

from __future__ import annotations

import collections
import dataclasses

from jpaged.cache.protocol import CachePoolProtocol, OutOfBlocksError
from jpaged.config import EngineConfig
from jpaged.engine.request import Request, Status


@dataclasses.dataclass
class Schedule:
    decode: list[Request]
    prefill: list[tuple[Request, int]]  # (request, tokens of its prompt to compute now)
    copies: list[tuple[int, int]]  # copy-on-write block copies to do before the step
    failed: list[Request]  # grew past the whole pool while running alone

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CachePoolProtocol) -> None:
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def free(self, request: Request) -> None:
        """Release a request's cache sequence, whatever state it is in."""
        if request.seq_id is not None:
            self.cache.free_slot(request.seq_id)
            request.seq_id = None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def preempt(self, request: Request) -> None:
        self.free(request)
        request.status = Status.WAITING
        request.num_computed = 0
        request.prefilled = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> Schedule:
        self._copies: list[tuple[int, int]] = []
        budget = self.config.max_num_batched_tokens
        decode: list[Request] = []
        failed: list[Request] = []
        for req in list(self.running):
            if req.in_prefill or req not in self.running:
                continue
            while not self._grow(req, 1):
                if len(self.running) == 1:  # alone and still no room: no preemption can help
                    self.free(req)
                    req.finish("error", "sequence outgrew the whole KV pool")
                    failed.append(req)
                    break
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            else:
                decode.append(req)
                budget -= 1

        prefill: list[tuple[Request, int]] = []
        # chunked prompts already admitted continue first, oldest first
        for req in self.running:
            if req.in_prefill and budget > 0:
                chunk = min(req.num_tokens - req.num_computed, budget)
                self._grow(req, chunk)  # cannot fail: prompt blocks were allocated eagerly
                prefill.append((req, chunk))
                budget -= chunk
        admitted_tokens = 0
        room = self._admission_room()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            req = self.waiting[0]
            if self.cache.free_slot_count() <= 0 or admitted_tokens + req.num_tokens > room:
                break
            try:
                req.seq_id = self.cache.allocate_slot(req.num_tokens)
            except OutOfBlocksError:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted_tokens += req.num_tokens
            chunk = min(req.num_tokens, budget)
            self._grow(req, chunk)
            prefill.append((req, chunk))
            budget -= chunk
        return Schedule(decode=decode, prefill=prefill, copies=self._copies, failed=failed)

    def _grow(self, req: Request, n: int) -> bool:
        assert req.seq_id is not None
        if not self.cache.can_append(req.seq_id, n):
            return False
        self._copies.extend(self.cache.append(req.seq_id, n))
        return True

    def _admission_room(self) -> float:
        """Prompt tokens this step may admit."""
        capacity = self.cache.free_token_capacity()
        if capacity is None:  # memory reserved per slot: free slots are the only limit
            return float("inf")
        # Keep a reserve for the decodes of those already running; with nothing
        # running the reserve protects nobody, so the whole capacity counts.
        return capacity if not self.running else (1 - self.config.admission_reserve) * capacity
