"""The HTTP contract: the limits, and the request bodies as pydantic models.

The models are built once per app (`request_models`), with the ranges known before the
prompt is tokenized (from the engine's own limits and config) in their fields, and
`GET /openapi.json` publishes their JSON Schemas (`published`), so the document cannot
drift from what is enforced. What depends on the prompt (its length against max_seq_len,
with max_tokens) is the engine's to check: its RequestError names the field, and
`errors.engine_error` makes it a 400.

Validation is strict (JSON's types: no "10" for 10, no true for 1); null is the same as
leaving a field out; other fields are ignored (`parse.Parser` logs each name once).
"""

from __future__ import annotations

import decimal
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    create_model,
)
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from jpaged.engine.beam import LENGTH_PENALTY_MAX
from jpaged.engine.interface import EngineInterface
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
from server.errors import APIError
from server.objects import (
    Choice,
    FlatTool,
    FlatToolChoice,
    Grammar,
    InputItem,
    JSONObject,
    JSONOutput,
    Message,
    NamedToolChoice,
    Regex,
    ResponseFormat,
    StreamOptions,
    Text,
    TextOptions,
    Tool,
    VisionMessage,
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


Modes = Literal["none", "auto", "required"]  # tool_choice, besides a named function


def _opt(kind: Any, default: Any = None, description: str | None = None, **bounds: Any) -> Any:
    """An optional field: `kind` within `bounds`, `default` when null or left out."""
    inner = Annotated[kind, Field(**bounds)] if bounds else kind
    return (inner | None, Field(default, description=description))


def _flag(description: str, default: bool = False) -> Any:
    return _opt(bool, default, description)


def _ids(vocab: int, **bounds: Any) -> Any:
    return Annotated[list[Annotated[int, Field(ge=0, le=vocab - 1)]], Field(**bounds)]


def _batch(kind: Any, most: int) -> Any:
    return Annotated[list[kind], Field(min_length=1, max_length=most)]


def _model_field(models: Sequence[str]) -> Any:
    # another string is a 404 (the parser's check, before validation), as vLLM and OpenAI
    # answer it; the document lists the ids a client may send
    names = WithJsonSchema({"anyOf": [{"const": name} for name in models]})
    return _opt(Annotated[str, names], None, "default: the served model")


class _Request(BaseModel):
    """Other fields are ignored (the server logs each name once); null is the same as
    leaving a field out."""

    model_config = ConfigDict(extra="ignore", strict=True)


@dataclass(frozen=True)
class _Ranges:
    """What the request models' ranges and defaults come from."""

    limits: Limits
    vocab: int  # token ids are below it
    room: int  # the most tokens a request may ask for (the prompt takes one at least)
    max_batch_size: int  # n's bound
    gen: dict[str, Any]  # the checkpoint's generation_config.json (vLLM's defaults)
    message: Any  # a chat message's model (with image_url parts if the model takes images)

    def prompts(self) -> Any:
        """A string, token ids, or a batch of either."""
        vocab, most = self.vocab, self.limits.max_prompts
        return (
            Text
            | _ids(vocab, min_length=1)
            | _batch(Text, most)
            | _batch(_ids(vocab, min_length=1), most)
        )


def request_models(
    engine: EngineInterface, limits: Limits, models: Sequence[str], priorities: bool = False
) -> dict[str, type[BaseModel]]:
    """The request bodies' models, by the name /openapi.json gives their schemas.

    Ranges come from the engine (vocabulary, max_seq_len, max_batch_size, its
    SamplingParams limits) and `limits`; defaults from the checkpoint's
    generation_config.json, as vLLM takes them. `models`: the ids the server answers to;
    `priorities`: whether requests may set a priority (--scheduling-policy priority).
    """
    config = engine.config
    gen = {k: v for k, v in (engine.model.generation_config or {}).items() if v is not None}
    r = _Ranges(
        limits,
        engine.model_config.vocab_size,
        min(MAX_TOKENS_LIMIT, config.max_seq_len - 1),
        config.max_batch_size,
        gen,
        # a model that takes images: content parts may be image_url ones (`server.media`)
        Message if engine.image_placeholder is None else VisionMessage,
    )
    sampling = _sampling_fields(r, models, priorities)
    chat = _chat_fields(r)
    built = (
        _completion_model(r, sampling),
        _chat_model(r, sampling, chat),
        _responses_model(sampling, chat),
        _embedding_model(r, sampling),
        *_token_models(r, chat),
    )
    return {m.__name__: m for m in built}


def _sampling_fields(r: _Ranges, models: Sequence[str], priorities: bool) -> dict[str, Any]:
    """The fields completions and chat share: the model, sampling, stopping, streaming,
    scheduling and structured outputs."""
    gen, limits, vocab, room = r.gen, r.limits, r.vocab, r.room
    span = 2**31 if priorities else 0

    def penalty(description: str) -> Any:
        return _opt(float, 0.0, f"OpenAI's: {description}", ge=-PENALTY_MAX, le=PENALTY_MAX)

    return {
        "model": _model_field(models),
        "temperature": _opt(
            float, gen.get("temperature", 1.0), "0 = greedy", ge=0, le=TEMPERATURE_MAX
        ),
        "top_p": _opt(float, gen.get("top_p", 1.0), gt=0, le=1),
        "top_k": _opt(int, gen.get("top_k", 0), "0 or -1: off", ge=-1, le=TOP_K_MAX),
        "seed": _opt(int, None, "default: a fresh one per request", ge=0, le=SEED_MAX),
        "stop": _opt(
            Text | Annotated[list[Text], Field(max_length=limits.max_stop)],
            None,
            f"a non-empty string or an array of at most {limits.max_stop} of them",
        ),
        "ignore_eos": _flag("keep generating past end-of-sequence tokens"),
        "stop_token_ids": _opt(
            _ids(vocab, max_length=limits.max_stop),
            None,
            "vLLM's: tokens that end the output as EOS does",
        ),
        "include_stop_str_in_output": _flag(
            "vLLM's: the stop string (or stop token's text) that ended the output stays in it"
        ),
        "skip_special_tokens": _flag("vLLM's: special tokens are left out of the text", True),
        "min_p": _opt(
            float,
            gen.get("min_p", 0.0),
            "vLLM's: tokens less likely than min_p times the likeliest are cut",
            ge=0,
            le=1,
        ),
        "n": _opt(
            int, 1, "choices sampled from one prefill", ge=1, le=min(MAX_N, r.max_batch_size)
        ),
        "stream": _flag("Server-Sent Events, one chunk per new text"),
        "stream_options": _opt(StreamOptions, None, "only with stream: true"),
        "presence_penalty": penalty("subtracted from the logit of every token generated so far"),
        "frequency_penalty": penalty(
            "times a token's count in the output, subtracted from its logit"
        ),
        "repetition_penalty": _opt(
            float,
            1.0,
            "transformers' penalty over prompt and output tokens; 1 = off",
            gt=0,
            le=TEMPERATURE_MAX,
        ),
        "logit_bias": _opt(
            dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]],
            None,
            "token id (a string of digits) -> bias",
        ),
        "priority": _opt(
            int,
            0,
            "lower is admitted first and preempted last; only 0 unless the server runs "
            "--scheduling-policy priority (vLLM's)",
            ge=-span,
            le=max(0, span - 1),
        ),
        "timeout": _opt(
            float,
            None,
            'seconds: past them the request ends (HTTP 408, or finish_reason "abort" once '
            "streaming); default: --request-timeout",
            gt=0,
        ),
        "min_tokens": _opt(
            int,
            0,
            "tokens generated before EOS, stop_token_ids or a stop string may end the output",
            ge=0,
            le=room,
        ),
        "response_format": _opt(ResponseFormat),
        "structured_outputs": _opt(
            Choice | Regex | Grammar | JSONObject | JSONOutput,
            None,
            "vLLM's: an object with one of choice, regex, json, json_object, grammar",
        ),
    }


