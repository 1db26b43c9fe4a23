"""One engine (an `EngineInterface`): `step()` over the scheduler and the runner (dispatch,
grammar masks, results read back, failures), with its KV cache at the size the device
holds (`sizing`), its LoRA adapters registered, and its statistics. Intake is `intake`'s,
the outputs' text `output`'s, the asyncio front `async_engine`'s."""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jpaged.cache.groups import KVGroups
from jpaged.cache.paged import MEMORY_COUNTERS
from jpaged.config import EngineConfig
from jpaged.engine.contract import CoreOutputs, Decodes, Row, Scheduled, row_of
from jpaged.engine.intake import Intake, QueueFullError
from jpaged.engine.interface import PromptRequest
from jpaged.engine.lora import LoRARequest
from jpaged.engine.output import OutputProcessor, RequestOutput, RequestState
from jpaged.engine.request import Request
from jpaged.engine.runner import Pending, Runner
from jpaged.engine.scheduler import Scheduler
from jpaged.engine.sizing import (
    blocks_in_budget,
    cache_size,
    device_memory,
    kv_block_bytes,
    kv_groups,
    make_cache,
    weights_on_device,
)
from jpaged.engine.structured import GrammarCompiler, fill_mask, mask_words
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import engine_mesh, shard_model
from jpaged.models.quant import footprint

# Per call kind ("decode": one token a row; "mixed": prompt chunks among them): calls,
# real tokens, and the tokens of the buckets they ran in.
CALL_COUNTERS = tuple(
    f"{kind}_{what}"
    for kind in ("decode", "mixed")
    for what in ("calls", "tokens", "tokens_padded")
)
# The statistics that only grow (Prometheus counters); every other key of stats() is a gauge.
COUNTERS = (
    "tokens_generated",
    "steps",
    "requests_finished",
    "requests_failed",
    "preemptions",
    "compilations",
    "step_s",
    "schedule_s",
    "build_s",
    "mask_s",
    "device_s",
    "wait_s",
    "host_s",
    "outputs_s",
    *CALL_COUNTERS,
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    *(f"kv_{name}" for name in MEMORY_COUNTERS),
)


