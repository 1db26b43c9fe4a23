"""LoRA adapters over HTTP, as vLLM serves them: `--enable-lora --lora-modules name=path`,
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (vLLM's bodies and answers),
each adapter a model id in `/v1/models`, chosen by a request's `model` (completions, chat,
responses, tokenize; embeddings refuse one with a 400: their call runs the base model).

The runtime endpoints make the server read a path a client names: they are off unless
`--allow-runtime-lora` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and with `--lora-root DIR`
they read only inside DIR (symbolic links resolved).

Choices where vLLM leaves room: loading a name that is loaded already is a 400 (vLLM's);
unloading an adapter that requests hold, waiting ones included, is a 409 naming how many
(never pulled from under them).
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jpaged.engine.interface import EngineInterface
from jpaged.engine.lora import AdapterInUse, LoRARequest
from server.errors import APIError, answers_errors
from server.parse import read_body
from server.protocol import Limits


def add_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("LoRA adapters")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories served from the start, each as model id NAME",
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapters resident at once")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters kept in host memory (least recently used dropped, read again when "
        "named); default: --max-loras",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which read any "
        "path a client names (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: the adapters of "
        "--lora-modules only",
    )
    p.add_argument(
        "--lora-root",
        metavar="DIR",
        help="/v1/load_lora_adapter reads adapters inside DIR only",
    )


def spec(args: argparse.Namespace) -> dict | None:
    """`EngineConfig.lora` from the flags (None without --enable-lora)."""
    if args.lora_root is not None and not args.allow_runtime_lora:
        raise ValueError("--lora-root needs --allow-runtime-lora")
    if not args.enable_lora:
        for flag in ("lora_modules", "allow_runtime_lora"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
        return None
    return {
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def modules(flags: list[str]) -> list[LoRARequest]:
    """`--lora-modules name=path ...` as requests, ids 1, 2, ..."""
    out = []
    for i, flag in enumerate(flags, 1):
        name, eq, path = flag.partition("=")
        if not (eq and name and path):
            raise ValueError(f"--lora-modules: {flag!r} is not NAME=PATH")
        out.append(LoRARequest(name, i, path))
    return out


def adapter_of(engine: EngineInterface, body: dict, model_name: str) -> tuple[dict, str | None]:
    """The body with a `model` naming an adapter replaced by the base model's id, and that
    adapter's name (None when it names none)."""
    name = body.get("model")
    if isinstance(name, str) and name in engine.loras():
        return {**body, "model": model_name}, name
    return body, None


def routes(
    engine: EngineInterface,
    taken: Callable[[], list[str]],
    allow: bool,
    root: str | None,
    limits: Limits,
) -> list[Route]:
    """The load/unload endpoints; `taken`: the ids the server answers to already; `allow`:
    whether they serve (else each is a 404 that names the flag); `root`: the directory
    loads read inside (None: anywhere); `limits`: their bodies', as every route's."""
    ids = itertools.count(len(engine.loras()) + 1)
    inside = None if root is None else os.path.realpath(root)

    def check_path(path: str) -> None:
        if inside is None:
            return
        real = os.path.realpath(path)  # (a link out of the root leads out of it)
        if os.path.commonpath([real, inside]) != inside:
            raise APIError(400, f"lora_path must be inside --lora-root {root}", "lora_path")

    async def fields(request: Request, *names: str) -> list[str]:
        body = await read_body(request, limits)
        for name in names:
            if not isinstance(body.get(name), str) or not body[name]:
                raise APIError(400, f"{name} must be a non-empty string", name)
        return [body[n] for n in names]

    @answers_errors
    async def load(request: Request) -> Response:
        name, path = await fields(request, "lora_name", "lora_path")
        if name in engine.loras() or name in taken():
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        check_path(path)
        try:
            await run_in_threadpool(engine.register_lora, LoRARequest(name, next(ids), path))
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @answers_errors
    async def unload(request: Request) -> Response:
        (name,) = await fields(request, "lora_name")
        try:
            await run_in_threadpool(engine.unregister_lora, name)
        except AdapterInUse as exc:
            raise APIError(
                409,
                f"The lora adapter '{name}' is in use by {exc.requests} request"
                f"{'' if exc.requests == 1 else 's'}; unload it once they finish.",
                "lora_name",
            ) from None
        except KeyError:
            raise APIError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                "lora_name",
                code="model_not_found",
            ) from None
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def off(request: Request) -> Response:
        return APIError(
            404,
            "loading and unloading LoRA adapters at run time is off: start the server with "
            "--allow-runtime-lora",
        ).response()

    return [
        Route("/v1/load_lora_adapter", load if allow else off, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload if allow else off, methods=["POST"]),
    ]
