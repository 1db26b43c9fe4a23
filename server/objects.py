"""The request bodies' nested objects (messages, tools, formats, ...) as TypedDicts, which
`server.protocol`'s models hold: validated, they are still the plain dicts the parsers
read."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

# Nested objects are TypedDicts: the parsers read them as the dicts they were sent as, and
# `extra="allow"` keeps the keys the schema does not name (a message's reasoning_content,
# which a chat template may read).
_OPEN = ConfigDict(extra="allow")
Text = Annotated[str, Field(min_length=1)]


@with_config(_OPEN)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


@with_config(_OPEN)
class ImageURL(TypedDict):
    url: Annotated[str, Field(description="a data: URL (base64 PNG, JPEG or WebP), or http(s)")]
    detail: NotRequired[str | None]


@with_config(_OPEN)
class ImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: ImageURL


@with_config(_OPEN)
class CalledFunction(TypedDict):
    name: Text
    arguments: str


@with_config(_OPEN)
class MadeCall(TypedDict):
    id: str
    function: CalledFunction


@with_config(_OPEN)
class Message(TypedDict):
    role: str
    content: NotRequired[str | list[TextPart] | None]
    name: NotRequired[str | None]
    tool_call_id: NotRequired[
        Annotated[str | None, Field(description="role tool: the call it answers")]
    ]
    tool_calls: NotRequired[
        Annotated[list[MadeCall] | None, Field(description="role assistant: the calls it made")]
    ]


@with_config(_OPEN)
class VisionMessage(TypedDict):
    """A message to a model that takes images: its content parts text or image_url."""

    role: str
    content: NotRequired[str | list[TextPart | ImagePart] | None]
    name: NotRequired[str | None]
    tool_call_id: NotRequired[
        Annotated[str | None, Field(description="role tool: the call it answers")]
    ]
    tool_calls: NotRequired[
        Annotated[list[MadeCall] | None, Field(description="role assistant: the calls it made")]
    ]


@with_config(_OPEN)
class Function(TypedDict):
    name: Text
    description: NotRequired[str | None]
    parameters: NotRequired[Annotated[dict[str, Any] | None, Field(description="a JSON Schema")]]
    strict: NotRequired[
        Annotated[bool | None, Field(description="a forced call has every property, and no others")]
    ]


@with_config(_OPEN)
class Tool(TypedDict):
    """OpenAI's function tools, as /v1/chat/completions takes them."""

    type: Literal["function"]
    function: Function


@with_config(_OPEN)
class FunctionName(TypedDict):
    name: str


@with_config(_OPEN)
class NamedToolChoice(TypedDict):
    type: Literal["function"]
    function: FunctionName


@with_config(_OPEN)
class StreamOptions(TypedDict):
    include_usage: NotRequired[
        Annotated[bool | None, Field(description="a last chunk with the token counts")]
    ]


@with_config(_OPEN)
class JSONSchemaFormat(TypedDict):
    name: NotRequired[str | None]
    schema: dict[str, Any]
    strict: NotRequired[bool | None]


@with_config(_OPEN)
class ResponseFormat(TypedDict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: NotRequired[JSONSchemaFormat | None]


# structured_outputs (vLLM's): an object with one of these
@with_config(_OPEN)
class Choice(TypedDict):
    choice: Annotated[list[Text], Field(min_length=1)]


@with_config(_OPEN)
class Regex(TypedDict):
    regex: Text


@with_config(_OPEN)
class Grammar(TypedDict):
    grammar: Text


@with_config(_OPEN)
class JSONObject(TypedDict):
    json_object: Literal[True]


@with_config(_OPEN)
class JSONOutput(TypedDict):
    json: dict[str, Any] | Text


# /v1/responses' own shapes
@with_config(_OPEN)
class InputPart(TypedDict):
    type: Any
    text: NotRequired[str | None]


@with_config(_OPEN)
class InputItem(TypedDict):
    type: NotRequired[Annotated[str | None, Field(description="default: message")]]
    role: NotRequired[str | None]
    content: NotRequired[str | list[InputPart] | None]
    call_id: NotRequired[str | None]
    name: NotRequired[str | None]
    arguments: NotRequired[str | None]
    output: NotRequired[str | None]


@with_config(_OPEN)
class FlatTool(TypedDict):
    type: Literal["function"]
    name: Text
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


@with_config(_OPEN)
class FlatToolChoice(TypedDict):
    type: Literal["function"]
    name: str


@with_config(_OPEN)
class TextFormat(TypedDict):
    type: Literal["text", "json_object", "json_schema"]
    name: NotRequired[str | None]
    schema: NotRequired[dict[str, Any] | None]


@with_config(_OPEN)
class TextOptions(TypedDict):
    format: NotRequired[TextFormat | None]
