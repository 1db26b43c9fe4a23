"""One model over several processes (hosts) with `jax.distributed`: process 0 drives, the
others mirror its device calls.

JAX runs several processes as one program (multi-controller): every process must call
the same jitted functions, in the same order, on global arrays that span every
process's devices; XLA's collectives (gloo on CPUs, NCCL on GPUs) run between them.
Process 0 alone runs the scheduler, the allocator and the server; its runner
(`DriverRunner`) announces each device call it makes to the others through a broadcast
collective of JAX itself (a jitted sum over a process axis): a small int32 header naming
the call (a step of some shape, a sampler variant, a block copy, ...), and every host
array the call puts on the devices (the step's packed int32 array among them). The
other processes (`serve_worker`) run no scheduler: each receives a header, makes the
same call on its own `Runner` (its params' and pool's shards), and takes its inputs
from the broadcasts, never from a host state of its own. They stop when process 0 says
so, or when its collectives fail (process 0 died).

A worker that dies makes process 0's next collective fail (gloo: the connection is
reset): that step's requests fail with `WorkerLost`, and so does every later step's.
JAX's coordination service terminates every process once it sees a peer gone (its
connection dropped, or `heartbeat_timeout_seconds` without heartbeats), which can come
first and cut process 0's streams; nothing here survives a lost process.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jpaged.config import EngineConfig
from jpaged.engine import heap
from jpaged.engine.buckets import Shape
from jpaged.engine.contract import Decodes, StepResult
from jpaged.engine.controls import fill_fn
from jpaged.engine.engine import Engine, fit_blocks
from jpaged.engine.runner import Pending, Runner
from jpaged.engine.sizing import cache_size, kv_block_bytes, kv_groups
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import engine_mesh, shard_model

PUT, FORWARD, SAMPLE, SAMPLE_PLAIN, COPY, ALLOC, FILL, RESET, STOP = range(9)
IMPLS = ("xla", "pallas")
# EngineConfig fields each process may set for itself: the rest must agree
LOCAL = ("warmup", "compilation_cache_dir")
SHAPE_FIELDS = dataclasses.fields(Shape)
# header: op, then int32 arguments (at most a step's shape, every field)
HEADER = 1 + len(SHAPE_FIELDS)
# broadcasts made, their int32 payload bytes, the host time dispatching them took
CHANNEL_COUNTERS = ("broadcasts", "broadcast_bytes", "broadcast_s")
DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.bool_))


class WorkerLost(RuntimeError):
    """A collective with the other processes failed: one of them is gone."""


def initialize(
    coordinator: str | None, num_processes: int, process_id: int, heartbeat_timeout_s: int = 100
) -> None:
    """`jax.distributed.initialize` on this process (before anything else uses JAX); gloo
    collectives between CPU processes (GPUs use NCCL, JAX's default there). `coordinator`
    None: JAX reads $JAX_COORDINATOR_ADDRESS."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    with contextlib.suppress(AttributeError):  # later JAX may drop the option (gloo default)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes, process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
    )


def check(config: EngineConfig) -> None:
    """ValueError unless the config spans every process's devices in one model."""
    n = jax.device_count()
    if config.tensor_parallel != n or config.data_parallel != 1:
        raise ValueError(
            f"over {jax.process_count()} processes the model is split over all {n} devices: "
            f"tensor_parallel must be {n} and data_parallel 1, got tensor_parallel="
            f"{config.tensor_parallel}, data_parallel={config.data_parallel}"
        )


def agree(config: EngineConfig) -> None:
    """ValueError, on every process, naming each field where a process's config differs from
    process 0's: a setting given to one process only (a pool of another size, another KV
    dtype) would have it build other arrays and programs than process 0 mirrors onto it."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in LOCAL]
    values = [repr(getattr(config, n)).encode() for n in names]
    digests = np.array([zlib.crc32(v) for v in values], np.uint32).view(np.int32)
    rows = np.asarray(multihost_utils.process_allgather(digests))  # [processes, fields]
    differ = {
        n: [p for p in range(1, len(rows)) if rows[p, i] != rows[0, i]] for i, n in enumerate(names)
    }
    if any(differ.values()):
        me = jax.process_index()
        raise ValueError(
            "every process must be given the same engine settings: "
            + "; ".join(
                f"EngineConfig.{n} of process {', '.join(map(str, ps))} differs from process "
                f"0's (process {me} has {getattr(config, n)!r})"
                for n, ps in differ.items()
                if ps
            )
        )


def _merge(x: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Process 0's row of `x` [processes, n] (the others send zeros), as `dtype` [shape]."""
    flat = x.sum(0).reshape(shape)
    if dtype == np.float32:
        return lax.bitcast_convert_type(flat, jnp.float32)
    return flat != 0 if dtype == np.bool_ else flat


def shape_args(shape: Shape) -> list[int]:
    """A step's whole shape as header arguments: a field dropped here would have the
    workers compile and run another program than process 0."""
    return [
        IMPLS.index(shape.impl) if f.name == "impl" else int(getattr(shape, f.name))
        for f in SHAPE_FIELDS
    ]


