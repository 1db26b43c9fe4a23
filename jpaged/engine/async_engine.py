"""The async front: one thread steps an engine (any `EngineInterface`); asyncio callers
submit requests (prepared in a worker thread of their own, off the event loop) and stream
each one's outputs."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
from collections.abc import AsyncGenerator

from jpaged.engine.intake import QueueFullError
from jpaged.engine.interface import EngineInterface, PromptRequest
from jpaged.engine.output import RequestOutput
from jpaged.engine.request import Request


class AsyncEngine:
    """Steps an engine in one thread; asyncio callers stream each request's outputs."""

    def __init__(self, engine: EngineInterface) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        # Preparing a request (tokenizing, compiling a grammar) runs here, not on the event
        # loop, which every stream needs; one worker keeps requests in their arrival order.
        self._prepare = concurrent.futures.ThreadPoolExecutor(1, "jpaged-prepare")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jpaged-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._prepare.shutdown()
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
                self._deliver(self.engine.step())
        except BaseException as exc:  # a bug in the loop itself: nobody may wait forever
            self._deliver(self.engine.fail_all(f"engine loop died: {type(exc).__name__}: {exc}"))
            raise

    def _discard(self, prepared: concurrent.futures.Future[Request]) -> None:
        if not prepared.cancelled() and prepared.exception() is None:
            self.engine.discard(prepared.result())

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up of each event loop (one an output
        wrote to the loop's self-pipe each time: 256 system calls a step at 256 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        streams = self._streams
        for out in outs:
            stream = streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    async def generate(self, request: PromptRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Raises ValueError / QueueFullError before the first one.

        With `sampling.n > 1` the outputs of all choices interleave (`RequestOutput.index`);
        the stream ends once each choice has sent its finished output. Closing the
        iterator early (a client that went away) aborts the request.
        """
        prepare = self._prepare.submit(self.engine.prepare, request)
        try:
            req = await asyncio.wrap_future(prepare)
        except asyncio.CancelledError:
            # the worker may still finish preparing it, for nobody: give back what it took
            prepare.add_done_callback(self._discard)
            raise
        try:
            self.engine.check_room(self._inbox.qsize())
        except QueueFullError:
            self.engine.discard(req)
            raise
        stream = self._streams[req.id] = _Stream(asyncio.get_running_loop())
        self._inbox.put(req)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = stream.take() or await stream.wait()
                finished = out.request_finished
                yield out
        finally:
            self._streams.pop(req.id, None)
            if not finished:
                self.engine.abort(req.id)
                self._wake.set()


class _Stream:
    """A request's outputs not yet read, on its event loop: a queue of one reader, lighter
    than `asyncio.Queue` (a step hands one an output per stream: at 256 streams its checks
    and its future made per `get` were a third of the event loop's time)."""

    __slots__ = ("loop", "outs", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.outs: collections.deque[RequestOutput] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def take(self) -> RequestOutput | None:
        return self.outs.popleft() if self.outs else None

    async def wait(self) -> RequestOutput:
        while not self.outs:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.outs.popleft()


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.outs.append(out)
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
