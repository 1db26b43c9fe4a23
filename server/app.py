"""OpenAI-style HTTP API over an AsyncEngine: completions, chat, models, health, metrics.

Request bodies are checked against JSON Schemas built once per app
(`request_schemas`), the very ones `GET /openapi.json` publishes, so the document
cannot drift from what is enforced: types, and the ranges known before the prompt
is tokenized (from the engine's own limits and config). What depends on the prompt
(its length against max_seq_len, with max_tokens) is the engine's ValueError, whose
message starts with the offending field, so a 400 can name it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jpaged.engine.engine import AsyncEngine, Engine, QueueFullError
from jpaged.engine.request import RequestOutput
from jpaged.engine.sampling import MAX_N, MAX_TOKENS_LIMIT, NUM_TOP_LOGPROBS, SamplingParams

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]

# Engine statistics that only grow; every other key is a gauge.
COUNTERS = frozenset({
    "preemptions", "tokens_generated", "steps", "requests_finished", "requests_failed",
    "host_s", "device_s", "compilations", "kv_allocations", "kv_frees", "kv_cow_copies",
    "kv_prefix_cache_queries", "kv_prefix_cache_hits", "kv_prefix_cache_evictions",
    "kv_prefix_cache_evicted_blocks",
})  # fmt: skip
# Fields an engine ValueError may start with.
FIELDS = frozenset({"prompt", *(f.name for f in dataclasses.fields(SamplingParams))})
FLOAT32_MAX = 3.4028234663852886e38
_TRANSPORT = "jpaged.transport"  # scope key: the connection's transport, when the server has one


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # for the whole body, so a trickling client cannot hold a slot
    max_stop: int = 16  # stop strings are matched against every new token's text
    # a stream whose client has not taken a chunk for this long (its buffers are full) is
    # cancelled: a client that stops reading must not hold KV blocks for ever
    stream_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.max_body_bytes > 0 and self.body_timeout_s > 0 and self.max_stop >= 0
                and self.stream_timeout_s > 0):  # fmt: skip
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


class _Stalled(Exception):
    """A streaming client stopped reading."""


# ---------------------------------------------------------------------- request schemas


def request_schemas(engine: Engine, limits: Limits) -> dict[str, dict]:
    """JSON Schemas of the request bodies, as `validate` enforces them (null = absent).

    Ranges come from the engine (vocabulary, max_seq_len, max_batch_size, its
    SamplingParams limits) and `limits`; defaults from the checkpoint's
    generation_config.json, as vLLM takes them.
    """
    config = engine.config
    gen = {k: v for k, v in (engine.model.generation_config or {}).items() if v is not None}
    room = min(MAX_TOKENS_LIMIT, config.max_seq_len - 1)  # the prompt takes a token at least
    max_n = min(MAX_N, config.max_batch_size) if engine.cache.supports_fork else 1

    def integer(lo: int, hi: int, **extra: Any) -> dict:
        return {"type": "integer", "minimum": lo, "maximum": hi, **extra}

    def flag(description: str) -> dict:
        return {"type": "boolean", "default": False, "description": description}

    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": integer(0, engine.model_config.vocab_size - 1),
           "minItems": 1, "maxItems": config.max_seq_len - 1}  # fmt: skip
    sampling = {
        "model": {"type": "string", "description": "ignored: the server has one model"},
        # the sampler holds it as a float32 (larger ints would not even convert)
        "temperature": {"type": "number", "minimum": 0, "maximum": FLOAT32_MAX,
                        "default": gen.get("temperature", 1.0), "description": "0 = greedy"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                  "default": gen.get("top_p", 1.0)},
        "top_k": integer(-1, 2**31 - 1, default=gen.get("top_k", 0),  # an int32 on the device
                         description="0 or -1: off"),
        "seed": integer(0, 2**32 - 1, description="default: a fresh one per request"),
        "stop": {"title": f"a non-empty string or an array of at most {limits.max_stop} of them",
                 "anyOf": [text, {"type": "array", "items": text, "maxItems": limits.max_stop}]},
        "ignore_eos": flag("keep generating past end-of-sequence tokens"),
        "n": integer(1, max_n, default=1, description="choices sampled from one prefill"),
        "stream": flag("Server-Sent Events, one chunk per new text"),
        "stream_options": {"type": "object", "properties": {
            "include_usage": flag("a last chunk with the token counts")}},
    }  # fmt: skip
    completion = {
        "prompt": {"title": "a string or an array of token ids", "anyOf": [
            text, ids,  # and OpenAI's batch of prompts, of one prompt here
            {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]},
        "max_tokens": integer(1, room, default=16),
        **sampling,
        "logprobs": integer(0, NUM_TOP_LOGPROBS, description="alternatives per token"),
    }  # fmt: skip
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}  # fmt: skip
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}  # fmt: skip
    chat = {
        "messages": {"title": "a non-empty array of {role, content} objects", "type": "array",
                     "items": message, "minItems": 1},
        "max_tokens": integer(1, room, description="default: the rest of the context"),
        "max_completion_tokens": integer(1, room, description="max_tokens, if that is unset"),
        **sampling,
        "logprobs": flag("logprobs of the chosen tokens"),
        "top_logprobs": integer(0, NUM_TOP_LOGPROBS, default=0,
                                description="alternatives per token, with logprobs"),
    }  # fmt: skip
    ignored = "Other fields are ignored; null is the same as leaving a field out."
    return {
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": completion,
                              "description": ignored},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"],
                                  "properties": chat, "description": ignored},
    }  # fmt: skip


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def fits(value: Any, schema: dict) -> bool:
    """Whether parsed JSON `value` fits `schema` (the JSON Schema keywords used above;
    an object's null fields count as absent)."""
    if "anyOf" in schema:
        return any(fits(value, s) for s in schema["anyOf"])
    if "const" in schema:
        return type(value) is type(schema["const"]) and value == schema["const"]
    kind = schema["type"]
    if not _JSON_TYPES[kind](value):
        return False
    if kind in ("integer", "number"):
        return schema.get("minimum", value) <= value <= schema.get("maximum", value) and (
            "exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"]
        )
    if kind == "string":
        return len(value) >= schema.get("minLength", 0)
    if kind == "array":
        return schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)) and (
            all(fits(v, schema["items"]) for v in value))  # fmt: skip
    if kind == "object":
        given = {k: v for k, v in value.items() if v is not None}
        return all(k in given for k in schema.get("required", ())) and all(
            fits(given[k], s) for k, s in schema.get("properties", {}).items() if k in given
        )
    return True


