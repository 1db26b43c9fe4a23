"""Request bodies -> what the engine runs: reading and parsing the body, checking it
against its route's model, and turning it into prompts and SamplingParams.

The only checks here are the models' (`protocol.validate`) and what only the server
knows (the JSON itself, the model's id, a chat template, fields that go together). The
prompt's own checks (empty, token ids, its length against max_seq_len with max_tokens, KV
capacity) and SamplingParams' are the engine's: its RequestError names the field and
`errors.engine_error` makes it a 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jpaged.engine.beam import BeamSearchParams
from jpaged.engine.interface import EngineInterface, PromptRequest
from jpaged.engine.sampling import (
    MAX_TOKENS_LIMIT,
    STRUCTURED_KINDS,
    SamplingParams,
    StructuredOutputsParams,
)
from server.errors import APIError, engine_error
from server.media import MediaOptions, read_images
from server.protocol import Limits, validate
from server.reply import Parsing
from server.template import Template
from server.tools import parameters, required_schema

log = logging.getLogger(__name__)

# Ignored field names remembered (each logged once): a client inventing a fresh name per
# request must not grow the set, nor the log, without bound.
MAX_IGNORED_NAMES = 256


@dataclass(frozen=True)
class Options:
    """The server's settings for every request (`python -m server`'s flags)."""

    chat_template: str | None = None  # --chat-template: the template's text
    tool_call_parser: str | None = None  # a `server.tools.FORMATS`, for tool_choice "auto"
    reasoning_parser: str | None = None  # a `server.reasoning.PARSERS`
    priorities: bool = False  # --scheduling-policy priority: requests may set `priority`
    request_timeout_s: float | None = None  # the deadline of requests that set no `timeout`
    pooling: str = "last"  # embeddings: "last" or "mean" over the final hidden states
    media: MediaOptions = MediaOptions()  # images: allowed hosts, limits (`server.media`)


@dataclass(frozen=True)
class Call:
    """A validated request, ready for the engine."""

    prompts: list[str | list[int]]  # each its own engine request (a completions batch)
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    rename: dict[str, str]  # engine field -> what this request called it
    echo: list[str] | None = None  # with echo: each prompt's text, which its answers start with
    # echo with max_tokens 0: the token the engine generated (it makes one at least) is dropped
    prompt_only: bool = False
    beam: BeamSearchParams | None = None  # use_beam_search: params.n beams, best first
    lora: str | None = None  # the LoRA adapter its `model` named (`server.lora`)
    parsing: Parsing = Parsing()  # chat: how to read thinking and tool calls
    priority: int = 0
    timeout_s: float | None = None  # its deadline, from its arrival
    images: list[Any] | None = None  # chat: the prompt's images (PIL), in order
    add_special_tokens: bool = True  # text prompts: tokenized with BOS (not a chat's render)
    fill_context: bool = False  # params.max_tokens a ceiling: a chat that sets none

    @property
    def engine_params(self) -> SamplingParams | BeamSearchParams:
        return self.beam or self.params

    def request(self, i: int, request_id: str | None = None) -> PromptRequest:
        """Prompt `i` as the engine takes it (tokenized, its images expanded, there)."""
        return PromptRequest(
            self.prompts[i],
            self.engine_params,
            request_id,
            self.priority,
            self.timeout_s,
            lora=self.lora,
            images=self.images,
            add_special_tokens=self.add_special_tokens,
            fill_context=self.fill_context,
        )


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


async def read_body(request: Request, limits: Limits) -> dict:
    """The request's JSON object, read within the size and time limits."""
    too_big = APIError(
        413,
        f"the request body exceeds {limits.max_body_bytes} bytes",
        headers={"Connection": "close"},
    )
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
        raise APIError(
            408,
            f"the request body took over {limits.body_timeout_s:g} s",
            headers={"Connection": "close"},
        ) from None
    raw = b"".join(chunks)
    # a large body's parse is milliseconds the event loop (every stream) would wait
    body = parse_json(raw) if size < 1 << 16 else await run_in_threadpool(parse_json, raw)
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object")
    return body


