"""`POST /v1/responses`: OpenAI's Responses API, its stateless subset, on the chat route's
machinery (template, tools, grammar, parsers).

A request becomes a chat request (`input` items -> messages, `instructions` -> a system
message, flat function tools -> chat tools, `text.format` -> response_format) and its answer
becomes output items: `reasoning`, a `message` with `output_text`, `function_call`s.
Streams send the Responses event types (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`).

Nothing is stored: `previous_response_id` is refused with a 400 (send the whole input
each time, as `store: false` clients do), and `store` is accepted but stores nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jpaged.engine.output import RequestOutput
from server.asgi import EventStream, unless_disconnected
from server.errors import APIError
from server.outputs import gather
from server.parse import Call, Parser
from server.protocol import Limits
from server.reply import Reply

# chat field -> what this route calls it, for the chat parser's errors
_RENAME = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}


def parse(parser: Parser, body: dict) -> tuple[Call, dict[str, Any]]:
    """The chat Call of a Responses request, and the fields its answer repeats."""
    args = parser.check(body, "ResponsesRequest")
    if args["previous_response_id"] is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation as input",
            "previous_response_id",
        )
    tools = [
        {
            "type": "function",
            "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if k in t
            },
        }
        for t in args["tools"] or []
    ]
    choice = args["tool_choice"]
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (args["text"] or {}).get("format") or {"type": "text"}
    response_format = None
    if fmt["type"] == "json_schema":
        if "schema" not in fmt:
            raise APIError(400, "text.format.schema is required with json_schema", "text")
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]},
        }
    elif fmt["type"] == "json_object":
        response_format = {"type": "json_object"}
    chat = {
        "messages": _messages(args["input"], args["instructions"]),
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": args["parallel_tool_calls"],
        "max_tokens": args["max_output_tokens"],
        "temperature": args["temperature"],
        "top_p": args["top_p"],
        "response_format": response_format,
        "stream": args["stream"],
    }
    try:
        call = parser.chat(chat)
    except APIError as exc:
        param = exc.param or ""
        head = param.split(".")[0].split("[")[0]
        if head in _RENAME:
            exc.param = _RENAME[head] + param[len(head) :]
            exc.message = exc.message.replace(head, _RENAME[head], 1)
        raise
    shown = {
        "instructions": args["instructions"],
        "max_output_tokens": args["max_output_tokens"],
        "temperature": call.params.temperature,
        "top_p": call.params.top_p,
        "tool_choice": args["tool_choice"] or ("auto" if tools else "none"),
        "tools": [{"strict": False, "parameters": None, **t} for t in args["tools"] or []],
        "parallel_tool_calls": args["parallel_tool_calls"],
        "text": {"format": fmt},
    }
    return call, shown


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _content(content: Any, i: int) -> Any:
    """A message item's content for chat: text, or with `input_image` parts (an
    `image_url` string, OpenAI's shape) chat's text and image_url parts."""
    if isinstance(content, str) or not any(p.get("type") == "input_image" for p in content):
        return _text(content)
    parts = []
    for j, p in enumerate(content):
        if p.get("type") == "input_image":
            field = f"input[{i}].content[{j}].image_url"
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{field}: an image URL (a data: URL) is required", "input")
            parts.append({"type": "image_url", "image_url": {"url": url}, "field": field})
        else:
            parts.append({"type": "text", "text": p.get("text") or ""})
    return parts


def _messages(given: str | list[dict], instructions: str | None) -> list[dict]:
    """Input items -> chat messages: function calls join the assistant turn before them."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for i, item in enumerate(given):
        kind = item.get("type") or "message"
        need = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "reasoning": (),
        }.get(kind)
        if need is None:
            raise APIError(400, f"input[{i}].type `{kind[:50]}` is not supported", "input")
        for key in need:
            if item.get(key) is None:
                raise APIError(400, f"input[{i}].{key} is required", "input")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _content(item["content"], i)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