def shape_of(args: list[int]) -> Shape:
    """`shape_args`' inverse."""
    kinds: dict[str, Callable[[int], Any]] = {"int": int, "bool": bool, "str": IMPLS.__getitem__}
    return Shape(*(kinds[str(f.type)](a) for f, a in zip(SHAPE_FIELDS, args, strict=True)))


@contextlib.contextmanager
def _lost() -> Iterator[None]:
    """XLA's runtime errors (a collective's peer gone, most likely) as WorkerLost."""
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        raise WorkerLost(
            f"a collective with the other processes failed (is one of them gone?): {exc}"
        ) from exc


class Channel:
    """Broadcasts from process 0, through a jitted collective over every device."""

    def __init__(self, mesh: Mesh) -> None:
        devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        self._rows = NamedSharding(Mesh(devices, ("proc", "local")), PartitionSpec("proc"))
        self._merge = jax.jit(
            _merge,
            static_argnames=("shape", "dtype"),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )
        self.queue: collections.deque[jax.Array] = collections.deque()  # workers: PUTs not taken
        self.counters: dict[str, float] = dict.fromkeys(CHANNEL_COUNTERS, 0)

    def _broadcast(self, host: np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        start = time.perf_counter()
        size = int(np.prod(shape))
        if host is None:
            row = np.zeros((1, size), np.int32)
        else:
            ints = host.astype(np.int32) if host.dtype == np.bool_ else host.view(np.int32)
            row = ints.reshape(1, size)
        x = jax.make_array_from_process_local_data(self._rows, row, (jax.process_count(), size))
        with _lost():
            out = self._merge(x, shape=shape, dtype=dtype)
        self.counters["broadcasts"] += 1
        self.counters["broadcast_bytes"] += 4 * size
        self.counters["broadcast_s"] += time.perf_counter() - start
        return out

    def send(self, op: int, *args: int) -> None:
        """Process 0: announce a call."""
        header = np.zeros(HEADER, np.int32)
        header[: 1 + len(args)] = (op, *args)
        self._broadcast(header, (HEADER,), np.int32)

    def put(self, host: np.ndarray, announce: bool = True) -> jax.Array:
        """Process 0: `host` on every device of every process (replicated); without a
        header of its own when the workers know its shape already (`announce=False`)."""
        host = np.ascontiguousarray(host)
        if host.dtype not in DTYPES or host.ndim > HEADER - 3:
            raise TypeError(f"cannot broadcast a {host.dtype} array of {host.ndim} dims")
        if announce:
            self.send(PUT, DTYPES.index(host.dtype), host.ndim, *host.shape)
        return self._broadcast(host, host.shape, host.dtype)

    def expect(self, shape: tuple[int, ...], dtype: Any) -> None:
        """Workers: receive an array process 0 puts unannounced, for the next `take`."""
        assert not self.queue, "arrays put before are still untaken"
        self.queue.append(self._broadcast(None, shape, dtype))

    def receive(self) -> tuple[int, ...]:
        """Workers: the next header (a PUT's array goes to `queue`)."""
        out = self._broadcast(None, (HEADER,), np.int32)
        op, *args = (int(v) for v in np.asarray(out.addressable_data(0)))
        if op == PUT:
            dtype, ndim = DTYPES[args[0]], args[1]
            shape = tuple(args[2 : 2 + ndim])
            self.queue.append(self._broadcast(None, shape, dtype))
        return (op, *args)

    def take(self) -> jax.Array:
        """Workers: the next array process 0 put."""
        while not self.queue:
            op, *_ = self.receive()
            if op != PUT:
                raise RuntimeError(f"process 0 sent op {op} where an array was due")
        return self.queue.popleft()


class _Mirrored(Runner):
    """A runner whose host arrays cross to the devices through the channel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.mesh is not None
        self.channel = Channel(self.mesh)
        self.max_steps = 1  # (calls of several decode steps are not mirrored)


class DriverRunner(_Mirrored):
    """Process 0's runner: announces each device call to the other processes first."""

    stopped = False
    _implied = False  # the next put's shape is known to the workers (a step's packed array)

    def _put(self, host: np.ndarray) -> jax.Array:
        if not hasattr(self, "channel"):  # during Runner.__init__: nothing is put there
            return super()._put(host)
        announce, self._implied = not self._implied, False
        return self.channel.put(host, announce)

    def dispatch(self, rows: Any, sample: bool = True) -> Pending:
        if (
            self.controls.state is None
            and not isinstance(rows, Decodes)  # (a steady decode step has no controls)
            and any(r.controls is not None or r.block_eos for r in rows)
        ):
            self.channel.send(ALLOC)  # the 4 puts of `ControlSlots.allocate` follow
        with _lost():
            return super().dispatch(rows, sample)

    def collect(self, pending: Pending) -> StepResult:
        with _lost():
            return super().collect(pending)

    def _forward(
        self, shape: Shape, packed: np.ndarray, features: jax.Array | None = None
    ) -> tuple[jax.Array, Any, Any]:
        if features is not None:  # (a model over several processes has no vision encoder)
            raise ValueError("images are not served by a model over several processes")
        self.channel.send(FORWARD, *shape_args(shape))
        self._implied = True  # the packed array follows: its size is the shape's
        return super()._forward(shape, packed)

    def sample(self, pending: Pending, mask: np.ndarray | None = None) -> None:
        assert pending.unsampled is not None, "sampled already"
        _, _, sampler, controlled = pending.unsampled
        self.channel.send(SAMPLE, sampler["greedy"], sampler["top"], controlled, mask is not None)
        with _lost():
            super().sample(pending, mask)

    def _sample(self, logits: jax.Array, sampling: Any, sampler: dict[str, bool]) -> jax.Array:
        self.channel.send(SAMPLE_PLAIN, sampler["greedy"], sampler["top"])
        return super()._sample(logits, sampling, sampler)

    def copy_blocks(self, copies: Any) -> None:
        if copies:
            self.channel.send(COPY, len(copies))
        with _lost():
            super().copy_blocks(copies)

    def _counted(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is fill_fn:  # `ControlSlots.assign` put its two arrays already
            self.channel.send(FILL)
        return super()._counted(fn, *args, **kwargs)

    def reset_pool(self) -> None:
        self.channel.send(RESET)
        super().reset_pool()

    def stop(self) -> None:
        """Let the other processes go (they exit)."""
        self.channel.send(STOP)


class WorkerRunner(_Mirrored):
    """A worker's runner: every array it would put comes from process 0's broadcasts."""

    def _put(self, host: np.ndarray) -> jax.Array:
        if not hasattr(self, "channel"):
            return super()._put(host)
        return self.channel.take()

    def serve(self) -> None:
        """Make each device call process 0 announces until it says stop (returns) or its
        collectives fail (raises WorkerLost)."""
        channel = self.channel
        last: tuple[Shape, jax.Array, Any] | None = None  # the latest step's shape and outputs
        while True:
            op, *a = channel.receive()
            if op == FORWARD:
                shape = shape_of(a)
                channel.expect((shape.size(),), np.int32)
                logits, sampling, _ = self._forward(shape, np.empty(0, np.int32))
                last = (shape, logits, sampling)
            elif op in (SAMPLE, SAMPLE_PLAIN):
                assert last is not None, "a sampler before any step"
                shape, logits, sampling = last
                sampler = {"greedy": bool(a[0]), "top": a[1]}  # alternatives searched
                if op == SAMPLE_PLAIN:
                    self._sample(logits, sampling, sampler)
                    continue
                unsampled = (logits, sampling, sampler, bool(a[2]))
                pending = Pending(None, 0, shape, unsampled=unsampled)
                self.sample(pending, np.empty(0, np.int32) if a[3] else None)
            elif op == COPY:
                self.copy_blocks([(0, 0)] * a[0])
            elif op == ALLOC:
                self.controls.state = self.controls.allocate()
            elif op == FILL:
                state = self.controls.state
                self.controls.state = self._counted(fill_fn, state, channel.take(), channel.take())
            elif op == RESET:
                self.reset_pool()
            elif op == STOP:
                return


def _fewest(blocks: int) -> int:
    """Every process's pool the same size: what fits the fullest device."""
    return int(np.min(multihost_utils.process_allgather(np.int32(blocks))))


class DriverEngine(Engine):
    runner_cls = DriverRunner

    def _fit_blocks(self, model: LoadedModel, fraction: float) -> int:
        return _fewest(super()._fit_blocks(model, fraction))

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        assert isinstance(self.runner, DriverRunner)
        stats.update(self.runner.channel.counters)
        stats["processes"] = jax.process_count()
        return stats


def driver(model: LoadedModel, config: EngineConfig) -> Engine:
    """Process 0's engine (the workers must be in `serve_worker`)."""
    check(config)
    agree(config)
    engine = DriverEngine(model, config)
    atexit.register(stop, engine)  # workers exit with process 0
    return engine


def stop(engine: Engine) -> None:
    """Process 0: release the workers."""
    runner = engine.runner
    if isinstance(runner, DriverRunner) and not runner.stopped:
        runner.stopped = True
        with contextlib.suppress(WorkerLost):  # gone already
            runner.stop()


def serve_worker(model: LoadedModel, config: EngineConfig) -> None:
    """A worker process: mirror process 0's device calls until it stops (returns) or
    its collectives fail (raises WorkerLost)."""
    check(config)
    agree(config)
    # the engine's mesh and pool, built in the same order (the same collectives) as
    # process 0's engine builds them, without the scheduling a worker never does
    mesh = engine_mesh(model, config.tensor_parallel)
    model = shard_model(model, mesh)
    groups = kv_groups(config, model.config)
    nbytes = kv_block_bytes(config, model.config, groups)
    usable = config.usable_blocks(nbytes, groups.num_groups)
    fraction = config.kv_fraction()
    if fraction is not None:
        usable = _fewest(fit_blocks(model, config, mesh, groups, nbytes, fraction))
    runner = WorkerRunner(model, config, cache_size(config, usable, groups), mesh, groups)
    heap.settle()  # (as process 0's server: a full collection would stall the collectives)
    runner.serve()
