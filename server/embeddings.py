"""`POST /v1/embeddings`: the served model's final hidden states, pooled (`--pooling`: the
last token's, or the mean of every token's) and L2-normalized, for strings or token lists,
one or a batch; `encoding_format` float or base64 (little-endian float32, as OpenAI's).

A generative model's hidden states are not a trained embedding model's: they serve
retrieval experiments and clients that need the route, at the model's own width
(`dimensions` other than that is refused)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.intake import QueueFullError
from jpaged.engine.interface import PromptRequest
from jpaged.engine.output import RequestOutput
from jpaged.engine.sampling import SamplingParams
from server.errors import APIError, engine_error
from server.outputs import raise_if_failed
from server.parse import Options, Parser


def _inputs(parser: Parser, body: dict, width: int) -> tuple[dict[str, Any], list[str | list[int]]]:
    """The request's checked fields, and its inputs (text, which the engine tokenizes, or
    token ids)."""
    args = parser.check(body, "EmbeddingRequest")
    if args["dimensions"] not in (None, width):
        raise APIError(
            400, f"dimensions: this model's embeddings have {width}, no other", "dimensions"
        )
    given = args["input"]
    batch = isinstance(given, list) and isinstance(given[0], str | list)
    inputs = given if batch else [given]
    return args, list(inputs)


async def embed(
    parser: Parser, aengine: AsyncEngine, body: dict, model: str, options: Options
) -> dict[str, Any]:
    """The embeddings answer of `body`: each input an engine request of its own (queued,
    scheduled and batched with generation, its blocks freed once its prompt is through)."""
    width = aengine.engine.model_config.hidden_size
    # validating a 4 MiB input on the event loop would stall every stream
    args, prompts = await run_in_threadpool(_inputs, parser, body, width)
    rid = f"embd-{uuid.uuid4().hex}"

    async def one(i: int, prompt: str | list[int]) -> RequestOutput:
        try:
            asked = PromptRequest(
                prompt,
                SamplingParams(max_tokens=1),
                f"{rid}-{i}",
                timeout_s=options.request_timeout_s,
                pooling=options.pooling,
            )
            stream = aengine.generate(asked)
            outs = [out async for out in stream]
        except QueueFullError as exc:
            raise APIError(503, str(exc), kind="server_overloaded") from None
        except ValueError as exc:
            raise engine_error(exc, {"prompt": "input", "max_tokens": "input"}, i) from None
        raise_if_failed(outs[-1])
        return outs[-1]

    try:
        async with asyncio.TaskGroup() as group:  # one failing cancels (aborts) the others
            tasks = [group.create_task(one(i, p)) for i, p in enumerate(prompts)]
    except* APIError as errors:
        raise errors.exceptions[0] from None
    data = []
    for i, task in enumerate(tasks):
        v32 = np.asarray(task.result().embedding, np.float32)
        value: Any = (
            base64.b64encode(v32.astype("<f4").tobytes()).decode()
            if args["encoding_format"] == "base64"
            else v32.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(task.result().prompt_tokens for task in tasks)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
