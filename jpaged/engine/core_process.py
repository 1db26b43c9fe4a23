"""The engine core in a process of its own (vLLM V1's `EngineCore` process): scheduling,
batch building, launching and reading run there, while the server's process (its HTTP
work, the detokenizing and the output objects: `core_client.CoreClient`) runs beside it
on another core, not in series with it under one GIL.

What crosses the pipe is small: a prepared request's prompt ids and parameters (the
core prepares it: tokenizing, grammars, images and LoRA adapters stay where the weights
are), then per step the token ids the core produced, by choice (`Wire`: columns, an int a
choice), never text. A choice whose text reached a stop string is finished here one step
late, as in vLLM: the token sampled meanwhile is dropped by the output processor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import jax
import numpy as np

from jpaged.cache.groups import KVGroups
from jpaged.config import EngineConfig
from jpaged.engine import router
from jpaged.engine.contract import CoreOutputs, Scores
from jpaged.engine.engine import Engine
from jpaged.engine.lora import LoRARequest
from jpaged.engine.request import Request
from jpaged.engine.router import Replicas
from jpaged.engine.sampling import SamplingParams
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel

# Calls the client may make of the core's engine, answered by the reader thread (each is
# thread-safe on an `Engine`): stats, adapters, audits.
CALLS = frozenset({"stats", "register_lora", "unregister_lora", "tokenize", "audit", "mark_warm"})


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the core process builds, each callable picklable (a module's function, or a
    `functools.partial` of one): the engine's config, `config()` (made there: "auto"
    settings are the core's device's), the model `load(config)`, an engine of the config
    over it, `adapters` registered."""

    load: Callable[[EngineConfig], LoadedModel]
    config: Callable[[], EngineConfig]
    adapters: Sequence[LoRARequest] = ()


@dataclasses.dataclass(frozen=True)
class Ready:
    """What the client needs of the engine built (`EngineInterface`'s attributes)."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    generation_config: dict
    source: str
    groups: KVGroups
    block_bytes: int
    num_blocks: int
    image_placeholder: str | None
    loras: dict[str, LoRARequest]  # the adapters registered at the start


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A prepared request as the client's output processor sees it: its choices' handles
    (the core's names for them on the wire), prompt ids and parameters."""

    request_id: str
    handles: tuple[int, ...]  # one a choice, by index
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...]
    arrival: float


@dataclasses.dataclass
class Wire:
    """A step's `CoreOutputs` with each choice as its handle, and what the client's copy
    of a choice cannot know: its speculative counts and embedding (where they are set)."""

    handles: list[int]
    tokens: list[int | None]
    logprobs: list[float]
    top: dict[int, tuple[np.ndarray, np.ndarray]]
    scores: dict[int, tuple[int, Scores]]
    finished: dict[int, tuple[str | None, str | None]]
    drafts: dict[int, tuple[int, int]]  # handle -> (draft tokens verified, accepted)
    embeddings: dict[int, np.ndarray]
    waiting: int  # the core's queue, for the client's admission


def wire(out: CoreOutputs, handles: dict[Request, int], waiting: int, speculative: bool) -> Wire:
    """`out` for the pipe, each choice as its handle (`speculative`: the choices' draft
    counts go along)."""
    drafts = {}
    if speculative:
        drafts = {handles[r]: (r.num_draft_tokens, r.num_accepted_tokens) for r in out.reqs}
    return Wire(
        [handles[r] for r in out.reqs],
        out.tokens,
        out.logprobs,
        out.top,
        out.scores,
        {handles[r]: v for r, v in out.finished.items()},
        drafts,
        {handles[r]: r.embedding for r in out.finished if r.embedding is not None},
        waiting,
    )


def load_path(path: str, config: EngineConfig, mmproj: str | None = None) -> LoadedModel:
    """The checkpoint, GGUF or demo model at `path` as `config` loads it (dtype,
    quantization, activations, tensor parallelism): `Launch.load`'s usual."""
    from jpaged import models

    return models.load(
        path, config.dtype, config.tensor_parallel, config.quantization, config.activations, mmproj
    )


def build(launch: Launch) -> Engine | Replicas:
    """The engine `launch` describes (a ValueError names what is wrong: a setting, an
    adapter)."""
    from jpaged.models import quant

    config = launch.config()
    loaded = launch.load(config)
    engine = router.build(loaded, config)
    print(f"jpaged: weights {quant.describe(loaded.model)}", flush=True)
    for adapter in launch.adapters:
        try:
            engine.register_lora(adapter)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {adapter.lora_name!r}: {exc}") from None
    return engine


