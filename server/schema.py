"""The HTTP contract: the limits, the request bodies' JSON Schemas, their validation,
and the OpenAPI document that publishes them.

Request bodies are checked against JSON Schemas built once per app
(`request_schemas`), the very ones `GET /openapi.json` publishes, so the document
cannot drift from what is enforced: types, and the ranges known before the prompt
is tokenized (from the engine's own limits and config). What depends on the prompt
(its length against max_seq_len, with max_tokens) is the engine's to check: its
RequestError names the field, and `errors.engine_error` makes it a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jpaged.engine.beam import LENGTH_PENALTY_MAX
from jpaged.engine.engine import Engine
from jpaged.engine.sampling import (
    LOGIT_BIAS_MAX,
    MAX_LOGPROBS,
    MAX_N,
    MAX_TOKENS_LIMIT,
    NUM_TOP_LOGPROBS,
    PENALTY_MAX,
    SEED_MAX,
    TEMPERATURE_MAX,
    TOP_K_MAX,
)
from server.errors import ERROR_SCHEMA, APIError
from server.tools import TOOL_FIELDS

DESCRIPTION = (
    "OpenAI-style HTTP API over an AsyncEngine: completions, chat, models, health, metrics."
)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # for the whole body, so a trickling client cannot hold a slot
    max_stop: int = 16  # stop strings are matched against every new token's text
    # a stream whose client has not taken a chunk for this long (its buffers are full) is
    # cancelled: a client that stops reading must not hold KV blocks for ever
    stream_timeout_s: float = 60.0
    # prompts in one completions request: each is an engine request, so a batch without
    # bound could fill the waiting queue alone
    max_prompts: int = 64

    def __post_init__(self) -> None:
        if not (
            self.max_body_bytes > 0
            and self.body_timeout_s > 0
            and self.max_stop >= 0
            and self.stream_timeout_s > 0
            and self.max_prompts > 0
        ):
            raise ValueError(f"limits must be positive (max_stop may be 0), got {self}")


def request_schemas(
    engine: Engine, limits: Limits, models: Sequence[str], priorities: bool = False
) -> dict[str, dict]:
    """JSON Schemas of the request bodies, as `validate` enforces them (null = absent).

    Ranges come from the engine (vocabulary, max_seq_len, max_batch_size, its
    SamplingParams limits) and `limits`; defaults from the checkpoint's
    generation_config.json, as vLLM takes them. `models`: the ids the server answers to;
    `priorities`: whether requests may set a priority (--scheduling-policy priority).
    """
    config = engine.config
    gen = {k: v for k, v in (engine.model.generation_config or {}).items() if v is not None}
    room = min(MAX_TOKENS_LIMIT, config.max_seq_len - 1)  # the prompt takes a token at least
    max_n = min(MAX_N, config.max_batch_size)

    def integer(lo: int, hi: int, **extra: Any) -> dict:
        return {"type": "integer", "minimum": lo, "maximum": hi, **extra}

    def penalty(description: str) -> dict:
        return {
            "type": "number",
            "minimum": -PENALTY_MAX,
            "maximum": PENALTY_MAX,
            "default": 0.0,
            "description": f"OpenAI's: {description}",
        }

    def flag(description: str) -> dict:
        return {"type": "boolean", "default": False, "description": description}

    text = {"type": "string", "minLength": 1}
    ids = {
        "type": "array",
        "items": integer(0, engine.model_config.vocab_size - 1),
        "minItems": 1,
        "maxItems": config.max_seq_len - 1,
    }
    sampling = {
        # another string is a 404 (the parser's check), as vLLM and OpenAI answer it
        "model": {
            "title": "the id of a served model (GET /v1/models)",
            "anyOf": [{"const": name} for name in models],
            "description": "default: the served model",
        },
        "temperature": {
            "type": "number",
            "minimum": 0,
            "maximum": TEMPERATURE_MAX,
            "default": gen.get("temperature", 1.0),
            "description": "0 = greedy",
        },
        "top_p": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": gen.get("top_p", 1.0),
        },
        "top_k": integer(-1, TOP_K_MAX, default=gen.get("top_k", 0), description="0 or -1: off"),
        "seed": integer(0, SEED_MAX, description="default: a fresh one per request"),
        "stop": {
            "title": f"a non-empty string or an array of at most {limits.max_stop} of them",
            "anyOf": [text, {"type": "array", "items": text, "maxItems": limits.max_stop}],
        },
        "ignore_eos": flag("keep generating past end-of-sequence tokens"),
        "stop_token_ids": {
            "type": "array",
            "items": integer(0, engine.model_config.vocab_size - 1),
            "maxItems": limits.max_stop,
            "description": "vLLM's: tokens that end the output as EOS does",
        },
        "include_stop_str_in_output": flag(
            "vLLM's: the stop string (or stop token's text) that ended the output stays in it"
        ),
        "skip_special_tokens": {
            "type": "boolean",
            "default": True,
            "description": "vLLM's: special tokens are left out of the text",
        },
        "min_p": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": gen.get("min_p", 0.0),
            "description": "vLLM's: tokens less likely than min_p times the likeliest are cut",
        },
        "n": integer(1, max_n, default=1, description="choices sampled from one prefill"),
        "stream": flag("Server-Sent Events, one chunk per new text"),
        "stream_options": {
            "type": "object",
            "description": "only with stream: true",
            "properties": {"include_usage": flag("a last chunk with the token counts")},
        },
        "presence_penalty": penalty("subtracted from the logit of every token generated so far"),
        "frequency_penalty": penalty(
            "times a token's count in the output, subtracted from its logit"
        ),
        "repetition_penalty": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": TEMPERATURE_MAX,
            "default": 1.0,
            "description": "transformers' penalty over prompt and output tokens; 1 = off",
        },
        "logit_bias": {
            "title": "an object of token id (a string of digits) -> bias in "
            f"[{-LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}]",
            "type": "object",
            "additionalProperties": {
                "type": "number",
                "minimum": -LOGIT_BIAS_MAX,
                "maximum": LOGIT_BIAS_MAX,
            },
        },
        "priority": integer(
            -(2**31) if priorities else 0,
            2**31 - 1 if priorities else 0,
            default=0,
            description="lower is admitted first and preempted last; only 0 unless the "
            "server runs --scheduling-policy priority (vLLM's)",
        ),
        "timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "seconds: past them the request ends (HTTP 408, or "
            'finish_reason "abort" once streaming); default: --request-timeout',
        },
        "min_tokens": integer(
            0,
            room,
            default=0,
            description="tokens generated before EOS or a stop string may end the output",
        ),
        "response_format": {
            "title": 'an object {"type": "text" | "json_object" | "json_schema", '
            '"json_schema": {"schema": {...}}}',
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {
                    "anyOf": [{"const": "text"}, {"const": "json_object"}, {"const": "json_schema"}]
                },
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
        "structured_outputs": {
            "title": "an object with one of choice, regex, json, json_object, grammar (vLLM's)",
            "anyOf": [
                {"type": "object", "required": [k], "properties": {k: v}}
                for k, v in (
                    ("choice", {"type": "array", "items": text, "minItems": 1}),
                    ("regex", text),
                    ("grammar", text),
                    ("json_object", {"const": True}),
                    ("json", {"anyOf": [{"type": "object"}, text]}),
                )
            ],
        },
    }
    batch = {"minItems": 1, "maxItems": limits.max_prompts}
    completion = {
        "prompt": {
            "title": "a string, an array of token ids, or an array of at most "
            f"{limits.max_prompts} of either (a batch: each prompt's n choices in turn)",
            "anyOf": [
                text,
                ids,
                {"type": "array", "items": text, **batch},
                {"type": "array", "items": ids, **batch},
            ],
        },
        "max_tokens": integer(
            0, room, default=16, description="0 only with echo: the prompt alone"
        ),
        **sampling,
        "logprobs": integer(0, NUM_TOP_LOGPROBS, description="alternatives per token"),
        "echo": flag(
            "the text starts with the prompt; with logprobs, so do the tokens (the "
            "first one's logprob is null)"
        ),
        "use_beam_search": flag(
            "vLLM's: the n best of a beam search of width n as the "
            "choices, best first (not with stream, echo, logprobs or "
            "structured outputs; sampling fields are ignored)"
        ),
        "length_penalty": {
            "type": "number",
            "default": 1.0,
            "minimum": -LENGTH_PENALTY_MAX,
            "maximum": LENGTH_PENALTY_MAX,
            "description": "with use_beam_search: "
            "hypotheses rank by cum_logprob / length ** length_penalty",
        },
    }
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    function = {
        "type": "object",
        "required": ["name", "arguments"],
        "properties": {"name": text, "arguments": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
            "name": {"type": "string"},
            "tool_call_id": {"type": "string", "description": "role tool: the call it answers"},
            "tool_calls": {
                "type": "array",
                "description": "role assistant: the calls it made",
                "items": {
                    "type": "object",
                    "required": ["id", "function"],
                    "properties": {"id": {"type": "string"}, "function": function},
                },
            },
        },
    }
    chat = {
        "messages": {
            "title": "a non-empty array of {role, content} objects",
            "type": "array",
            "items": message,
            "minItems": 1,
        },
        "max_tokens": integer(1, room, description="default: the rest of the context"),
        "max_completion_tokens": integer(1, room, description="max_tokens; wins over it"),
        **sampling,
        "logprobs": flag("logprobs of the chosen tokens"),
        "top_logprobs": integer(
            0, MAX_LOGPROBS, default=0, description="alternatives per token, with logprobs"
        ),
        **TOOL_FIELDS,
        "add_generation_prompt": {
            "type": "boolean",
            "default": True,
            "description": "the template opens the assistant's answer",
        },
        "chat_template_kwargs": {
            "type": "object",
            "description": "more variables for the chat template (Qwen3's enable_thinking)",
        },
    }
    ignored = (
        "Other fields are ignored (the server logs each name once); null is the same as "
        "leaving a field out."
    )
    return {
        "CompletionRequest": {
            "type": "object",
            "required": ["prompt"],
            "properties": completion,
            "description": ignored,
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["messages"],
            "properties": chat,
            "description": ignored,
        },
    }


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
            all(fits(v, schema["items"]) for v in value)
        )
    if kind == "object":
        given = {k: v for k, v in value.items() if v is not None}
        more = schema.get("additionalProperties")
        return (
            all(k in given for k in schema.get("required", ()))
            and all(
                fits(given[k], s) for k, s in schema.get("properties", {}).items() if k in given
            )
            and (more is None or all(fits(v, more) for v in value.values()))
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
    words = {
        "integer": "an integer",
        "number": "a number",
        "boolean": "a boolean",
        "string": "a non-empty string" if schema.get("minLength") else "a string",
        "array": "an array",
        "object": "an object",
    }[kind]
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
            raise APIError(400, misfit(name, value, spec), name)
    return args


def misfit(name: str, value: Any, schema: dict) -> str:
    """Why `value` does not fit `schema`, naming the innermost part that does not:
    "prompt[1][0] must be an integer in [0, 319], got 320"."""
    branches = schema.get("anyOf", [schema])
    if isinstance(value, list):
        # the arrays it has the length for; the one whose items fit longest is what was meant
        arrays = [
            s
            for s in branches
            if s.get("type") == "array"
            and s.get("minItems", 0) <= len(value) <= s.get("maxItems", len(value))
        ]
        fitting = [_fitting(value, s["items"]) for s in arrays]
        if arrays and max(fitting) < len(value):
            i, items = max(fitting), arrays[fitting.index(max(fitting))]["items"]
            return misfit(f"{name}[{i}]", value[i], items)
    objects = [s for s in branches if s.get("type") == "object"]
    if isinstance(value, dict) and len(objects) == 1:
        props, given = (
            objects[0].get("properties", {}),
            {k: v for k, v in value.items() if v is not None},
        )
        for key in objects[0].get("required", ()):
            if key not in given:
                return f"{name}.{key} is required: {describe(props[key])}"
        for key, spec in props.items():
            if key in given and not fits(given[key], spec):
                return misfit(f"{name}.{key}", given[key], spec)
    return f"{name} must be {describe(schema)}, got {_brief(value)}"


def _fitting(values: list, schema: dict) -> int:
    """How many of `values`, from the first, fit `schema`."""
    return next((i for i, v in enumerate(values) if not fits(v, schema)), len(values))


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
        out["properties"] = {
            k: published(s) if k in required else _or_null(published(s))
            for k, s in out["properties"].items()
        }
    return out


def _or_null(schema: dict) -> dict:
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {**schema, "type": [schema["type"], "null"]}


# POST routes -> their request schema, and what they do
POSTS = {
    "/v1/completions": ("CompletionRequest", "complete a prompt"),
    "/v1/chat/completions": ("ChatCompletionRequest", "answer a conversation"),
    "/v1/responses": ("ResponsesRequest", "answer (OpenAI's Responses API, stateless)"),
    "/v1/embeddings": ("EmbeddingRequest", "embed texts or token lists"),
    "/tokenize": ("TokenizeRequest", "a prompt's or conversation's tokens (vLLM's)"),
    "/detokenize": ("DetokenizeRequest", "the text of tokens (vLLM's)"),
}


def openapi(schemas: dict[str, dict], secured: bool) -> dict:
    """The OpenAPI 3.1 document of the app: its routes, and its request bodies as validated."""

    def ref(name: str) -> dict:
        return {"schema": {"$ref": f"#/components/schemas/{name}"}}

    error = {"description": "an error", "content": {"application/json": ref("Error")}}
    errors = {code: error for code in ("400", "401", "404", "405", "408", "413", "503")}
    key: dict[str, Any] = {"security": [{"bearer": []}]} if secured else {}

    def post(name: str, summary: str) -> dict:
        ok = {
            "description": "the answer; with stream: true, Server-Sent Events "
            "(`data: {chunk}` events, then `data: [DONE]`; /v1/responses: its own events)",
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
        return {
            "post": {
                "summary": summary,
                "responses": {"200": ok, **errors},
                **key,
                "requestBody": {"required": True, "content": {"application/json": ref(name)}},
            }
        }

    def get(summary: str, media: str = "application/json", extra: dict | None = None) -> dict:
        body = {"type": "object" if media.endswith("json") else "string"}
        ok = {"description": summary, "content": {media: {"schema": body}}}
        return {"get": {"summary": summary, "responses": {"200": ok, **errors}, **(extra or {})}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "jpaged", "version": "1", "description": DESCRIPTION},
        "paths": {
            **{p: post(name, what) for p, (name, what) in POSTS.items() if name in schemas},
            "/v1/models": get("the served model, under each of its ids", extra=key),
            "/v1/models/{model}": get(
                "a served model; any other id is a 404 (model_not_found)",
                extra={
                    **key,
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                },
            ),
            "/health": get("200 while the engine runs, 503 otherwise or while shutting down"),
            "/metrics": get("Prometheus text", "text/plain"),
            "/openapi.json": get("this document"),
        },
        "components": {
            "schemas": {**{k: published(s) for k, s in schemas.items()}, "Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
