"""OpenAI-style HTTP API over an AsyncEngine: completions, chat, models, health, metrics.

The server only checks JSON types and what costs it before the engine sees a
request (body size, how long the body takes, stop lists); other ranges and limits
are the engine's ValueErrors, whose messages start with the offending field, so
a 400 can name it without duplicating the checks here.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jpaged.engine.engine import AsyncEngine, QueueFullError
from jpaged.engine.request import RequestOutput
from jpaged.engine.sampling import SamplingParams

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]

# Engine statistics that only grow; every other key is a gauge.
COUNTERS = frozenset({
    "preemptions", "tokens_generated", "steps", "requests_finished", "requests_failed",
    "host_s", "device_s", "compilations", "kv_allocations", "kv_frees", "kv_cow_copies",
    "kv_prefix_cache_queries", "kv_prefix_cache_hits", "kv_prefix_cache_evictions",
    "kv_prefix_cache_evicted_blocks",
})  # fmt: skip
# Request fields an engine ValueError may start with.
FIELDS = frozenset({"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                    "ignore_eos", "logprobs", "n"})  # fmt: skip


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # for the whole body, so a trickling client cannot hold a slot
    max_stop: int = 16  # stop strings are matched against every new token's text

    def __post_init__(self) -> None:
        if not (self.max_body_bytes > 0 and self.body_timeout_s > 0 and self.max_stop >= 0):
            raise ValueError(f"limits must be positive (max_stop may be 0), got {self}")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None,
        kind: str = "invalid_request_error", code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param,
                 "code": self.code}  # fmt: skip
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


_CHECKS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
    dict: ("an object", lambda v: isinstance(v, dict)),
    list: ("an array", lambda v: isinstance(v, list)),
}


def _get(body: dict, name: str, kind: type[T], default: Any = None) -> Any:
    """`body[name]` checked to be JSON of `kind`; null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    want, ok = _CHECKS[kind]
    if not ok(value):
        raise APIError(400, f"{name} must be {want}, got {json.dumps(value)[:80]}", name)
    return value


def _engine_error(exc: ValueError, rename: dict[str, str]) -> APIError:
    message = str(exc)
    m = re.match(r"[a-z_]+", message)
    param = m.group() if m and m.group() in FIELDS else None
    return APIError(400, message, rename.get(param, param) if param else None)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