def _completion_model(r: _Ranges, sampling: dict[str, Any]) -> type[BaseModel]:
    limits, room = r.limits, r.room
    # a prompt's length, against the context with max_tokens, is the engine's to refuse
    # (OpenAI's context_length_exceeded, as for a text prompt)
    prompt = r.prompts()
    return create_model(
        "CompletionRequest",
        __base__=_Request,
        prompt=(
            prompt,
            Field(
                description="a string, an array of token ids, or an array of at most "
                f"{limits.max_prompts} of either (a batch: each prompt's n choices in turn)"
            ),
        ),
        max_tokens=_opt(int, 16, "0 only with echo: the prompt alone", ge=0, le=room),
        **sampling,
        logprobs=_opt(int, None, "alternatives per token", ge=0, le=NUM_TOP_LOGPROBS),
        echo=_flag(
            "the text starts with the prompt; with logprobs, so do the tokens (the first "
            "one's logprob is null)"
        ),
        use_beam_search=_flag(
            "vLLM's: the n best of a beam search of width n as the choices, best first (not "
            "with stream, echo, logprobs or structured outputs; sampling fields are ignored)"
        ),
        length_penalty=_opt(
            float,
            1.0,
            "with use_beam_search: hypotheses rank by cum_logprob / length ** length_penalty",
            ge=-LENGTH_PENALTY_MAX,
            le=LENGTH_PENALTY_MAX,
        ),
    )


