"""Engine.step() over scheduler + runner, and the thread that drives it for asyncio callers."""

from __future__ import annotations

import asyncio
import collections
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
from jpaged.engine.sampling import RequestError, SamplingParams, choice_seed
from jpaged.engine.scheduler import Scheduled, Scheduler
from models.config import LoadedModel
from models.sharding import make_mesh, shard_model


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
    """One dispatched runner call, and the scheduled rows it runs."""

    rows: list[Scheduled]
    pending: Pending


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.mesh = None if config.tensor_parallel == 1 else make_mesh(config.tensor_parallel)
        if self.mesh is not None:
            model = shard_model(model, self.mesh)
        self.model = model
        self.model_config = model.config
        self.tokenizer = model.tokenizer
        mc = model.config
        per_block = block_bytes(
            mc.num_layers, mc.num_kv_heads, config.block_size, mc.head_dim, config.dtype
        )
        self.cache = make_cache(config, config.usable_blocks(per_block))
        self.scheduler = Scheduler(config, self.cache)
        self.runner = Runner(model, config, self.cache, self.mesh)
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
            # where a step's host time goes, and how much of each call is padding
            "schedule_s": 0.0,
            "build_s": 0.0,
            **{f"{kind}_{what}": 0 for kind in ("decode", "mixed")
               for what in ("calls", "tokens", "tokens_padded")},
        }  # fmt: skip
        self.decode_buckets: collections.Counter[int] = collections.Counter()  # tokens -> calls
        if config.warmup:
            self.runner.warmup()
        self.mark_warm()

    def mark_warm(self) -> None:
        """Count compilations from here on as after warm-up (for callers that warm up by
        running a workload)."""
        self.warmup_compilations = self.runner.compilations

    # -- requests ----------------------------------------------------------------------

    def prepare(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and tokenize (thread-safe; touches no engine state).

        With `params.n > 1` the returned request leads a group of `n` choices
        (`request.group`), one id, seeds derived from the request's seed.
        """
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise RequestError(field, message)

        params.validate()
        max_seq_len, n = self.config.max_seq_len, params.n
        check(n == 1 or self.cache.supports_fork, "n",
              f"n: parallel sampling (n={n}) forks sequences, which the "
              f"{self.config.backend} backend cannot; use the paged backend")  # fmt: skip
        check(n <= self.config.max_batch_size, "n",
              f"n: {n} choices exceed max_batch_size ({self.config.max_batch_size}), "
              "the sequences one step can decode")  # fmt: skip
        if isinstance(prompt, str):
            check(bool(prompt), "prompt", "prompt must not be empty")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            check(all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in ids),
                  "prompt", f"prompt token ids must be ints in [0, {vocab})")  # fmt: skip
        check(bool(ids), "prompt", "prompt must not be empty")
        check(len(ids) < max_seq_len, "prompt",
              f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len "
              f"({max_seq_len})")  # fmt: skip
        check(len(ids) + params.max_tokens <= max_seq_len, "max_tokens",
              f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
              f"exceeds max_seq_len ({max_seq_len})")  # fmt: skip
        check(len(ids) + 1 <= self.cache.max_seq_tokens, "prompt",
              f"prompt: {len(ids)} tokens + 1 cannot fit in the KV cache "
              f"({self.cache.max_seq_tokens} tokens a sequence)")  # fmt: skip
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
                # the prompt is scored once, by whichever choice leads its prefill
                choice.prompt_logprobs = req.prompt_logprobs
                choice.prompt_top_logprobs = req.prompt_top_logprobs
        return req

    def check_room(self, submitted: int = 0) -> None:
        """Raise QueueFullError if `submitted` more requests would overflow the waiting queue."""
        if self.room() <= submitted:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )

    def room(self) -> int:
        """Requests the waiting queue can still take."""
        return self.config.max_waiting_requests - self.scheduler.num_waiting

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
            self.counters["schedule_s"] += time.perf_counter() - start
            for req in sched.failed:
                new_ids[req] = []
            self.runner.copy_blocks(sched.copies)
            call = self._dispatch(sched.rows, new_ids) if sched.rows else None
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

    def _dispatch(self, rows: list[Scheduled], new_ids: dict[Request, list[int]]) -> _Call | None:
        """Build the runner's rows (the batch) and start the step on the device."""
        batch = []
        for row in rows:
            req, p = row.req, row.req.params
            assert req.seq_id is not None
            batch.append(
                Row(req.seq_id, row.token_ids, p.temperature, p.top_k, p.top_p, req.seed,
                    row.sample_index, p.logprobs or 0, req.ring_index if row.on_device else -1,
                    row.score_ids)
            )  # fmt: skip
        start, device = time.perf_counter(), self.runner.device_s
        try:
            pending = self.runner.dispatch(batch)
        except Exception as exc:  # fail this call's requests, keep serving
            self._fail([r.req for r in rows], exc, new_ids)
            return None
        self.counters["build_s"] += time.perf_counter() - start - (self.runner.device_s - device)
        for row, index in zip(rows, pending.ring_index, strict=True):
            if row.samples:
                row.req.ring_index = int(index)
        tokens = sum(len(r.token_ids) for r in rows)
        kind = "decode" if tokens == len(rows) else "mixed"  # mixed: prompt chunks among them
        self.counters[f"{kind}_calls"] += 1
        self.counters[f"{kind}_tokens"] += tokens
        self.counters[f"{kind}_tokens_padded"] += pending.shape.tokens
        if kind == "decode":
            self.decode_buckets[pending.shape.tokens] += 1
        return _Call(rows, pending)

    def _collect(self, call: _Call, new_ids: dict[Request, list[int]]) -> None:
        """Read a dispatched call's tokens and hand them to the scheduler."""
        try:
            result = self.runner.collect(call.pending)
        except Exception as exc:
            current = [r.req for r in call.rows if r.req.epoch == r.epoch]
            self._fail(current, exc, new_ids)
            return
        for req, token in self.scheduler.postprocess(call.rows, result):
            ids = new_ids.setdefault(req, [])
            if token is not None:
                ids.append(token)
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
            self.scheduler.preempt_all()
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
                "running": self.scheduler.num_running,
                "waiting": self.scheduler.num_waiting,
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