class Parser:
    """What each /v1 route makes of a body (validated by `requests`: the models of
    `protocol.request_models`, by name)."""

    def __init__(
        self,
        engine: EngineInterface,
        models: list[str],
        requests: dict[str, type[BaseModel]],
        options: Options | None = None,
    ) -> None:
        self.engine = engine  # tokenizes prompts (its intake's); the tokenizer decodes here
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.config.max_seq_len
        self.options = options = options or Options()
        self.models, self.requests = models, requests
        self.template = Template(engine.tokenizer, options.chat_template)
        self.ignored: set[str] = set()  # request fields no route reads, logged once each
        self._ignored_lock = threading.Lock()  # (bodies are parsed in a thread pool)

    def _schedule(self, args: dict[str, Any]) -> dict[str, Any]:
        """The Call's priority and deadline fields."""
        timeout = args["timeout"] or self.options.request_timeout_s
        return {"priority": args["priority"], "timeout_s": timeout}

    def check(self, body: dict, request: str) -> dict[str, Any]:
        model = body.get("model")
        # a string, but not ours: the client meant another server (a type error stays a 400)
        if isinstance(model, str) and model not in self.models:
            served = ", ".join(self.models)
            raise APIError(
                404,
                f"the model `{model[:100]}` does not exist; this server serves {served}",
                "model",
                code="model_not_found",
            )
        self._log_ignored(body, self.requests[request])
        return validate(self.requests[request], body)

    def _log_ignored(self, body: dict, model: type[BaseModel]) -> None:
        """A field the route ignores (as vLLM does) may be one the client relies on: say so,
        once per name."""
        unknown = [k for k in body if k not in model.model_fields]
        if not unknown:
            return
        with self._ignored_lock:
            new = [k for k in dict.fromkeys(unknown) if k not in self.ignored]
            new = new[: max(0, MAX_IGNORED_NAMES - len(self.ignored))]
            self.ignored.update(new)
            full = len(self.ignored) == MAX_IGNORED_NAMES
        for name in new:
            log.warning("request field %r is not supported and is ignored", name[:100])
        if new and full:
            log.warning("further ignored request fields are not logged")

    def completion(self, body: dict) -> Call:
        args = self.check(body, "CompletionRequest")
        prompt, echo, max_tokens, logprobs = (
            args[k] for k in ("prompt", "echo", "max_tokens", "logprobs")
        )
        # a batch is a list of strings or of token-id lists (a list of ints is one prompt)
        batch = isinstance(prompt, list) and isinstance(prompt[0], str | list)
        prompts = prompt if batch else [prompt]
        if max_tokens == 0 and not echo:
            raise APIError(
                400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", "max_tokens"
            )
        texts = None
        if echo:  # token ids are echoed as the text they decode to (special tokens included)
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        rename: dict[str, str] = {}  # engine -> request field names, for its errors
        params = _sampling(
            args, max(1, max_tokens), logprobs, rename, prompt_logprobs=logprobs if echo else None
        )
        beam = None
        if args["use_beam_search"]:  # vLLM's extension: the n best beams as the choices
            if args["stream"]:
                raise APIError(
                    400,
                    "stream: beam search answers once the search ends; use stream: false",
                    "stream",
                )
            fmt = args["response_format"]
            refused = {
                "echo": args["echo"],
                "logprobs": logprobs is not None,
                "structured_outputs": args["structured_outputs"],
                "response_format": fmt is not None and fmt["type"] != "text",
            }
            for field, given in refused.items():
                if given:
                    raise APIError(400, f"{field} cannot go with use_beam_search", field)
            rename["beam_width"] = "n"
            try:
                beam = BeamSearchParams(
                    beam_width=params.n,
                    max_tokens=params.max_tokens,
                    ignore_eos=params.ignore_eos,
                    stop=params.stop,
                    length_penalty=args["length_penalty"],
                )
            except ValueError as exc:
                raise engine_error(exc, rename) from None
        return Call(
            prompts,
            params,
            args["stream"],
            _include_usage(args),
            False,
            rename,
            texts,
            max_tokens == 0,
            beam,
            **self._schedule(args),
        )

    def chat(self, body: dict) -> Call:
        args = self.check(body, "ChatCompletionRequest")
        tools = args["tools"]
        parts = self._image_parts(args["messages"])
        placeholder = self.engine.image_placeholder or ""
        text = self.template.render(
            args["messages"],
            tools,
            args["add_generation_prompt"],
            args["chat_template_kwargs"],
            placeholder,
        )
        images = None
        if parts:
            if not placeholder:
                raise APIError(400, f"{parts[0][0]}: this model takes no images", "messages")
            images = read_images(parts, self.options.media, "messages")
        # engine errors name its own fields; point at what this request called them
        rename = {"prompt": "messages", "logprobs": "top_logprobs"}
        # OpenAI chat replaced max_tokens by max_completion_tokens, which wins when both
        # come (as in vLLM); neither = fill the context
        max_tokens = args["max_tokens"]
        if args["max_completion_tokens"] is not None:
            max_tokens = args["max_completion_tokens"]
            rename["max_tokens"] = "max_completion_tokens"
        # neither: the engine fills what the context leaves after the prompt (a default,
        # not a check: a prompt that leaves no room is the engine's to refuse, as
        # "prompt: ...", so "messages" here)
        fill = max_tokens is None
        logprobs = args["top_logprobs"] if args["logprobs"] else None
        grammar, parsing = self._tool_use(args)
        if parsing.tools == "mistral":  # its calls open with a special token (vLLM's way)
            args = {**args, "skip_special_tokens": False}
        if grammar is not None:
            # a forced call answers with no text for response_format to shape (OpenAI's
            # way, and agent frameworks send both): the call's grammar is the one applied
            rename["structured.json"] = "tools"
        params = _sampling(
            args, MAX_TOKENS_LIMIT if fill else max_tokens, logprobs, rename, structured=grammar
        )
        return Call(
            [text],
            params,
            args["stream"],
            _include_usage(args),
            True,
            rename,
            parsing=parsing,
            images=images,
            # the template writes BOS itself; tokenizing with specials would double it
            add_special_tokens=False,
            fill_context=fill,
            **self._schedule(args),
        )

    @staticmethod
    def _image_parts(messages: list[dict]) -> list[tuple[str, str]]:
        """(field, url) of the messages' image parts, in order (a part's own `field`, the
        Responses API's name for it, wins)."""
        out = []
        for i, message in enumerate(messages):
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if part.get("type") == "image_url":
                    field = part.get("field") or f"messages[{i}].content[{j}].image_url"
                    out.append((field, part["image_url"]["url"]))
        return out

    def _tool_use(self, args: dict[str, Any]) -> tuple[StructuredOutputsParams | None, Parsing]:
        """The grammar a tool_choice forces (if it does), and how outputs are read."""
        tools, parallel = args["tools"] or [], args["parallel_tool_calls"]
        choice: str | dict = args["tool_choice"] or ("auto" if tools else "none")
        think = self.options.reasoning_parser
        if choice == "none":
            return None, Parsing(think)
        if not tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if choice == "auto":
            if self.options.tool_call_parser is None:
                raise APIError(
                    400,
                    'tool_choice "auto" needs the server started with --tool-call-parser',
                    "tool_choice",
                )
            return None, Parsing(think, self.options.tool_call_parser, parallel=parallel)
        # a forced call: the grammar makes the output JSON from its first token, no thinking
        if choice == "required":
            schema = required_schema(tools, parallel)
            return StructuredOutputsParams(json=schema), Parsing(None, "required", None, parallel)
        assert isinstance(choice, dict)
        name = choice["function"]["name"]
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise APIError(400, f"tool_choice: no tool is named `{name[:100]}`", "tool_choice")
        return StructuredOutputsParams(json=parameters(tool)), Parsing(None, "named", name)