class _EventStream(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette cancels the sender when the client leaves; if that lands while
            # the generator is parked at a yield, only this close reaches the engine
            # (else the abort waits for garbage collection).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _authorized(scope: Scope, keys: list[bytes]) -> bool:
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, given = header.partition(b" ")
    # every key is compared, in constant time: neither timing nor which key tells anything
    matches = [hmac.compare_digest(given.strip(), key) for key in keys]
    return scheme.lower() == b"bearer" and any(matches)


class Admission:
    """Which `/v1/*` requests run, and whether new ones are still let in."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine
        self.draining = False
        self.running: set[asyncio.Task] = set()

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting, let running requests finish within `timeout_s`, cancel the
        rest, and return once the engine has freed their blocks."""
        self.draining = True
        if self.running:
            _, late = await asyncio.wait(set(self.running), timeout=timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        # aborts free blocks at the engine's next step; stopping its loop first would not
        while self.aengine.alive and self.aengine.engine.has_unfinished():
            await asyncio.sleep(0.01)


class Gate:
    """ASGI middleware: API keys, and admission for a graceful shutdown.

    `/v1/*` requests run in tasks of their own, so `Admission.drain` can cancel
    one that outlives the grace period and still end its response properly.
    """

    def __init__(
        self, app: ASGIApp, admission: Admission, api_keys: list[str], metrics_keys: list[str]
    ) -> None:
        self.app, self.admission = app, admission
        self.api_keys = [k.encode() for k in api_keys]
        self.metrics_keys = [k.encode() for k in metrics_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        api = scope["type"] == "http" and path.startswith("/v1/")
        keys = self.api_keys if api else self.metrics_keys if path == "/metrics" else []
        if keys and not _authorized(scope, keys):
            error = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                             code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
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
            error = APIError(503, "the server shut down before the request finished",
                             kind="server_error")  # fmt: skip
            if not started:
                await error.response()(scope, receive, send)
            elif not ended:  # only streams send their body in parts
                body = _sse({"error": {"message": error.message, "type": error.kind}})
                await send({"type": "http.response.body", "body": body.encode()})
        finally:
            self.admission.running.discard(task)


def build_app(
    aengine: AsyncEngine, model_name: str, *, api_keys: list[str] | None = None,
    metrics_keys: list[str] | None = None, limits: Limits = Limits(),
) -> Starlette:  # fmt: skip
    """The app; `await app.state.admission.drain(timeout_s)` shuts it down gracefully."""
    engine = aengine.engine
    tokenizer = engine.tokenizer
    max_seq_len = engine.config.max_seq_len
    created = int(time.time())
    # Like vLLM, the checkpoint's generation_config.json supplies the sampling defaults.
    gen = engine.model.generation_config or {}
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}

    def api(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return exc.response()
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; nginx's "client closed"

        return wrapped

    async def read_body(request: Request) -> dict:
        too_big = APIError(413, f"the request body exceeds {limits.max_body_bytes} bytes",
                           headers={"Connection": "close"})  # fmt: skip
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limits.max_body_bytes:  # chunked, or lying about its length
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body took over {limits.body_timeout_s:g} s",
                           headers={"Connection": "close"}) from None  # fmt: skip
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the JSON body must be an object")
        _get(body, "model", str)
        return body

    def sampling(
        body: dict, rename: dict[str, str], *, chat: bool, prompt_len: int = 0
    ) -> SamplingParams:
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(400, "stop must be a string or an array of strings", "stop")
        if len(stop) > limits.max_stop:
            raise APIError(400, f"stop: {len(stop)} sequences, at most {limits.max_stop} "
                           "are allowed", "stop")  # fmt: skip
        if chat:
            logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool) else None
            # OpenAI chat replaced max_tokens by max_completion_tokens; unset = fill the context
            max_tokens = _get(body, "max_completion_tokens", int)
            max_tokens = _get(body, "max_tokens", int, max_tokens)
            if max_tokens is None:
                if prompt_len >= max_seq_len:
                    raise APIError(400, f"messages: the prompt takes {prompt_len} tokens, "
                                   f"max_seq_len is {max_seq_len}", "messages")  # fmt: skip
                max_tokens = max_seq_len - prompt_len
        else:
            logprobs = _get(body, "logprobs", int)
            max_tokens = _get(body, "max_tokens", int, 16)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_get(body, "temperature", float, defaults.get("temperature", 1.0)),
                top_p=_get(body, "top_p", float, defaults.get("top_p", 1.0)),
                top_k=_get(body, "top_k", int, defaults.get("top_k", 0)),
                seed=_get(body, "seed", int),
                stop=stop,
                ignore_eos=_get(body, "ignore_eos", bool, False),
                logprobs=logprobs,
                n=_get(body, "n", int, 1),
            )
        except ValueError as exc:
            raise _engine_error(exc, rename) from None

    async def completions(request: Request) -> Response:
        body = await read_body(request)
        prompt: Any = body.get("prompt")
        # OpenAI also takes a batch of prompts; one is all we answer per request
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        is_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if not (isinstance(prompt, str) or is_ids):
            raise APIError(400, "prompt must be a string or an array of token ids", "prompt")
        params = sampling(body, {}, chat=False)
        return await respond(request, body, prompt, params, {}, chat=False)

    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise APIError(400, "messages must be a non-empty array of {role, content} objects",
                           "messages")  # fmt: skip
        messages = [{**m, "content": _content(m.get("content"))} for m in messages]
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name} has no chat template; use /v1/completions",
                           "messages")  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        except Exception as exc:  # the template's own raise_exception(): bad roles, order
            raise APIError(400, f"messages: chat template failed: {exc}", "messages") from None
        # the template writes BOS itself; tokenizing with specials would double it
        ids = tokenizer.encode(text, add_special_tokens=False)
        # engine errors name its own fields; point at what this request called them
        rename = {"prompt": "messages", "logprobs": "top_logprobs"}
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            rename["max_tokens"] = "max_completion_tokens"
        params = sampling(body, rename, chat=True, prompt_len=len(ids))
        return await respond(request, body, ids, params, rename, chat=True)

    def _content(content: Any) -> str:
        if isinstance(content, str):
            return content
        # OpenAI's content parts: only text ones make sense for a text model
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            return "".join(p["text"] for p in content)
        raise APIError(400, "messages[].content must be a string or an array of text parts",
                       "messages")  # fmt: skip

    async def respond(
        request: Request, body: dict, prompt: str | list[int], params: SamplingParams,
        rename: dict[str, str], *, chat: bool,
    ) -> Response:  # fmt: skip
        stream = _get(body, "stream", bool, False)
        include_usage = _get(_get(body, "stream_options", dict, {}), "include_usage", bool, False)
        if not aengine.alive:  # nothing would ever answer it
            raise APIError(503, "the engine loop is not running", kind="server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # an async generator: closing it early aborts the request
        outputs = aengine.generate(prompt, params, rid)
        try:
            first = await _unless_disconnected(request, anext(outputs))
        except ValueError as exc:
            raise _engine_error(exc, rename) from None
        except QueueFullError as exc:
            raise APIError(503, str(exc), kind="server_overloaded") from None
        _raise_if_failed(first)
        fmt = _Formatter(rid, model_name, chat, params.logprobs is not None, tokenizer)
        if not stream:
            outs = [first]
            if not (first.finished and params.n == 1):
                outs += await _unless_disconnected(request, _drain(outputs))
            for out in outs:
                _raise_if_failed(out)
            return JSONResponse(fmt.full(outs, params.n))

        async def events() -> AsyncIterator[str]:
            # n > 1: the choices' chunks interleave, each with its index
            last: dict[int, RequestOutput] = {}
            try:
                out = first
                while True:
                    if out.finish_reason == "error":
                        yield _sse({"error": {"message": out.error, "type": "server_error"}})
                        break
                    if out.text or out.token_ids or out.finished:
                        yield _sse(fmt.chunk(out))
                    if out.finished:
                        last[out.index] = out
                        if len(last) == params.n:
                            if include_usage:
                                yield _sse(fmt.usage_chunk(list(last.values())))
                            break
                    out = await anext(outputs)
                yield _sse("[DONE]")
            finally:
                await outputs.aclose()  # aborts the request unless it finished

        return _EventStream(events(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def models(request: Request) -> Response:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "jpaged",
                "max_model_len": max_seq_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        status = "ok" if aengine.alive else "engine stopped"
        status = "shutting down" if admission.draining else status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        # stats() waits for the engine lock, held through a whole step: not on the event loop
        stats = await run_in_threadpool(aengine.stats)
        stats["http_requests_in_flight"] = len(admission.running)
        return PlainTextResponse(prometheus(stats), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned = not aengine.alive  # stop only a loop this app started
        if owned:
            aengine.start()
        try:
            yield
        finally:
            if owned:
                await run_in_threadpool(aengine.stop)

    admission = Admission(aengine)
    gate = Middleware(Gate, admission=admission, api_keys=api_keys or [],
                      metrics_keys=metrics_keys or [])  # fmt: skip
    app = Starlette(
        middleware=[gate],
        routes=[
            Route("/v1/completions", api(completions), methods=["POST"]),
            Route("/v1/chat/completions", api(chat_completions), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.admission = admission
    return app


async def _drain(outputs: AsyncGenerator[RequestOutput, None]) -> list[RequestOutput]:
    return [out async for out in outputs]


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason != "error":
        return
    raise APIError(500, out.error or "request failed", kind="server_error")


def prometheus(stats: dict[str, float]) -> str:
    lines = []
    for key, value in sorted(stats.items()):
        name = "jpaged_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        lines += [f"# TYPE {name} {'counter' if key in COUNTERS else 'gauge'}",
                  f"{name} {float(value)!r}"]  # fmt: skip
    return "\n".join(lines) + "\n"


class _Formatter:
    """RequestOutputs -> OpenAI `text_completion` / `chat.completion` JSON (and chunks)."""

    def __init__(
        self, rid: str, model: str, chat: bool, logprobs: bool, tokenizer: Any
    ) -> None:
        self.rid, self.model, self.chat, self.logprobs = rid, model, chat, logprobs
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # by choice: characters sent (text_offset)
        self.role_sent: set[int] = set()  # choices whose first chat delta went out

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    @staticmethod
    def _usage(lasts: list[RequestOutput]) -> dict:
        """Token counts over every choice's last output."""
        prompt, completion = lasts[0].prompt_tokens, sum(o.completion_tokens for o in lasts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    def _tokens(self, outs: list[RequestOutput]) -> list[tuple[str, float, dict | None]]:
        result: list[tuple[str, float, dict | None]] = []
        for out in outs:
            tops: list[Any] = out.top_logprobs or [None] * len(out.token_ids)
            for tid, lp, top in zip(out.token_ids, out.logprobs, tops, strict=True):
                result.append((self.tokenizer.decode([tid]), lp, top))
        return result

    def _logprobs(self, outs: list[RequestOutput]) -> dict | None:
        if not self.logprobs:
            return None
        tokens = self._tokens(outs)
        if self.chat:
            def entry(tok: str, lp: float) -> dict:
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            return {"content": [
                {**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in (top or {}).items()]}
                for tok, lp, top in tokens
            ]}  # fmt: skip
        index = outs[0].index if outs else 0
        offsets = list(itertools.accumulate((len(t) for t, _, _ in tokens),
                                            initial=self.offsets.get(index, 0)))  # fmt: skip
        self.offsets[index] = offsets.pop()
        return {
            "tokens": [tok for tok, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            # like vLLM: the chosen token is always among its alternatives
            "top_logprobs": [{**(top or {}), tok: lp} for tok, lp, top in tokens],
            "text_offset": offsets,
        }

    def full(self, outs: list[RequestOutput], n: int = 1) -> dict:
        choices, lasts = [], []
        for index in range(n):
            mine = [o for o in outs if o.index == index]
            text = "".join(o.text for o in mine)
            lasts.append(mine[-1])
            choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs(mine),
                                      "finish_reason": mine[-1].finish_reason}  # fmt: skip
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": self._usage(lasts)}

    def chunk(self, out: RequestOutput) -> dict:
        reason = out.finish_reason if out.finished else None
        choice: dict[str, Any] = {"index": out.index, "logprobs": self._logprobs([out]),
                                  "finish_reason": reason}  # fmt: skip
        if self.chat:
            delta = {"content": out.text}
            if out.index not in self.role_sent:
                delta = {"role": "assistant", **delta}
                self.role_sent.add(out.index)
            choice["delta"] = delta
        else:
            choice["text"] = out.text
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, lasts: list[RequestOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": self._usage(lasts)}
