"""OpenAI-style HTTP API over an AsyncEngine: completions, chat, responses, embeddings,
tokenize, models, health, metrics.

This module wires the app: its routes, the engine loop's lifespan and the metrics.
The other jobs have modules of their own:

- `server.protocol`: the limits, the request bodies' models;
- `server.openapi`: /openapi.json, from those models;
- `server.parse`: a request body -> the prompt and SamplingParams the engine runs;
- `server.errors`: errors in OpenAI's shape (`answers_errors` answers a route's), and
  the engine's ValueError as a 400;
- `server.format`: engine outputs -> OpenAI's JSON and Server-Sent Events;
- `server.asgi`: the stalled-stream timeout, the disconnect watch, and the gate
  (API keys, admission, graceful drain).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.distributed import CHANNEL_COUNTERS
from jpaged.engine.engine import COUNTERS
from jpaged.engine.lora import LORA_COUNTERS
from jpaged.engine.output import RequestOutput
from jpaged.engine.router import ROUTER_COUNTERS
from server import embeddings, lora, responses, tokens
from server.asgi import Admission, App, EventStream, Gate, unless_disconnected
from server.errors import APIError, Handler, answers_errors
from server.format import Formatter, sse
from server.openapi import openapi
from server.outputs import engine_outputs, gather
from server.parse import Call, Options, Parser, read_body
from server.protocol import Limits, request_models

__all__ = ["APIError", "Admission", "Gate", "Limits", "build_app", "prometheus"]

_DEFAULT_LIMITS = Limits()
_DEFAULT_OPTIONS = Options()


def build_app(
    aengine: AsyncEngine,
    model_name: str,
    *,
    aliases: Sequence[str] = (),
    api_keys: list[str] | None = None,
    metrics_keys: list[str] | None = None,
    limits: Limits = _DEFAULT_LIMITS,
    options: Options = _DEFAULT_OPTIONS,
    allow_runtime_lora: bool = False,
    lora_root: str | None = None,
) -> Starlette:
    """The app; `await app.state.admission.drain(timeout_s)` shuts it down gracefully.
    Requests may name the model `model_name` or any of its `aliases`; answers name it
    `model_name`. `options`: chat templates, tool and reasoning parsers, scheduling.
    `allow_runtime_lora`: serve the LoRA load/unload endpoints (reading paths inside
    `lora_root` only, when given)."""
    engine = aengine.engine
    config = engine.config
    max_seq_len = config.max_seq_len
    created = int(time.time())
    names = list(dict.fromkeys([model_name, *aliases]))
    requests = request_models(engine, limits, names, options.priorities)
    document = openapi(requests, secured=bool(api_keys))
    parser = Parser(engine, names, requests, options)
    admission = Admission(aengine)

    def route(parse: Callable[[dict], Call]) -> Handler:
        @answers_errors
        async def handler(request: Request) -> Response:
            body, adapter = lora.adapter_of(engine, await read_body(request, limits), model_name)
            # templating and tokenizing (a 4 MiB prompt, a template that loops) would
            # stall every stream on the event loop
            call = dataclasses.replace(await run_in_threadpool(parse, body), lora=adapter)
            return await respond(aengine, adapter or model_name, limits, request, call)

        return handler

    @answers_errors
    async def respond_api(request: Request) -> Response:
        body, adapter = lora.adapter_of(engine, await read_body(request, limits), model_name)
        call, shown = await run_in_threadpool(responses.parse, parser, body)
        call = dataclasses.replace(call, lora=adapter)
        if not aengine.alive:
            raise APIError(503, "the engine loop is not running", kind="server_error")
        outputs = engine_outputs(aengine, call, f"resp-{uuid.uuid4().hex}")
        name = adapter or model_name
        return await responses.respond(request, outputs, call, shown, name, limits)

    @answers_errors
    async def embed(request: Request) -> Response:
        body = await read_body(request, limits)
        if lora.adapter_of(engine, body, model_name)[1] is not None:
            # the embedding call runs the base model's layers only (Runner.hidden)
            raise APIError(
                400,
                f"LoRA adapters are not supported on /v1/embeddings: name the base "
                f"model `{model_name}`",
                "model",
            )
        if not aengine.alive:
            raise APIError(503, "the engine loop is not running", kind="server_error")
        work = embeddings.embed(parser, aengine, body, model_name, options)
        return JSONResponse(await unless_disconnected(request, work))

    def answer(handle: Callable[[Parser, dict], dict]) -> Handler:
        @answers_errors
        async def handler(request: Request) -> Response:
            # an adapter shares the base model's tokenizer
            body = lora.adapter_of(engine, await read_body(request, limits), model_name)[0]
            return JSONResponse(await run_in_threadpool(handle, parser, body))

        return handler

    def card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "jpaged",
            "root": model_name,
            "max_model_len": max_seq_len,
        }

    def cards() -> dict[str, dict]:
        out = {name: card(name) for name in names}
        for name, adapter in engine.loras().items():  # vLLM's: the adapter's path as its root
            out[name] = {**card(name), "root": adapter.lora_path, "parent": model_name}
        return out

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": list(cards().values())})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        found = cards().get(name)
        if found is None:
            return APIError(
                404, f"the model `{name[:100]}` does not exist", "model", code="model_not_found"
            ).response()
        return JSONResponse(found)

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
        threads = threading.enumerate()
        stats["python_threads"] = len(threads)
        # anyio's pool (run_in_threadpool) keeps as many workers as were once busy at a time,
        # up to its limiter's 40; a leak is growth outside it
        stats["python_pool_threads"] = sum(t.name == "AnyIO worker thread" for t in threads)
        info = (
            f'# TYPE jpaged_kv_cache_info gauge\njpaged_kv_cache_info{{dtype="{config.dtype}",'
            f'kv_cache_dtype="{config.kv_cache_dtype}"}} 1.0\n'
        )
        return PlainTextResponse(prometheus(stats) + info, media_type="text/plain; version=0.0.4")

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(document)

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

    gate = Middleware(
        Gate, admission=admission, api_keys=api_keys or [], metrics_keys=metrics_keys or []
    )
    app = App(
        middleware=[gate],
        routes=[
            Route("/v1/completions", route(parser.completion), methods=["POST"]),
            Route("/v1/chat/completions", route(parser.chat), methods=["POST"]),
            Route("/v1/responses", respond_api, methods=["POST"]),
            Route("/v1/embeddings", embed, methods=["POST"]),
            Route("/tokenize", answer(tokens.tokenize), methods=["POST"]),
            Route("/detokenize", answer(tokens.detokenize), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),  # ids may hold a "/"
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
            *(
                lora.routes(engine, lambda: names, allow_runtime_lora, lora_root, limits)
                if config.lora is not None
                else []
            ),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.admission = admission
    # what each /v1 route makes of a parsed body (for tests: which fields it reads)
    app.state.parsers = {"/v1/completions": parser.completion, "/v1/chat/completions": parser.chat}
    return app


async def respond(
    aengine: AsyncEngine, model_name: str, limits: Limits, request: Request, call: Call
) -> Response:
    """Run `call` on the engine: its JSON answer, or its stream of events."""
    if not aengine.alive:  # nothing would ever answer it
        raise APIError(503, "the engine loop is not running", kind="server_error")
    rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = engine_outputs(aengine, call, rid)
    # a refusal comes as its prompt is submitted, before any output: the first answers it
    first = await unless_disconnected(request, anext(outputs))
    fmt = Formatter(
        rid,
        model_name,
        call.chat,
        call.params.logprobs is not None,
        call.params.n,
        call.echo,
        call.parsing,
    )
    choices = len(call.prompts) * call.params.n
    if not call.stream or first.finish_reason == "error":
        return JSONResponse(fmt.full(await gather(request, first, outputs), choices))

    async def events() -> AsyncGenerator[str, None]:
        # several choices: their chunks interleave, each with its index
        last: dict[int, RequestOutput] = {}
        try:
            out: RequestOutput | None = first
            while out is not None and out.finish_reason != "error":
                if out.text or out.token_ids or out.finished:
                    chunk = fmt.chunk(out)
                    if chunk is not None:
                        yield sse(chunk)
                if out.finished:
                    last[out.index] = out
                out = await anext(outputs, None)
            if out is not None:
                raise APIError(500, out.error or "request failed", kind="server_error")
            if call.include_usage:
                yield sse(fmt.usage_chunk(list(last.values())))
            yield sse("[DONE]")
        finally:
            await outputs.aclose()  # aborts every request that has not finished

    return EventStream(events(), limits.stream_timeout_s)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own 404 / 405, in the same shape as every other error
    assert isinstance(exc, HTTPException)
    return APIError(exc.status_code, exc.detail, headers=dict(exc.headers or {})).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    return APIError(500, "internal server error", kind="server_error").response()


def prometheus(stats: dict[str, float]) -> str:
    """Prometheus text; a key may end in labels (`running{replica="0"}`, data parallelism),
    which then follow its metric's name."""
    lines, typed = [], set()
    counters = {*COUNTERS, *ROUTER_COUNTERS, *CHANNEL_COUNTERS, *LORA_COUNTERS}
    for key, value in sorted(stats.items(), key=lambda kv: (kv[0].partition("{")[0], kv[0])):
        base, brace, labels = key.partition("{")
        name = "jpaged_" + re.sub(r"[^a-zA-Z0-9_]", "_", base)
        if name not in typed:
            typed.add(name)
            lines.append(f"# TYPE {name} {'counter' if base in counters else 'gauge'}")
        lines.append(f"{name}{brace}{labels} {float(value)!r}")
    return "\n".join(lines) + "\n"