def _sampling(
    args: dict[str, Any],
    max_tokens: int,
    logprobs: int | None,
    rename: dict[str, str],
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    stop = args["stop"]
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=args["temperature"],
            top_p=args["top_p"],
            top_k=args["top_k"],
            seed=args["seed"],
            stop=[stop] if isinstance(stop, str) else stop or [],
            ignore_eos=args["ignore_eos"],
            logprobs=logprobs,
            n=args["n"],
            prompt_logprobs=prompt_logprobs,
            presence_penalty=args["presence_penalty"],
            frequency_penalty=args["frequency_penalty"],
            repetition_penalty=args["repetition_penalty"],
            logit_bias=_logit_bias(args),
            min_tokens=args["min_tokens"],
            structured=structured or _structured(args, rename),
            min_p=args["min_p"],
            stop_token_ids=args["stop_token_ids"] or [],
            include_stop_str_in_output=args["include_stop_str_in_output"],
            skip_special_tokens=args["skip_special_tokens"],
        )
    except ValueError as exc:  # the schema should have caught it; the engine has the say
        raise engine_error(exc, rename) from None


def _logit_bias(args: dict[str, Any]) -> dict[int, float] | None:
    bias = args["logit_bias"]
    if not bias:
        return None
    if not all(k.isascii() and k.isdigit() for k in bias):
        raise APIError(400, "logit_bias keys must be token ids (strings of digits)", "logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


def _structured(args: dict[str, Any], rename: dict[str, str]) -> StructuredOutputsParams | None:
    """response_format (OpenAI's) or structured_outputs (vLLM's) as the engine's spec;
    `rename` learns which of them the engine's errors (structured.*) must name."""
    fmt, extra = args["response_format"], args["structured_outputs"]
    if fmt is not None and fmt["type"] != "text":
        if extra:
            raise APIError(
                400, "give response_format or structured_outputs, not both", "structured_outputs"
            )
        rename.update(
            dict.fromkeys(
                ("structured", "structured.json", "structured.json_object"), "response_format"
            )
        )
        if fmt["type"] == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise APIError(
                400,
                "response_format: json_schema.schema is required with type json_schema",
                "response_format",
            )
        return StructuredOutputsParams(json=schema)
    if not extra:
        return None
    rename["structured"] = "structured_outputs"
    rename.update({f"structured.{k}": f"structured_outputs.{k}" for k in STRUCTURED_KINDS})
    return StructuredOutputsParams(**{k: v for k, v in extra.items() if k in STRUCTURED_KINDS})


def _include_usage(args: dict[str, Any]) -> bool:
    options = args["stream_options"]
    if options is not None and not args["stream"]:  # vLLM refuses it too
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    return bool((options or {}).get("include_usage"))