def serve(conn: Connection, launch: Launch) -> None:
    """The core process: build the engine, say `Ready` (or the ValueError that stopped
    it), then step it until told to stop or the client goes away."""
    # A Ctrl-C (SIGINT to the process group) or a SIGTERM is the server's to handle: it
    # drains its streams, then stops this process (or this one sees its pipe close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build(launch)
        if not isinstance(engine, Engine):
            raise ValueError("an engine process runs one replica (data_parallel 1)")
    except ValueError as exc:
        conn.send(("error", str(exc)))
        return
    ready = Ready(
        engine.config,
        engine.model_config,
        engine.tokenizer,
        engine.model.generation_config,
        engine.model.source,
        engine.groups,
        engine.block_bytes,
        engine.num_blocks,
        engine.image_placeholder,
        engine.loras(),
    )
    promote_weights(engine)
    Core(conn, engine).run(ready)


def promote_weights(engine: Engine | Replicas) -> None:
    """On a CPU, the weights (host memory the kernels read in place) into huge pages while
    the engine idles (`models.hugepages`)."""
    from jpaged.models import hugepages

    if jax.default_backend() == "cpu":
        hugepages.promote(engine.weights(), idle=lambda: not engine.has_unfinished())


class Core:
    """The core process's loop: a reader thread takes the client's messages (requests to
    prepare, add, abort or stop; calls), the main thread steps the engine and sends each
    step's `Wire`."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self.conn, self.engine = conn, engine
        self._send_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        # Every choice from its preparing to its finish (or discard) has a handle, its name
        # on the pipe: a number never used again (an object's id may be, once it is freed).
        self._ids = itertools.count()
        self._handles: dict[Request, int] = {}
        self._choices: dict[int, Request] = {}
        # preparing may compile a grammar: never on the stepping thread, requests in order
        self._prepare = concurrent.futures.ThreadPoolExecutor(1, "jpaged-prepare")

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def run(self, ready: Ready) -> None:
        self.send(("ready", ready))
        reader = threading.Thread(target=self._read, name="jpaged-core-reader", daemon=True)
        reader.start()
        engine = self.engine
        try:
            while not self._stop:
                while not self._inbox.empty():
                    self._take(*self._inbox.get())
                if not engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._send_out(engine.core_step())
        except BaseException as exc:  # a bug in the loop itself: nobody may wait forever
            self._send_out(engine.fail_core(f"engine loop died: {type(exc).__name__}: {exc}"))
            raise
        finally:
            self._prepare.shutdown(cancel_futures=True)

    def _send_out(self, out: CoreOutputs) -> None:
        spec = self.engine.scheduler.speculator is not None
        message = wire(out, self._handles, self.engine.scheduler.num_waiting, spec)
        self._forget(list(out.finished))
        self.send(("out", message))

    def _forget(self, choices: list[Request]) -> None:
        for c in choices:
            self._choices.pop(self._handles.pop(c, -1), None)

    def _take(self, kind: str, arg: Any) -> None:
        """A message for the stepping thread (between steps)."""
        if kind == "add":
            self.engine.queue(self._choices[arg])
        elif kind == "discard":
            req = self._choices[arg]
            self._forget(req.group)
            self.engine.discard(req)
        elif kind == "stop":
            self.engine.stop([self._choices[h] for h in arg if h in self._choices])
        else:
            self.engine.abort(arg)

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "prepare":
                    self._prepare.submit(self._prepared_one, *message[1:])
                elif kind == "call":
                    self._call(*message[1:])
                elif kind == "shutdown":
                    break
                else:
                    self._inbox.put(message)
                    self._wake.set()
        except (EOFError, OSError):
            pass  # the client is gone
        self._stop = True
        self._wake.set()

    def _prepared_one(self, call_id: int, asked: Any) -> None:
        try:
            req = self.engine.prepare(asked)
        except Exception as exc:  # the client raises it
            self.send(("reply", call_id, _portable(exc), None))
            return
        handles = tuple(next(self._ids) for _ in req.group)
        for c, h in zip(req.group, handles, strict=True):
            self._handles[c], self._choices[h] = h, c
        info = Prepared(
            req.id,
            handles,
            req.prompt_ids,
            req.params,
            req.eos_ids,
            req.arrival,
        )
        self.send(("reply", call_id, None, (info, self.engine.scheduler.num_waiting)))

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        if name not in CALLS:
            self.send(("reply", call_id, ValueError(f"no call {name!r}"), None))
            return
        try:
            result = getattr(self.engine, name)(*args)
        except Exception as exc:
            self.send(("reply", call_id, _portable(exc), None))
            return
        self.send(("reply", call_id, None, result))


def _portable(exc: Exception) -> Exception:
    """`exc`, or where it would not come out of a pickle whole (an exception whose
    arguments are not its constructor's), a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
