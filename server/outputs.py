"""A Call on the engine: the outputs of its prompts as they come, numbered as its
answer's choices, and what a finished output says about the answer."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from starlette.requests import Request

from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.intake import QueueFullError
from jpaged.engine.output import RequestOutput
from server.asgi import unless_disconnected
from server.errors import APIError, engine_error
from server.parse import Call


async def engine_outputs(
    aengine: AsyncEngine, call: Call, rid: str
) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of every prompt of `call` (each its own engine request, so they batch
    with everything else) as they come, numbered as the answer's choices. Raises the
    engine's refusal of any prompt as an APIError; closing it aborts every request."""
    batch, n = len(call.prompts) > 1, call.params.n
    if not batch:  # one engine stream, read here: no task and queue between (a token each)
        outs = aengine.generate(call.request(0, rid))
        try:
            async for output in outs:
                yield _as_asked(output, output.index, call.prompt_only)
        except (ValueError, QueueFullError) as exc:
            raise _refusal(exc, call, None) from exc
        finally:
            await outs.aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            outs = aengine.generate(call.request(i, f"{rid}-{i}"))
            async for out in outs:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # the engine refused the prompt
            queue.put_nowait((i, exc))

    # cancelling a pump closes its engine stream, which aborts its request
    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(call.prompts))]
    try:
        left = len(pumps)
        while left:
            i, out = await queue.get()
            if out is None:  # that prompt's request finished
                left -= 1
            elif isinstance(out, RequestOutput):
                yield _as_asked(out, i * n + out.index, call.prompt_only)
            elif isinstance(out, ValueError | QueueFullError):
                raise _refusal(out, call, i)
            else:
                raise out
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _refusal(exc: ValueError | QueueFullError, call: Call, prompt: int | None) -> APIError:
    """The engine's refusal of prompt `prompt` (None: the only one) as the API words it."""
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), kind="server_overloaded")
    return engine_error(exc, call.rename, prompt)  # its checks of the prompt and params


def _as_asked(out: RequestOutput, index: int, prompt_only: bool) -> RequestOutput:
    """`out` as the answer's choice `index`; with `prompt_only` (echo and max_tokens 0),
    without the token the engine generated (it generates one at least)."""
    if not prompt_only or out.finish_reason == "error":
        return out if out.index == index else dataclasses.replace(out, index=index)
    return dataclasses.replace(
        out,
        index=index,
        text="",
        token_ids=[],
        logprobs=[],
        completion_tokens=0,
        top_logprobs=out.top_logprobs and [],
        tokens=out.tokens and [],
        finish_reason="length" if out.finished else None,
    )


async def gather(
    request: Request, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
) -> list[RequestOutput]:
    """Every output of a call answered at once (`first` and the rest of `outputs`), or the
    APIError of a failed one; closing `outputs` aborts every request that has not finished."""
    try:
        outs = [first]
        if first.finish_reason != "error":
            outs += await unless_disconnected(request, _drain(outputs))
        for out in outs:
            raise_if_failed(out)
        return outs
    finally:
        await outputs.aclose()


async def _drain(outputs: AsyncGenerator[RequestOutput, None]) -> list[RequestOutput]:
    return [out async for out in outputs]


def raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "abort":  # nothing else aborts a request someone still reads
        raise APIError(408, "the request passed its deadline (timeout)", "timeout")
    if out.finish_reason == "error":
        raise APIError(500, out.error or "request failed", kind="server_error")
