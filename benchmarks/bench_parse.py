"""The cost of validating one request body, as `server.protocol` checks it, in µs per
parse: a chat of 200 messages (tool calls and their results among them) with 8 tools, and
one of a single message.

    PYTHONPATH=. python benchmarks/bench_parse.py [--number 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import timeit
from types import SimpleNamespace
from typing import Any

# the engine's fields the models' ranges come from (test_server.py's tiny engine)
ENGINE: Any = SimpleNamespace(
    config=SimpleNamespace(max_seq_len=4096, max_batch_size=16),
    model_config=SimpleNamespace(vocab_size=32000),
    model=SimpleNamespace(generation_config={"temperature": 0.6}),
)


def chat_body(turns: int = 200, tools: int = 8) -> dict:
    params = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    }
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns - 1):
        if i % 4 == 0:
            messages.append({"role": "user", "content": f"What is the weather in city {i}?"})
        elif i % 4 == 1:
            call = {"name": f"tool_{i % tools}", "arguments": json.dumps({"city": str(i)})}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": f"call_{i}", "type": "function", "function": call}],
                }
            )
        elif i % 4 == 2:
            messages.append({"role": "tool", "tool_call_id": f"call_{i - 1}", "content": "sunny"})
        else:
            parts = [{"type": "text", "text": f"It is sunny in city {i}."}]
            messages.append({"role": "assistant", "content": parts})
    return {
        "model": "m",
        "messages": messages,
        "tools": [
            {"type": "function", "function": {"name": f"tool_{t}", "parameters": params}}
            for t in range(tools)
        ],
        "tool_choice": "auto",
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["</s>", "\n\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "someone",  # ignored
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from server.protocol import Limits, request_models, validate

    model = request_models(ENGINE, Limits(), ["m"])["ChatCompletionRequest"]
    for turns in (200, 1):
        body = chat_body(turns)
        times = timeit.repeat(
            functools.partial(validate, model, body), number=args.number, repeat=args.repeat
        )
        per = min(times) / args.number * 1e6
        print(f"chat, {len(body['messages'])} message(s): {per:.0f} µs/parse")


if __name__ == "__main__":
    main()
