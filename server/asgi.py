"""The connection's side of serving: the ASGI app that knows its transport, the
streaming response that gives up on a stalled client, the wait that gives up on a
gone one, and the gate in front of every route (API keys, admission, graceful drain)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jpaged.engine.async_engine import AsyncEngine
from server.errors import APIError, ClientGone
from server.format import sse

T = TypeVar("T")
_TRANSPORT = "jpaged.transport"  # scope key: the connection's transport, when the server has one
_ENDING = "jpaged.ending"  # scope key: how the stream the route began ends on an error
# how long a client whose request a shutdown cancelled gets to take the last event
FINAL_EVENT_S = 1.0


# routes outside /v1 that the API keys and the drain cover as well (vLLM's)
_UTILITIES = ("/tokenize", "/detokenize")


log = logging.getLogger(__name__)

# an error -> the events that end a stream with it
Ending = Callable[[APIError], str]


def error_and_done(error: APIError) -> str:
    """How a completions / chat stream ends on an error: the error event, then `[DONE]`
    (clients that read until `[DONE]` would otherwise wait, or treat a cut as success)."""
    fields = {"message": error.message, "type": error.kind, "param": error.param}
    return sse({"error": {**fields, "code": error.code}}) + sse("[DONE]")


def as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.exception("a stream failed", exc_info=exc)  # its message may hold what is not public
    return APIError(500, "internal server error", kind="server_error")


class _Stalled(Exception):
    """A streaming client stopped reading."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first.

    Non-streaming requests and the wait for a stream's first token get no
    disconnect handling from Starlette; cancelling the task closes the
    engine's async iterator inside it, which aborts the request.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (shutdown): take both along
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # the abort is sent once this returns
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """SSE that gives up on a client which stops reading: once a chunk has waited
    `timeout_s` for room in the connection's buffers, the request is cancelled.

    Whatever ends `content` early (an exception in it, or a shutdown that cancels the
    request: see `Gate`) ends the stream with `ending`'s events, so no client is left
    with a stream cut short and nothing saying why."""

    def __init__(
        self,
        content: AsyncGenerator[str, None],
        timeout_s: float,
        ending: Ending = error_and_done,
    ) -> None:
        super().__init__(
            self._ended(content),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
        self.content, self.timeout_s, self.ending = content, timeout_s, ending

    async def _ended(self, content: AsyncGenerator[str, None]) -> AsyncIterator[str]:
        try:
            async for chunk in content:
                yield chunk
        except Exception as exc:
            yield self.ending(as_api_error(exc))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            # (asyncio's timeout, not anyio's cancel scope: a chunk a token a stream, and
            # anyio's scope cost more than the rest of the send)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await send(message)  # waits while the client's buffers are full
            except TimeoutError:
                raise _Stalled from None

        scope[_ENDING] = self.ending
        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _Stalled:
            # Closing would wait until the client reads what is buffered: maybe never.
            transport = scope.get(_TRANSPORT)
            if transport is not None:
                transport.abort()
        finally:
            # Starlette cancels the sender when the client leaves; if that lands while
            # the generator is parked at a yield, only this close reaches the engine
            # (else the abort waits for garbage collection).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.content.aclose()  # closing the wrapper above leaves it open


class App(Starlette):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # uvicorn's `send` is a method of the connection's request cycle: its transport
        # lets a stalled stream drop the connection (other servers: the response just ends)
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        scope[_TRANSPORT] = transport if callable(getattr(transport, "abort", None)) else None
        await super().__call__(scope, receive, send)


def _authorized(scope: Scope, keys: list[bytes]) -> bool:
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, given = header.partition(b" ")
    # every key is compared, in constant time: neither timing nor which key tells anything
    matches = [hmac.compare_digest(given.strip(), key) for key in keys]
    return scheme.lower() == b"bearer" and any(matches)


class Admission:
    """Which `/v1/*` requests run, whether new ones are still let in, and the connections
    a graceful shutdown may have to drop."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine
        self.draining = False
        self.running: set[asyncio.Task] = set()
        # every connection a request came on (uvicorn's transports; they go with it)
        self.connections: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting; give running requests, and answers still waiting for their client
        to read them, `timeout_s` seconds; cancel the requests left and drop the connections
        left; return once the engine has freed every block.

        A client that stops reading would otherwise hold the server: uvicorn waits without
        bound for every connection to take what was written to it before it closes it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.running:
            _, late = await asyncio.wait(set(self.running), timeout=timeout_s)
            for task in late:
                task.cancel()  # the gate sends its client an error event, if it can take one
            await asyncio.gather(*late, return_exceptions=True)
        until = max(deadline, loop.time() + FINAL_EVENT_S)
        while (unread := [c for c in self.connections if c.get_write_buffer_size()]) and (
            loop.time() < until
        ):
            await asyncio.sleep(0.05)  # nothing tells when a client reads
        for connection in unread:
            connection.abort()
        # aborts free blocks at the engine's next step; stopping its loop first would not
        while self.aengine.alive and self.aengine.engine.has_unfinished():
            await asyncio.sleep(0.01)


class Gate:
    """ASGI middleware: API keys, and admission for a graceful shutdown.

    `/v1/*` requests run in tasks of their own, so `Admission.drain` can cancel
    one that outlives the grace period and still end its response properly.
    """

    def __init__(
        self,
        app: ASGIApp,
        admission: Admission,
        api_keys: list[str],
        metrics_keys: list[str],
    ) -> None:
        self.app, self.admission = app, admission
        self.api_keys = [k.encode() for k in api_keys]
        self.metrics_keys = [k.encode() for k in metrics_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get(_TRANSPORT) is not None:
            self.admission.connections.add(scope[_TRANSPORT])
        path = scope.get("path", "")
        api = scope["type"] == "http" and (path.startswith("/v1/") or path in _UTILITIES)
        keys = self.api_keys if api else self.metrics_keys if path == "/metrics" else []
        if keys and not _authorized(scope, keys):
            error = APIError(
                401,
                "invalid or missing API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await error.response()(scope, receive, send)
        if not api:
            return await self.app(scope, receive, send)
        if self.admission.draining:
            error = APIError(503, "the server is shutting down", kind="server_error")
            return await error.response()(scope, receive, send)
        started = ended = False

        async def watched(message: Message) -> None:
            nonlocal started, ended
            started = True
            ended = message["type"] == "http.response.body" and not message.get("more_body")
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, watched))
        self.admission.running.add(task)
        try:
            await task  # cancelling us (uvicorn) cancels it too
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or current.cancelling():
                raise
            # drain() cancelled it: its engine request is aborted; tell the client why
            error = APIError(
                503, "the server shut down before the request finished", kind="server_error"
            )
            if not started:
                await error.response()(scope, receive, send)
            elif not ended:  # only streams send their body in parts
                body = scope.get(_ENDING, error_and_done)(error)
                with anyio.move_on_after(FINAL_EVENT_S) as late:  # a client that stopped reading
                    await send({"type": "http.response.body", "body": body.encode()})
                if late.cancelled_caught and scope.get(_TRANSPORT) is not None:
                    scope[_TRANSPORT].abort()  # else uvicorn waits for it to read, without end
        finally:
            self.admission.running.discard(task)