class Answer:
    """The output items of one answer as its text comes, and the events that build them."""

    def __init__(self, rid: str, model: str, call: Call, shown: dict[str, Any]) -> None:
        self.rid, self.model, self.shown = rid, model, shown
        self.reply = Reply(call.parsing)
        self.created = int(time.time())
        self.items: list[dict] = []
        self.open: dict | None = None  # the item the text goes to now
        self.calls: dict[int, dict] = {}  # the reply's call index -> its item
        self.events = 0

    def event(self, kind: str, **fields: Any) -> str:
        self.events += 1
        payload = {"type": kind, "sequence_number": self.events - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def response(self, status: str, outs: list[RequestOutput]) -> dict[str, Any]:
        last = outs[-1] if outs else None
        usage = None
        if last is not None:
            usage = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": last.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.prompt_tokens + last.completion_tokens,
            }
        incomplete = status == "incomplete"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": self.items if status != "in_progress" else [],
            "previous_response_id": None,
            "store": False,
            "metadata": {},
            "usage": usage,
            **self.shown,
        }

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, done = self.items.index(item), []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            done += [
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        elif item["type"] == "reasoning":
            done.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        else:
            done.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        return [*done, self.event("response.output_item.done", output_index=index, item=item)]

    def _start(self, item: dict) -> list[str]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress"},
            )
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(item["content"][0]),
                )
            )
        return events

    def feed(self, piece: str, final: bool) -> list[str]:
        """The events `piece` of text makes (with `final`, those that close the last item)."""
        delta, events = self.reply.delta(piece, final), []
        if "reasoning_content" in delta:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start(
                    {
                        "type": "reasoning",
                        "id": f"rs_{uuid.uuid4().hex}",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
            assert self.open is not None
            self.open["content"][0]["text"] += delta["reasoning_content"]
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=delta["reasoning_content"],
                )
            )
        if "content" in delta:
            if self.open is None or self.open["type"] != "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events += self._start(
                    {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex}",
                        "role": "assistant",
                        "content": [part],
                    }
                )
            assert self.open is not None
            self.open["content"][0]["text"] += delta["content"]
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for piece_ in delta.get("tool_calls", []):
            if "id" in piece_:
                item = {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": piece_["id"],
                    "name": piece_["function"]["name"],
                    "arguments": "",
                }
                events += self._start(item)
                self.calls[piece_["index"]] = item
            item = self.calls[piece_["index"]]
            more = piece_["function"]["arguments"]
            if more:
                item["arguments"] += more
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=more,
                    )
                )
        return events + (self._close() if final else [])


async def respond(
    request: Request,
    outputs: AsyncGenerator[RequestOutput, None],
    call: Call,
    shown: dict[str, Any],
    model: str,
    limits: Limits,
) -> Response:
    """Run the request: its Response object, or its stream of events."""
    answer = Answer(f"resp_{uuid.uuid4().hex}", model, call, shown)
    first = await unless_disconnected(request, anext(outputs))

    def status(out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    if not call.stream or first.finish_reason == "error":
        outs = await gather(request, first, outputs)
        answer.feed("".join(o.text for o in outs), final=True)
        return JSONResponse(answer.response(status(outs[-1]), outs))

    streamed: list[RequestOutput] = []  # the outputs sent so far

    def failed(error: APIError) -> str:
        said = {"code": error.code or error.kind, "message": error.message}
        return answer.event(
            "response.failed", response={**answer.response("failed", streamed), "error": said}
        )

    async def events() -> AsyncGenerator[str, None]:
        try:
            yield answer.event("response.created", response=answer.response("in_progress", []))
            yield answer.event("response.in_progress", response=answer.response("in_progress", []))
            out: RequestOutput | None = first
            while out is not None:
                streamed.append(out)
                if out.finish_reason in ("error", "abort"):
                    message = out.error or "request aborted"
                    raise APIError(500, message, kind="server_error")
                for event in answer.feed(out.text, out.finished):
                    yield event
                out = await anext(outputs, None)
            done = status(streamed[-1])
            yield answer.event(f"response.{done}", response=answer.response(done, streamed))
        finally:
            await outputs.aclose()

    return EventStream(events(), limits.stream_timeout_s, failed)