def _chat_fields(r: _Ranges) -> dict[str, Any]:
    """The fields of a chat (Responses reads some): messages, max_tokens, tools, the
    template's variables."""
    message: Any = r.message
    room = r.room
    messages = (
        Annotated[list[message], Field(min_length=1)],
        Field(description="a non-empty array of {role, content} objects"),
    )
    max_tokens = _opt(int, None, "default: the rest of the context", ge=1, le=room)
    tools = {
        "tools": _opt(list[Tool], None, "functions the model may call"),
        "tool_choice": _opt(
            Modes | NamedToolChoice,
            None,
            'default: "auto" with tools (needs --tool-call-parser), else "none"; '
            '"required" and a named function are forced by a grammar',
        ),
        "parallel_tool_calls": _flag("false: one call at most", True),
    }
    template = {
        "add_generation_prompt": _flag("the template opens the assistant's answer", True),
        "chat_template_kwargs": _opt(
            dict[str, Any],
            None,
            "more variables for the chat template (Qwen3's enable_thinking)",
        ),
    }
    return {"messages": messages, "max_tokens": max_tokens, "tools": tools, "template": template}


def _chat_model(r: _Ranges, sampling: dict[str, Any], chat: dict[str, Any]) -> type[BaseModel]:
    room, tools, template = r.room, chat["tools"], chat["template"]
    return create_model(
        "ChatCompletionRequest",
        __base__=_Request,
        messages=chat["messages"],
        max_tokens=chat["max_tokens"],
        max_completion_tokens=_opt(int, None, "max_tokens; wins over it", ge=1, le=room),
        **sampling,
        logprobs=_flag("logprobs of the chosen tokens"),
        top_logprobs=_opt(int, 0, "alternatives per token, with logprobs", ge=0, le=MAX_LOGPROBS),
        **tools,
        **template,
    )


def _responses_model(sampling: dict[str, Any], chat: dict[str, Any]) -> type[BaseModel]:
    tools = chat["tools"]
    return create_model(
        "ResponsesRequest",
        __base__=_Request,
        model=sampling["model"],
        input=(
            Text | Annotated[list[InputItem], Field(min_length=1)],
            Field(description="a non-empty string or array of input items"),
        ),
        instructions=_opt(str, None, "a system message first"),
        tools=_opt(list[FlatTool]),
        tool_choice=_opt(Modes | FlatToolChoice),
        parallel_tool_calls=tools["parallel_tool_calls"],
        max_output_tokens=chat["max_tokens"],
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        text=_opt(TextOptions),
        stream=sampling["stream"],
        previous_response_id=_opt(str, None, "refused: nothing is stored"),
        store=_opt(bool, None, "accepted; nothing is stored"),
    )


def _embedding_model(r: _Ranges, sampling: dict[str, Any]) -> type[BaseModel]:
    limits = r.limits
    return create_model(
        "EmbeddingRequest",
        __base__=_Request,
        model=sampling["model"],
        input=(
            r.prompts(),
            Field(
                description="a non-empty string, an array of token ids, or an array of at "
                f"most {limits.max_prompts} of either"
            ),
        ),
        encoding_format=_opt(Literal["float", "base64"], "float"),
        dimensions=_opt(int, None, "only the model's hidden size (no truncation)", ge=1),
    )


def _token_models(r: _Ranges, chat: dict[str, Any]) -> tuple[type[BaseModel], type[BaseModel]]:
    """/tokenize's and /detokenize's."""
    messages, template, tools = chat["messages"], chat["template"], chat["tools"]
    tokenize = create_model(
        "TokenizeRequest",
        __base__=_Request,
        __doc__="give prompt or messages",
        model=_opt(str),
        prompt=_opt(str),
        messages=_opt(messages[0]),
        add_special_tokens=_opt(
            bool,
            None,
            "the tokenizer's BOS (default: true with prompt, false with messages, whose "
            "template writes its own)",
        ),
        **template,
        tools=tools["tools"],
        return_token_strs=_flag("each token's text too"),
    )
    detokenize = create_model(
        "DetokenizeRequest", __base__=_Request, model=_opt(str), tokens=(_ids(r.vocab), ...)
    )
    return tokenize, detokenize