def fit_blocks(
    model: LoadedModel,
    config: EngineConfig,
    mesh: Mesh | None,
    groups: KVGroups,
    nbytes: int,
    fraction: float,
) -> int:
    """The usable blocks of `nbytes` that fit `fraction` of a device's memory, with the
    weights and a step's activations (compiled with a pool of one block: they do not
    depend on it)."""
    total, in_use = device_memory(*weights_on_device(model))
    probe = Runner(model, config, cache_size(config, 1, groups), mesh, groups)
    activations = probe.activation_bytes(config.blocks_per_seq)
    shards = 1 if mesh is None else mesh.size  # each device holds 1/N of a block
    blocks, arithmetic = blocks_in_budget(total, fraction, in_use, activations, nbytes // shards)
    print(f"jpaged: {arithmetic}", file=sys.stderr, flush=True)
    return blocks


@dataclasses.dataclass
class _Call:
    """One dispatched runner call, and the scheduled rows it runs."""

    rows: Sequence[Scheduled]
    pending: Pending


class Engine:
    runner_cls: type[Runner] = Runner  # several processes: one that mirrors its calls

    def __init__(
        self, model: LoadedModel, config: EngineConfig, devices: Sequence[jax.Device] | None = None
    ) -> None:
        """`devices`: where this engine runs (a data-parallel replica's group), else the
        first `tensor_parallel` of `jax.devices()` (one device: JAX's default, no mesh)."""
        self.config = config
        self.mesh = (
            None
            if config.tensor_parallel == 1 and devices is None
            else engine_mesh(model, config.tensor_parallel, devices)
        )
        if self.mesh is not None:
            model = shard_model(model, self.mesh)
        self.model = model
        self.model_config = model.config
        nbytes, values = footprint(model.model)
        self.weight_bytes, self.weight_bits = float(nbytes), 8 * nbytes / values
        self.tokenizer = model.tokenizer
        mc = model.config
        self.grammars = GrammarCompiler(model.tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.groups = kv_groups(config, mc)
        self.block_bytes = kv_block_bytes(config, mc, self.groups)
        usable = config.usable_blocks(self.block_bytes, self.groups.num_groups)
        fraction = config.kv_fraction()
        if fraction is not None:
            usable = self._fit_blocks(model, fraction)
        self.cache = make_cache(config, usable, self.groups)
        self.scheduler = Scheduler(config, self.cache)
        self.runner = self.runner_cls(model, config, self.cache, self.mesh, self.groups)
        self.scheduler.loras = self.runner.lora
        self.scheduler.max_steps = self.runner.max_steps
        vision = self.runner.vision
        self.intake = Intake(
            config,
            mc,
            model.tokenizer,
            self.grammars,
            self.cache.max_seq_tokens,
            self.runner.lora,
            None if vision is None else vision.config,
            model.image_processing,
        )
        self.output = OutputProcessor(model.tokenizer)
        self.mask_words = mask_words(mc.vocab_size)
        self._in_flight: list[_Call] = []  # dispatched calls whose tokens are not read yet
        self._aborts: set[str] = set()
        self._stops: collections.deque[Request] = collections.deque()  # reached a stop string
        self._out = CoreOutputs()  # what the step under way produced
        self._lock = threading.Lock()  # guards stats() against a step in another thread
        # the counters the engine keeps itself (where a step's host time goes, and how much
        # of each call is padding); the scheduler, runner and cache keep the others
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "tokens_generated",
                "steps",
                "step_s",
                "schedule_s",
                "build_s",
                "mask_s",
                "outputs_s",
                *CALL_COUNTERS,
            ),
            0,
        )
        self.decode_buckets: collections.Counter[int] = collections.Counter()  # tokens -> calls
        if config.warmup:
            self.runner.warmup()
        self.mark_warm()
        self.grammars.ready()

    def _fit_blocks(self, model: LoadedModel, fraction: float) -> int:
        return fit_blocks(model, self.config, self.mesh, self.groups, self.block_bytes, fraction)

    @property
    def replicas(self) -> list[Engine]:
        """The engines that hold KV blocks (data parallelism: each replica's)."""
        return [self]

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def weights(self) -> list[Any]:
        return jax.tree.leaves(self.runner.state)

    def audit(self) -> list[int]:
        return self.cache.audit()

    def mark_warm(self) -> None:
        """Count compilations from here on as after warm-up (for callers that warm up by
        running a workload)."""
        self.warmup_compilations = self.runner.compilations

    # -- requests ----------------------------------------------------------------------

    def prepare(self, request: PromptRequest) -> Request:
        """`Intake.prepare` (thread-safe): the request returned must be added, or else
        given to `discard`."""
        return self.intake.prepare(request)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.intake.tokenize(text, add_special_tokens)

    @property
    def image_placeholder(self) -> str | None:
        return self.intake.image_placeholder

    def discard(self, request: Request) -> None:
        self.intake.discard(request)

    def check_room(self, submitted: int = 0) -> None:
        """Raise QueueFullError if `submitted` more requests would overflow the waiting queue."""
        if self.room() <= submitted:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )

    def room(self) -> int:
        """Requests the waiting queue can still take."""
        return self.config.max_waiting_requests - self.scheduler.num_waiting

    def add(self, request: Request) -> RequestState:
        """Queue a prepared request (callers check room first: preempted requests may
        briefly push the queue past its limit, and they must never be refused). Returns
        its output, which fills as it runs."""
        self.queue(request)
        return self.output.add(request)

    def queue(self, request: Request) -> None:
        """Queue a prepared request for the core alone: its outputs are made elsewhere (a
        client in another process: `core_client`)."""
        with self._lock:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at the start of the next step (thread-safe)."""
        self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def register_lora(self, request: LoRARequest) -> None:
        """Serve LoRA adapter `request.lora_name` from now on (thread-safe). Raises
        ValueError for a bad adapter (naming its file and field) or with LoRA off."""
        if self.runner.lora is None:
            raise ValueError("LoRA is off: set EngineConfig.lora (--enable-lora)")
        # read and converted before taking the lock, which every step holds: a load that
        # takes seconds must not stall the streams for them
        adapter = self.runner.lora.read(request)
        with self._lock:
            self.runner.lora.register(request, adapter)

    def loras(self) -> dict[str, LoRARequest]:
        """The LoRA adapters registered, by name."""
        return self.intake.adapters()

    def unregister_lora(self, name: str) -> None:
        """Stop serving adapter `name`: KeyError if unknown, AdapterInUse (a ValueError)
        while requests hold it, waiting ones included."""
        if self.runner.lora is None:
            raise KeyError(name)
        with self._lock:
            self.runner.lora.unregister(name)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """A step (`core_step`) and its outputs (`process`): a choice whose text reached a
        stop string finishes now, its blocks free when this returns."""
        outputs = self.process(self.core_step())
        self.finish_stopped()
        return outputs

    def core_step(self) -> CoreOutputs:
        """Schedule and dispatch a step, then return what the previous one produced (or,
        with `async_scheduling` off, this one), as token ids: the host's work on step N's
        results runs while the device computes step N + 1. Their text is `process`'s, which
        may run in another thread (or, one day, process) beside the next steps: the hand-over
        carries no text and each finish as it stood."""
        with self._lock:
            start = time.perf_counter()
            self._out = out = CoreOutputs()
            aborts = []
            while self._aborts:  # (abort() may add to the set meanwhile)
                aborts.append(self._aborts.pop())
            aborts += self.scheduler.expired(start)
            aborted = self.scheduler.finish_requests(aborts, "abort")
            self._finish_stopped()
            read_s = self._read_first()
            sched = self.scheduler.schedule()
            self.counters["schedule_s"] += time.perf_counter() - start - read_s
            out.finish(aborted + sched.failed)
            rows, copies = sched.rows, sched.copies
            # (a steady decode step pools nothing)
            if not isinstance(rows, Decodes) and any(r.req.pooling for r in rows):
                self.runner.copy_blocks(copies)
                rows, copies = self._embed(rows), []
            call = self._dispatch(rows, copies) if rows else None
            finished, self._in_flight = self._in_flight, [] if call is None else [call]
            if call is not None and call.pending.unsampled is not None:
                # Grammar masks follow every token sampled before: read the calls in flight
                # first (the device runs this call's forward meanwhile), then sample.
                for previous in finished:
                    self._collect(previous)
                finished = []
                self._sample_masked(call)
            if not self.config.async_scheduling:
                finished, self._in_flight = finished + self._in_flight, []
            for call in finished:
                self._collect(call)
            self.counters["steps"] += 1
            self.counters["step_s"] += time.perf_counter() - start
            return out

    def process(self, out: CoreOutputs) -> list[RequestOutput]:
        """The outputs of what `core_step` returned, the steps' in their order, in any one
        thread: text, stop strings (their choices finish at `finish_stopped` or the next
        step), deltas."""
        start = time.perf_counter()
        outputs, stopped = self.output.process(out)
        self.stop(stopped)
        self.counters["outputs_s"] += time.perf_counter() - start
        return outputs

    def stop(self, choices: list[Request]) -> None:
        """These choices' text reached a stop string: they finish at `finish_stopped` or
        the next step (thread-safe)."""
        self._stops.extend(choices)

    def finish_stopped(self) -> None:
        """Finish the choices whose text reached a stop string (their last output is out)
        now, not at the next step (thread-safe)."""
        with self._lock:
            self._finish_stopped()

    def _finish_stopped(self) -> None:
        stops = []
        while self._stops:  # (`process` may add to them meanwhile)
            stops.append(self._stops.popleft())
        # (their outputs are out already; a client in another process learns they ended)
        self._out.finish(self.scheduler.finish(stops, "stop"))

    def _read_first(self) -> float:
        """Under async scheduling, read the calls in flight before scheduling when the next
        step depends on them: a beam search picks its next beams from their results, and a
        step that may draft (speculative decoding) extends its sequences' known tokens and
        learns how far a call with drafts advanced them (the accepted counts). Other steps
        overlap as before. Returns the time it took (reading results is not scheduling)."""
        if not self._in_flight:
            return 0.0
        spec = self.scheduler.speculator
        if not (
            any(
                r.req.beam or r.drafts
                for c in self._in_flight
                if not isinstance(c.rows, Decodes)  # (a steady step has neither)
                for r in c.rows
            )
            or (spec is not None and spec.active(self.scheduler.running))
        ):
            return 0.0
        start = time.perf_counter()
        for call in self._in_flight:
            self._collect(call)
        self._in_flight = []
        return time.perf_counter() - start

    def _embed(self, rows: Sequence[Scheduled]) -> list[Scheduled]:
        """Run the embedding requests' prompt chunks of a step (a call of their own that
        samples nothing) and finish those whose prompt is through; returns the other rows."""
        pooled = [r for r in rows if r.req.pooling]
        try:
            states = self.runner.hidden([Row(r.req.seq_id or 0, r.token_ids) for r in pooled])
        except Exception as exc:  # fail these requests, keep serving
            self._fail([r.req for r in pooled], exc)
            return [r for r in rows if not r.req.pooling]
        done = []
        for row, h in zip(pooled, states, strict=True):
            req = row.req
            first = row.computed == len(row.token_ids)  # (again, after a preemption)
            req.pooled = h.sum(0) if first else req.pooled + h.sum(0)
            if row.samples:  # the prompt is through
                v = h[-1] if req.pooling == "last" else req.pooled / len(req.prompt_ids)
                req.embedding = v / max(float(np.linalg.norm(v)), 1e-12)
                done.append(req)
        self._out.finish(self.scheduler.finish(done, "stop"))
        return [r for r in rows if not r.req.pooling]

    def _dispatch(self, rows: Sequence[Scheduled], copies: list[tuple[int, int]]) -> _Call | None:
        """Build the runner's rows (the batch) and start the step on the device, after the
        copy-on-write block copies its rows need."""
        batch: Sequence[Row] | Decodes
        if isinstance(rows, Decodes):  # a steady decode step: one token a row, no grammar
            batch, masked, steps, tokens = rows, False, 1, len(rows)
        else:
            batch = [row_of(row) for row in rows]
            masked = any(row.samples and row.req.matcher is not None for row in rows)
            steps = rows[0].steps  # (several decode steps a call: every row's)
            tokens = sum(len(r.token_ids) for r in rows)
        start, device = time.perf_counter(), self.runner.device_s
        try:
            self.runner.copy_blocks(copies)
            if steps > 1:
                assert not isinstance(batch, Decodes)
                pending = self.runner.dispatch_steps(batch, steps)
            else:
                pending = self.runner.dispatch(batch, sample=not masked)
        except Exception as exc:  # fail this call's requests, keep serving
            self._fail([r.req for r in rows], exc)
            return None
        self.counters["build_s"] += time.perf_counter() - start - (self.runner.device_s - device)
        kind = "decode" if tokens == len(rows) else "mixed"  # mixed: prompt chunks among them
        self.counters[f"{kind}_calls"] += 1
        self.counters[f"{kind}_tokens"] += tokens * steps  # (a call of several steps: each's)
        self.counters[f"{kind}_tokens_padded"] += pending.shape.tokens * steps
        if kind == "decode":
            self.decode_buckets[pending.shape.tokens] += 1
        return _Call(rows, pending)

    def _sample_masked(self, call: _Call) -> None:
        """Start the sampler of a call with constrained rows, each row's mask from its
        request's matcher (every row of a request the previous calls finished or preempted
        takes no mask: its token is never read)."""
        start = time.perf_counter()
        mask = np.full((call.pending.shape.sample_rows, self.mask_words), -1, np.int32)
        at = 0  # the row's sample position (rows with drafts sample several)
        for row in call.rows:
            req = row.req
            if (
                row.samples
                and req.matcher is not None
                and not req.finished
                and req.epoch == row.epoch
            ):
                fill_mask(req.matcher, mask[at])
            at += 1 + len(row.drafts)
        self.counters["mask_s"] += time.perf_counter() - start
        try:
            self.runner.sample(call.pending, mask)
        except Exception as exc:
            self._in_flight.remove(call)
            self._fail([r.req for r in call.rows if r.req.epoch == r.epoch], exc)

    def _collect(self, call: _Call) -> None:
        """Read a dispatched call's results: the scheduler advances its requests and hands
        their news over (`_out`)."""
        try:
            result = self.runner.collect(call.pending)
        except Exception as exc:
            self._fail([r.req for r in call.rows if r.req.epoch == r.epoch], exc)
            return
        self.counters["tokens_generated"] += self.scheduler.postprocess(
            call.rows, result, self._out
        )

    def _fail(self, reqs: list[Request], exc: Exception) -> None:
        self._out.finish(self.scheduler.fail(reqs, f"{type(exc).__name__}: {exc}"))
        if self.runner.pool_lost:
            # The donated pool died with the step: whoever else holds K/V must recompute.
            self.runner.reset_pool()
            self.scheduler.reset()

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every live request with `error` (the loop driving the engine died)."""
        return self.process(self.fail_core(error))

    def fail_core(self, error: str) -> CoreOutputs:
        """`fail_all`'s finishes, as token ids (the core's side of it)."""
        out = CoreOutputs()
        with self._lock:
            out.finish(
                self.scheduler.finish_requests(list(self.scheduler.requests), "error", error)
            )
        return out

    # -- observability -----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            stats: dict[str, float] = {
                "running": self.scheduler.num_running,
                "waiting": self.scheduler.num_waiting,
                "preemptions": self.scheduler.num_preemptions,
                "requests_finished": self.scheduler.num_finished,
                "requests_failed": self.scheduler.num_failed,
                "compilations": self.runner.compilations,
                "compilations_after_warmup": self.runner.compilations - self.warmup_compilations,
                **{k: float(v) for k, v in self.counters.items()},
                "device_s": self.runner.device_s,
                "wait_s": self.runner.wait_s,  # of device_s: reading results
                # every weight array (all shards), and the bits per weight value they hold
                "weight_bytes": self.weight_bytes,
                "weight_bits": self.weight_bits,
                "kv_block_bytes": self.block_bytes,  # K, V (and scales) of every layer
                "kv_value_bits": 8 * self.runner.kv.k.dtype.itemsize,
                # scheduling, batch building, sampling bookkeeping, detokenizing
                "host_s": self.counters["step_s"] - self.runner.device_s,
            }
            stats.update({f"kv_{k}": float(v) for k, v in self.cache.stats().items()})
            if self.scheduler.speculator is not None:
                stats.update(self.scheduler.speculator.stats())
            if self.runner.lora is not None:
                stats.update(self.runner.lora.stats())
            return stats