def describe(schema: dict) -> str:
    """What a value of `schema` must be, in words: "a number in (0, 1]"."""
    if "title" in schema:
        return schema["title"]
    if "anyOf" in schema:
        return " or ".join(map(describe, schema["anyOf"]))
    if "const" in schema:
        return json.dumps(schema["const"])
    kind = schema["type"]
    words = {"integer": "an integer", "number": "a number", "boolean": "a boolean",
             "string": "a non-empty string" if schema.get("minLength") else "a string",
             "array": "an array", "object": "an object"}[kind]  # fmt: skip
    open_ = "(" if "exclusiveMinimum" in schema else "["
    lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
    if lo is not None and hi is not None:
        return f"{words} in {open_}{lo}, {hi}]"
    if lo is not None:
        return f"{words} {'>' if open_ == '(' else '>='} {lo}"
    return words


def validate(body: dict, schema: dict) -> dict[str, Any]:
    """Each field of `schema` from `body`, checked, or its default if null or absent;
    other fields are ignored (as vLLM does). Raises an APIError naming the first misfit."""
    args = {}
    for name, spec in schema["properties"].items():
        value = body.get(name)
        if value is None:
            if name in schema["required"]:
                raise APIError(400, f"{name} is required: {describe(spec)}", name)
            args[name] = spec.get("default")
        elif fits(value, spec):
            args[name] = value
        else:
            raise APIError(400, f"{name} must be {describe(spec)}, got {_brief(value)}", name)
    return args