def validate(model: type[BaseModel], body: dict) -> dict[str, Any]:
    """`body`'s fields as `model` reads them (its defaults for those null or left out; other
    fields dropped). Raises a 400 naming the first field that does not fit."""
    given = {k: v for k, v in body.items() if v is not None}
    try:
        return dict(model.model_validate(given, strict=True))
    except ValidationError as exc:
        raise _refusal(exc, given) from None


def _refusal(exc: ValidationError, body: dict) -> APIError:
    """The first field's error, at the innermost place its value went wrong: of a union's
    branches, the one that got furthest is what the client meant."""
    errors = exc.errors(include_url=False)
    field = str(errors[0]["loc"][0])
    where, depth, error = max(
        (_place(body, e) + (e,) for e in errors if e["loc"][0] == errors[0]["loc"][0]),
        key=lambda found: (found[1], found[2]["type"] != "missing"),
    )
    if error["type"] == "missing":
        return APIError(400, f"{where} is required", field)
    message = _BOUNDS.get(error["type"])
    if message is not None:  # pydantic writes a float bound with all its 39 digits
        bound = next(iter(error["ctx"].values()))
        message = f"Input should be {message} {_plain(bound, error['type'] in _UPPER)}"
    return APIError(400, f"{where}: {message or error['msg']}, got {_brief(error['input'])}", field)


_BOUNDS = {
    "less_than_equal": "less than or equal to",
    "less_than": "less than",
    "greater_than_equal": "greater than or equal to",
    "greater_than": "greater than",
}
_UPPER = ("less_than_equal", "less_than")


def _plain(bound: float, upper: bool) -> str:
    """A bound as a reader writes it: an integer whole, else 4 significant digits rounded
    inward (3.402e+38 for float32's largest, which a value of 3.403e+38 would exceed)."""
    if isinstance(bound, int) or (float(bound).is_integer() and abs(bound) < 1e15):
        return str(int(bound))
    rounding = decimal.ROUND_FLOOR if upper else decimal.ROUND_CEILING
    near = decimal.Context(prec=4, rounding=rounding).create_decimal_from_float(float(bound))
    return f"{float(near):g}"


def _place(body: dict, error: Any) -> tuple[str, int]:
    """Where in `body` an error's location points, as `messages[2].content`, and how deep:
    the location's other parts name a union's branches, not places."""
    name, *rest = error["loc"]
    where, value, depth = str(name), body.get(name), 0
    for i, part in enumerate(rest):
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            where, value = f"{where}[{part}]", value[part]
        elif isinstance(value, dict) and (part in value or i == len(rest) - 1):
            where, value = f"{where}.{part}", value.get(part)
        else:
            continue
        depth += 1
    return where, depth


def _brief(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


class _Published(GenerateJsonSchema):
    """JSON Schema as the fuzz tests and clients read it: an optional field's type with
    "null" beside it, literals as consts, no generated titles."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        inner = self.generate_inner(schema["schema"])
        if "anyOf" in inner:
            return {**inner, "anyOf": [*inner["anyOf"], {"type": "null"}]}
        if isinstance(inner.get("type"), str):
            return {**inner, "type": [inner["type"], "null"]}
        return {"anyOf": [inner, {"type": "null"}]}

    def literal_schema(self, schema: core_schema.LiteralSchema) -> JsonSchemaValue:
        consts = [{"const": v} for v in schema["expected"]]
        return consts[0] if len(consts) == 1 else {"anyOf": consts}

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def published(model: type[BaseModel]) -> dict:
    """`model`'s JSON Schema, each reference to a nested object written out in place (the
    nested objects are small, and a client or a test can read a field's schema without
    resolving `$ref`s)."""
    schema = model.model_json_schema(schema_generator=_Published)
    defs = schema.pop("$defs", {})
    schema.pop("title", None)

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[1]]
            node = {**{k: v for k, v in target.items() if k != "title"}, **node}
            del node["$ref"]
        return {k: inline(v) for k, v in node.items()}

    return inline(schema)
