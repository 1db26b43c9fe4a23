"""Engine.step() over scheduler + runner, and the thread that drives it for asyncio callers."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncGenerator, Sequence

import numpy as np

from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.kv_pool import block_bytes
from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import CacheProtocol
from jpaged.config import EngineConfig
from jpaged.engine.request import Request, RequestOutput
from jpaged.engine.runner import Pending, Row, Runner
from jpaged.engine.sampling import SamplingParams, choice_seed
from jpaged.engine.scheduler import Scheduler
from models.config import LoadedModel


class QueueFullError(Exception):
    """The waiting queue holds max_waiting_requests already."""


def make_cache(config: EngineConfig, usable_blocks: int) -> CacheProtocol:
    if config.backend == "paged":
        return PagedKVCache(
            num_blocks=usable_blocks + 1,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
    return ContiguousKVCache(
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        block_size=config.block_size,
    )


@dataclasses.dataclass
class _Call:
    """One dispatched runner call, and what each of its rows meant when it was dispatched."""

    reqs: list[Request]
    epochs: list[int]  # a request preempted since has a newer epoch: its row is stale
    samples: list[bool]  # whether the row samples a token (a prompt chunk may not)
    computed: list[int]  # the request's computed tokens once the call ran
    pending: Pending


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.model = model
        self.model_config = model.config
        self.tokenizer = model.tokenizer
        self.config = config
        mc = model.config
        per_block = block_bytes(
            mc.num_layers, mc.num_kv_heads, config.block_size, mc.head_dim, config.dtype
        )
        self.cache = make_cache(config, config.usable_blocks(per_block))
        self.scheduler = Scheduler(config, self.cache)
        self.runner = Runner(model, config, self.cache)
        self.requests: dict[str, Request] = {}
        self._in_flight: list[_Call] = []  # dispatched calls whose tokens are not read yet
        self._rng = np.random.default_rng(config.seed)
        self._aborts: set[str] = set()
        self._lock = threading.Lock()  # guards stats() against a step in another thread
        self.counters = {
            "tokens_generated": 0,
            "steps": 0,
            "requests_finished": 0,
            "requests_failed": 0,
            "step_s": 0.0,
        }
        self.capacity_tokens = (self.cache.num_blocks - 1) * config.block_size
        if config.backend == "contiguous":
            self.capacity_tokens = config.max_seq_len
        if config.warmup:
            self.runner.warmup()
        self.warmup_compilations = self.runner.compilations

    # -- requests ----------------------------------------------------------------------

    def prepare(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and tokenize (thread-safe; touches no engine state).

        With `params.n > 1` the returned request leads a group of `n` choices
        (`request.group`), one id, seeds derived from the request's seed.
        """
        params.validate()
        if params.n > 1 and not self.cache.supports_fork:
            raise ValueError(
                f"n: parallel sampling (n={params.n}) forks sequences, which the "
                f"{self.config.backend} backend cannot; use the paged backend"
            )
        if params.n > self.config.max_batch_size:
            raise ValueError(
                f"n: {params.n} choices exceed max_batch_size ({self.config.max_batch_size}), "
                "the sequences one step can decode"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.config.max_seq_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len "
                f"({self.config.max_seq_len})"
            )
        if len(ids) + params.max_tokens > self.config.max_seq_len:
            raise ValueError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_seq_len ({self.config.max_seq_len})"
            )
        if len(ids) + 1 > self.capacity_tokens:
            raise ValueError(
                f"prompt: {len(ids)} tokens + 1 cannot fit in the KV pool "
                f"({self.capacity_tokens} tokens)"
            )
        req = Request(
            [int(t) for t in ids],
            params,
            self.tokenizer,
            self.model_config.eos_token_ids,
            request_id,
        )
        req.seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        if params.n > 1:
            req.group += [
                Request(req.prompt_ids, params, self.tokenizer, self.model_config.eos_token_ids,
                        req.id, index=i)
                for i in range(1, params.n)
            ]  # fmt: skip
            for choice in req.group:
                choice.group = req.group
                choice.seed = choice_seed(req.seed, choice.index)
        return req

    def check_room(self, submitted: int = 0) -> None:
        """Raise QueueFullError if `submitted` more requests would overflow the waiting queue."""
        if len(self.scheduler.waiting) + submitted >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )

    def add(self, request: Request) -> None:
        """Queue a prepared request (callers check room first: preempted requests may
        briefly push the queue past its limit, and they must never be refused)."""
        self.requests[request.id] = request
        self.scheduler.add(request)

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        request = self.prepare(prompt, params, request_id)
        self.check_room()
        self.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at the start of the next step (thread-safe)."""
        self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch a step, then return what the previous one produced (or,
        with `async_scheduling` off, this one): the host's work on step N's results runs
        while the device computes step N + 1."""
        with self._lock:
            start = time.perf_counter()
            outputs = self._apply_aborts()
            new_ids: dict[Request, list[int]] = {}  # by choice: n > 1 choices share an id
            sched = self.scheduler.schedule()
            for req in sched.failed:
                new_ids[req] = []
            self.runner.copy_blocks(sched.copies)
            reqs = [*sched.decode, *(r for r, _ in sched.prefill)]
            counts = [1] * len(sched.decode) + [n for _, n in sched.prefill]
            call = self._dispatch(reqs, counts, new_ids) if reqs else None
            finished, self._in_flight = self._in_flight, [] if call is None else [call]
            if not self.config.async_scheduling:
                finished, self._in_flight = finished + self._in_flight, []
            for call in finished:
                self._collect(call, new_ids)
            for req, ids in new_ids.items():
                outputs.append(req.take_output(ids))
                if req.finished:
                    self._retire(req)
            self.counters["steps"] += 1
            self.counters["step_s"] += time.perf_counter() - start
            return outputs

    def _dispatch(
        self, reqs: list[Request], counts: list[int], new_ids: dict[Request, list[int]]
    ) -> _Call | None:
        """Dispatch the rows of the scheduled requests still running, advancing each one's
        state as if the step had run (the next step is scheduled before it has)."""
        rows, samples, computed = [], [], []
        for req, n in zip(reqs, counts, strict=True):
            assert req.seq_id is not None
            p = req.params
            source = req.ring_index if req.num_pending else -1
            chunk = req.all_ids[req.num_computed : req.num_computed + n] or [0]  # 0: in the ring
            rows.append(
                Row(req.seq_id, chunk, p.temperature, p.top_k, p.top_p, req.seed,
                    req.num_sampled, p.logprobs or 0, source)
            )  # fmt: skip
            req.num_computed += n
            computed.append(req.num_computed)
            # a prompt chunk samples once it reaches the end (a group leader stops short)
            samples.append(req.prefilled or req.num_computed >= req.num_tokens)
            req.prefilled = samples[-1]
        try:
            pending = self.runner.dispatch(rows)
        except Exception as exc:  # fail this call's requests, keep serving
            self._fail(reqs, exc, new_ids)
            return None
        for req, sampled, index in zip(reqs, samples, pending.ring_index, strict=True):
            if sampled:
                req.num_pending += 1
                req.ring_index = int(index)
        return _Call(reqs, [r.epoch for r in reqs], samples, computed, pending)

    def _collect(self, call: _Call, new_ids: dict[Request, list[int]]) -> None:
        """Read a dispatched call's tokens and hand them to its requests."""
        try:
            result = self.runner.collect(call.pending)
        except Exception as exc:
            current = [r for r, e in zip(call.reqs, call.epochs, strict=True) if r.epoch == e]
            self._fail(current, exc, new_ids)
            return
        for i, req in enumerate(call.reqs):
            if req.finished or req.epoch != call.epochs[i]:
                continue  # stopped, or preempted and recomputing, since the call was dispatched
            self.scheduler.commit(req, call.computed[i])
            new_ids.setdefault(req, [])
            if not call.samples[i]:
                continue  # a prompt chunk that does not reach the end: no token yet
            req.num_pending -= 1
            token = int(result.tokens[i])
            top = None
            if req.params.logprobs:
                k = req.params.logprobs
                top = {
                    self.tokenizer.decode([int(t)]): float(lp)
                    for t, lp in zip(result.top_ids[i, :k], result.top_logprobs[i, :k], strict=True)
                }
            req.append(token, float(result.logprobs[i]), top)
            new_ids[req].append(token)
            self.counters["tokens_generated"] += 1

    def _fail(self, reqs: list[Request], exc: Exception, new_ids: dict[Request, list[int]]) -> None:
        message = f"{type(exc).__name__}: {exc}"
        # a group leader that had not forked yet takes its choices down with it
        for req in [c for r in reqs for c in (r, *r.pending_fork)]:
            if not req.finished:
                self.scheduler.free(req)
                req.finish("error", message)
                new_ids.setdefault(req, [])
        if self.runner.pool_lost:
            # The donated pool died with the step: whoever else holds K/V must recompute,
            # and no cached prefix survives.
            self.runner.reset_pool()
            for req in list(self.scheduler.running):
                self.scheduler.preempt(req)
            self.cache.reset_prefix_cache()

    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        while self._aborts:
            req = self.requests.get(self._aborts.pop())
            if req is None:
                continue
            for choice in req.group:
                if not choice.finished:
                    self.scheduler.free(choice)
                    choice.finish("abort")
                    outputs.append(choice.take_output([]))
            self._retire(req)
        return outputs

    def _retire(self, req: Request) -> None:
        """A choice finished: free it; once every choice of its request has, drop the request."""
        self.scheduler.free(req)
        if not all(c.finished for c in req.group) or self.requests.pop(req.id, None) is None:
            return
        for choice in req.group:
            self.scheduler.free(choice)
        failed = any(c.finish_reason == "error" for c in req.group)
        self.counters["requests_failed" if failed else "requests_finished"] += 1

    # -- observability -----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            stats: dict[str, float] = {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.num_preemptions,
                "compilations": self.runner.compilations,
                "compilations_after_warmup": self.runner.compilations - self.warmup_compilations,
                **{k: float(v) for k, v in self.counters.items()},
                "device_s": self.runner.device_s,
                # scheduling, batch building, sampling bookkeeping, detokenizing
                "host_s": self.counters["step_s"] - self.runner.device_s,
            }
            stats.update({f"kv_{k}": float(v) for k, v in self.cache.stats().items()})
            return stats


