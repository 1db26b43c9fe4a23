"""An engine whose core runs in a process of its own (`core_process`), as the server's
process sees it: an `EngineInterface` whose `step` takes the core's next step (token ids)
and makes its outputs here (text, stop strings, deltas: `OutputProcessor`), so that this
process's work (HTTP, streams, outputs) runs beside the core's instead of after it.

The core prepares requests (`prepare`: a round trip to it); this side keeps a copy of
each choice that the output processor reads (`Request` objects that never schedule).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import queue
import threading
import time
from typing import Any

from jpaged.engine.contract import CoreOutputs
from jpaged.engine.core_process import Launch, Prepared, Ready, Wire, serve
from jpaged.engine.intake import QueueFullError
from jpaged.engine.interface import PromptRequest
from jpaged.engine.lora import LoRARequest
from jpaged.engine.output import OutputProcessor, RequestOutput, RequestState
from jpaged.engine.request import Request
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import abstract


class CoreClient:
    """`EngineInterface` over an engine core in a child process (started here)."""

    def __init__(self, launch: Launch, start_timeout_s: float = 3600) -> None:
        """Start the core process and wait until its engine is built and warm."""
        context = multiprocessing.get_context("spawn")  # (a forked JAX runtime would hang)
        self._conn, child = context.Pipe()
        self._proc = context.Process(
            target=serve, args=(child, launch), name="jpaged-core", daemon=True
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start in {start_timeout_s:g} s")
        try:
            kind, ready = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(
                f"the engine process exited while starting (code {self._proc.exitcode})"
            ) from None
        if kind == "error":
            self._proc.join()
            raise ValueError(ready)
        self._ready: Ready = ready
        self.config = ready.config
        self.model_config = ready.model_config
        self.tokenizer = ready.tokenizer
        self.groups = ready.groups
        self.block_bytes = ready.block_bytes
        # the model's structure, its weights in the core's process
        self.model = LoadedModel(
            abstract(ready.model_config, ready.config.dtype),
            ready.tokenizer,
            ready.generation_config,
            ready.source,
        )
        self.output = OutputProcessor(ready.tokenizer)
        self._loras = dict(ready.loras)
        self.outputs_s = 0.0
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._steps: queue.SimpleQueue[Wire | None] = queue.SimpleQueue()
        self._choices: dict[int, Choice] = {}  # handle -> this side's copy of a choice
        self._waiting = 0  # the core's queue, as it last said
        self._sent = 0  # requests added since it said so
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="jpaged-client", daemon=True)
        self._reader.start()

    @property
    def num_blocks(self) -> int:
        return self._ready.num_blocks

    @property
    def image_placeholder(self) -> str | None:
        return self._ready.image_placeholder

    # -- the pipe

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "out":
                    self._steps.put(message[1])
                else:
                    _, call_id, error, result = message
                    done, box = self._replies.pop(call_id)
                    box[:] = [error, result]
                    done.set()
        except (EOFError, OSError):
            pass
        self._steps.put(None)  # the core is gone: a step waiting for it fails
        for done, box in list(self._replies.values()):
            box[:] = [RuntimeError("the engine process is gone"), None]
            done.set()

    def _ask(self, *message: Any) -> Any:
        """A round trip: the core's answer, or the error it raised, raised here."""
        call_id = next(self._calls)
        done, box = self._replies[call_id] = (threading.Event(), [])
        if not self._reader.is_alive():
            raise RuntimeError("the engine process is gone")
        self._send((message[0], call_id, *message[1:]))
        done.wait()
        error, result = box
        if error is not None:
            raise error
        return result

    def _call(self, name: str, *args: Any) -> Any:
        return self._ask("call", name, args)

    # -- requests

    def prepare(self, request: PromptRequest) -> Request:
        info, self._waiting = self._ask("prepare", request)
        self._sent = 0
        return _copy(info)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._call("tokenize", text, add_special_tokens)

    def discard(self, request: Request) -> None:
        self._send(("discard", _choice(request).handle))

    def room(self) -> int:
        """What the core's queue can still take, as it last said (less those added since)."""
        return self.config.max_waiting_requests - self._waiting - self._sent

    def check_room(self, submitted: int = 0) -> None:
        if self.room() <= submitted:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )

    def add(self, request: Request) -> RequestState:
        self._choices.update((c.handle, c) for c in map(_choice, request.group))
        state = self.output.add(request)
        self._sent += 1
        self._send(("add", _choice(request).handle))
        return state

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.output.states)

    # -- stepping

    def step(self) -> list[RequestOutput]:
        """The core's next step, its outputs made here; the choices whose text reached a
        stop string finish in the core's next step."""
        got = self._steps.get()
        if got is None:
            raise RuntimeError("the engine process is gone")
        start = time.perf_counter()
        choices = self._choices
        out = CoreOutputs(
            [choices[h] for h in got.handles],
            got.tokens,
            got.logprobs,
            got.top,
            got.scores,
            {choices[h]: v for h, v in got.finished.items()},
        )
        for h, (drafts, accepted) in got.drafts.items():
            choices[h].num_draft_tokens, choices[h].num_accepted_tokens = drafts, accepted
        for h, embedding in got.embeddings.items():
            choices[h].embedding = embedding
        self._waiting, self._sent = got.waiting, 0
        outputs, stopped = self.output.process(out)
        if stopped:
            self._send(("stop", [_choice(c).handle for c in stopped]))
        for h in got.finished:
            del choices[h]
        self.outputs_s += time.perf_counter() - start
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every live request with `error` here (the loop driving it died)."""
        out = CoreOutputs()
        live = [c for c in self._choices.values() if c.finish_reason is None]
        for c in live:
            c.finish_reason, c.error = "error", error
        out.finish(live)
        self._choices.clear()
        return self.output.process(out)[0]

    def mark_warm(self) -> None:
        self._call("mark_warm")

    # -- LoRA adapters

    def loras(self) -> dict[str, LoRARequest]:
        """(Asked for each request naming a model: kept here, where every change is made.)"""
        return dict(self._loras)

    def register_lora(self, request: LoRARequest) -> None:
        self._call("register_lora", request)
        self._loras[request.lora_name] = request

    def unregister_lora(self, name: str) -> None:
        self._call("unregister_lora", name)
        del self._loras[name]

    # -- observability

    def stats(self) -> dict[str, float]:
        return self._call("stats") | {"outputs_s": self.outputs_s}

    def weights(self) -> list[Any]:
        return []  # (in the core's process)

    def audit(self) -> list[int]:
        return self._call("audit")

    def close(self) -> None:
        """Stop the core process (its engine's requests with it)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # (already gone)
            self._send(("shutdown",))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


class Choice(Request):
    """This side's copy of a choice of a prepared request: what the output processor reads,
    and the core's name for it (`handle`); it never schedules."""

    def __init__(self, info: Prepared, index: int) -> None:
        super().__init__(
            info.prompt_ids, info.params, info.eos_ids, info.request_id, index, arrival=info.arrival
        )
        self.handle = info.handles[index]


def _copy(info: Prepared) -> Request:
    group: list[Request] = [Choice(info, k) for k in range(len(info.handles))]
    for c in group:
        c.group = group
    return group[0]


def _choice(request: Request) -> Choice:
    assert isinstance(request, Choice), "a request this client prepared"
    return request