def _brief(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        return type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def published(schema: dict) -> dict:
    """`schema` as /openapi.json shows it: null is allowed wherever a field may be left out."""
    out = dict(schema)
    if "items" in out:
        out["items"] = published(out["items"])
    if "anyOf" in out:
        out["anyOf"] = [published(s) for s in out["anyOf"]]
    if "properties" in out:
        required = out.get("required", [])
        out["properties"] = {k: published(s) if k in required else _or_null(published(s))
                             for k, s in out["properties"].items()}  # fmt: skip
    return out


def _or_null(schema: dict) -> dict:
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {**schema, "type": [schema["type"], "null"]}


def openapi(schemas: dict[str, dict], secured: bool) -> dict:
    """The OpenAPI 3.1 document of the app: its routes, and its request bodies as validated."""

    def ref(name: str) -> dict:
        return {"schema": {"$ref": f"#/components/schemas/{name}"}}

    error = {"description": "an error", "content": {"application/json": ref("Error")}}
    errors = {code: error for code in ("400", "401", "404", "405", "408", "413", "503")}
    key: dict[str, Any] = {"security": [{"bearer": []}]} if secured else {}

    def post(name: str, summary: str) -> dict:
        ok = {"description": "the completion; with stream: true, Server-Sent Events "
              "(`data: {chunk}` events, then `data: [DONE]`)", "content": {
              "application/json": {"schema": {"type": "object"}},
              "text/event-stream": {"schema": {"type": "string"}}}}  # fmt: skip
        return {"post": {"summary": summary, "responses": {"200": ok, **errors}, **key,
                         "requestBody": {"required": True,
                                         "content": {"application/json": ref(name)}}}}  # fmt: skip

    def get(summary: str, media: str = "application/json", extra: dict | None = None) -> dict:
        body = {"type": "object" if media.endswith("json") else "string"}
        ok = {"description": summary, "content": {media: {"schema": body}}}
        return {"get": {"summary": summary, "responses": {"200": ok, **errors}, **(extra or {})}}

    nullable = {"type": ["string", "null"]}
    fields = {"message": {"type": "string"}, "type": {"type": "string"}, "param": nullable,
              "code": nullable}  # fmt: skip
    error_schema = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": list(fields), "properties": fields}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "jpaged", "version": "1", "description": __doc__.splitlines()[0]},
        "paths": {
            "/v1/completions": post("CompletionRequest", "complete a prompt"),
            "/v1/chat/completions": post("ChatCompletionRequest", "answer a conversation"),
            "/v1/models": get("the served model", extra=key),
            "/health": get("200 while the engine runs, 503 otherwise or while shutting down"),
            "/metrics": get("Prometheus text", "text/plain"),
            "/openapi.json": get("this document"),
        },
        "components": {
            "schemas": {**{k: published(s) for k, s in schemas.items()}, "Error": error_schema},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }  # fmt: skip


@dataclass(frozen=True)
class _Call:
    """A validated request, ready for the engine."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    rename: dict[str, str]  # engine field -> what this request called it


# ---------------------------------------------------------------------------- plumbing


def _engine_error(exc: ValueError, rename: dict[str, str]) -> APIError:
    message = str(exc)
    m = re.match(r"[a-z_]+", message)
    param = m.group() if m and m.group() in FIELDS else None
    return APIError(400, message, rename.get(param, param) if param else None)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{literal[:20]} overflows a double")
    return value


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """Strict JSON: no NaN/Infinity (nor numbers that overflow to it) and no lone
    surrogates (\\ud800-\\udfff escapes, which no tokenizer can encode)."""
    try:
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
        # a surrogate pair decodes to one character; only a lone half survives to here
        if _SURROGATE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "malformed JSON body: a string holds a lone surrogate") from None
    # ValueError covers bad UTF-8 and integers over 4300 digits; RecursionError, deep nesting
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON body: {str(exc)[:200]}") from None
    return body


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
    """SSE that gives up on a client which stops reading: once a chunk has waited
    `timeout_s` for room in the connection's buffers, the request is cancelled."""

    def __init__(self, content: AsyncIterator[str], timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            try:
                with anyio.fail_after(self.timeout_s):
                    await send(message)  # waits while the client's buffers are full
            except TimeoutError:
                raise _Stalled from None

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


class _App(Starlette):
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
        self, app: ASGIApp, admission: Admission, api_keys: list[str], metrics_keys: list[str],
        send_timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        self.app, self.admission, self.send_timeout_s = app, admission, send_timeout_s
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
                with anyio.move_on_after(self.send_timeout_s):  # a client that stopped reading
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
    schemas = request_schemas(engine, limits)
    document = openapi(schemas, secured=bool(api_keys))

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
        body = parse_json(b"".join(chunks))
        if not isinstance(body, dict):
            raise APIError(400, "the JSON body must be an object")
        return body

    def sampling(
        args: dict[str, Any], max_tokens: int, logprobs: int | None, rename: dict[str, str]
    ) -> SamplingParams:
        stop = args["stop"]
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=args["temperature"], top_p=args["top_p"],
                top_k=args["top_k"], seed=args["seed"],
                stop=[stop] if isinstance(stop, str) else stop or [],
                ignore_eos=args["ignore_eos"], logprobs=logprobs, n=args["n"],
            )  # fmt: skip
        except ValueError as exc:  # the schema should have caught it; the engine has the say
            raise _engine_error(exc, rename) from None

    def include_usage(args: dict[str, Any]) -> bool:
        return bool((args["stream_options"] or {}).get("include_usage"))

    def parse_completion(body: dict) -> _Call:
        args = validate(body, schemas["CompletionRequest"])
        prompt = args["prompt"]
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):  # a batch of one
            prompt = prompt[0]
        params = sampling(args, args["max_tokens"], args["logprobs"], {})
        return _Call(prompt, params, args["stream"], include_usage(args), False, {})

    def parse_chat(body: dict) -> _Call:
        args = validate(body, schemas["ChatCompletionRequest"])
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name} has no chat template; use /v1/completions",
                           "messages")  # fmt: skip
        # OpenAI's content parts: only text ones make sense for a text model
        messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                     else "".join(p["text"] for p in m["content"])}
                    for m in args["messages"]]  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        except Exception as exc:  # the template's own raise_exception(): bad roles, order
            raise APIError(400, f"messages: chat template failed: {exc}", "messages") from None
        # the template writes BOS itself; tokenizing with specials would double it
        ids = tokenizer.encode(text, add_special_tokens=False)
        # engine errors name its own fields; point at what this request called them
        rename = {"prompt": "messages", "logprobs": "top_logprobs"}
        # OpenAI chat replaced max_tokens by max_completion_tokens; unset = fill the context
        max_tokens = args["max_tokens"]
        if max_tokens is None and args["max_completion_tokens"] is not None:
            max_tokens = args["max_completion_tokens"]
            rename["max_tokens"] = "max_completion_tokens"
        if max_tokens is None:
            if len(ids) >= max_seq_len:
                raise APIError(400, f"messages: the prompt takes {len(ids)} tokens, "
                               f"max_seq_len is {max_seq_len}", "messages")  # fmt: skip
            max_tokens = max_seq_len - len(ids)
        logprobs = args["top_logprobs"] if args["logprobs"] else None
        params = sampling(args, max_tokens, logprobs, rename)
        return _Call(ids, params, args["stream"], include_usage(args), True, rename)

    def route(parse: Callable[[dict], _Call]) -> Handler:
        async def handler(request: Request) -> Response:
            try:
                return await respond(request, parse(await read_body(request)))
            except APIError as exc:
                return exc.response()
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; nginx's "client closed"

        return handler

    async def respond(request: Request, call: _Call) -> Response:
        if not aengine.alive:  # nothing would ever answer it
            raise APIError(503, "the engine loop is not running", kind="server_error")
        rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        n = call.params.n
        # an async generator: closing it early aborts the request
        outputs = aengine.generate(call.prompt, call.params, rid)
        try:
            first = await _unless_disconnected(request, anext(outputs))
        except ValueError as exc:
            raise _engine_error(exc, call.rename) from None
        except QueueFullError as exc:
            raise APIError(503, str(exc), kind="server_overloaded") from None
        fmt = _Formatter(rid, model_name, call.chat, call.params.logprobs is not None)
        if not call.stream or first.finish_reason == "error":
            try:
                outs = [first]
                if not (first.finished and n == 1) and first.finish_reason != "error":
                    outs += await _unless_disconnected(request, _drain(outputs))
                for out in outs:
                    _raise_if_failed(out)
                return JSONResponse(fmt.full(outs, n))
            finally:
                await outputs.aclose()  # aborts the request unless it finished

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
                        if len(last) == n:
                            if call.include_usage:
                                yield _sse(fmt.usage_chunk(list(last.values())))
                            break
                    out = await anext(outputs)
                yield _sse("[DONE]")
            finally:
                await outputs.aclose()  # aborts the request unless it finished

        return _EventStream(events(), limits.stream_timeout_s)

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
        # what a soak test watches for leaks
        stats["http_requests_in_flight"] = len(admission.running)
        stats["asyncio_tasks"] = len(asyncio.all_tasks())
        stats["python_threads"] = threading.active_count()
        return PlainTextResponse(prometheus(stats), media_type="text/plain; version=0.0.4")

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(document)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own 404 / 405, in the same shape as every other error
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, exc.detail, headers=dict(exc.headers or {})).response()

    async def server_error(request: Request, exc: Exception) -> Response:
        return APIError(500, "internal server error", kind="server_error").response()

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
                      metrics_keys=metrics_keys or [],
                      send_timeout_s=limits.stream_timeout_s)  # fmt: skip
    app = _App(
        middleware=[gate],
        routes=[
            Route("/v1/completions", route(parse_completion), methods=["POST"]),
            Route("/v1/chat/completions", route(parse_chat), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.admission = admission
    # what each /v1 route makes of a parsed body (for tests: which fields it reads)
    app.state.parsers = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
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

    def __init__(self, rid: str, model: str, chat: bool, logprobs: bool) -> None:
        self.rid, self.model, self.chat, self.logprobs = rid, model, chat, logprobs
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
            assert out.tokens is not None  # the request asked for logprobs
            result.extend(zip(out.tokens, out.logprobs, tops, strict=True))
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