class AsyncEngine:
    """Steps an Engine in one thread; asyncio callers stream each request's outputs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jpaged-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def _loop(self) -> None:
        try:
            while not self._stop:
                while not self._inbox.empty():
                    self.engine.add(self._inbox.get())
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as exc:  # a bug in the loop itself: nobody may wait forever
            for req in list(self.engine.requests.values()):
                for choice in req.group:
                    if not choice.finished:
                        choice.finish("error", f"engine loop died: {type(exc).__name__}: {exc}")
                        self._deliver(choice.take_output([]))
            raise

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Raises ValueError / QueueFullError before the first one.

        With `params.n > 1` the outputs of all choices interleave (`RequestOutput.index`);
        the stream ends once each choice has sent its finished output. Closing the
        iterator early (a client that went away) aborts the request.
        """
        req = self.engine.prepare(prompt, params, request_id)
        self.engine.check_room(self._inbox.qsize())
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.id] = (asyncio.get_running_loop(), q)
        self._inbox.put(req)
        self._wake.set()
        unfinished = params.n
        finished = False
        try:
            while not finished:
                out = await q.get()
                unfinished -= out.finished
                finished = unfinished == 0
                yield out
        finally:
            self._streams.pop(req.id, None)
            if not finished:
                self.engine.abort(req.id)
                self._wake.set()
