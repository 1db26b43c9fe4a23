"""Tools: the grammar that forces a call, and tool calls in a model's text: a parser per
output format, for whole answers and for streams (each call's name as soon as it is known,
its arguments as they grow).

Formats (`--tool-call-parser`, vLLM's names): `hermes`, `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` (Qwen 2.5 / 3, Hermes); `llama3_json`, an answer that is one or more
`{"name": ..., "parameters": {...}}` objects separated by `;` (Llama 3.1+ JSON calls);
`pythonic`, an answer that is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4); `mistral`, content then
`[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}` objects (tokenizers before
v11) or `name{...}` per call, each after its own `[TOOL_CALLS]` (`[CALL_ID]id` and `[ARGS]`
between the two, as later tokenizers write them). Two more are the server's own, for
outputs a grammar forced: `required`, a JSON array of such objects (`tool_choice:
"required"`), and `named`, the arguments alone (a named function). Without
--tool-call-parser, `detect` names the format a chat template teaches, if it knows it.

A parse of a prefix of the text is a prefix of the parse of the whole: content and every
call's arguments only grow. Arguments are the model's own JSON text, never re-serialized,
so streamed pieces add up to the final arguments; pythonic arguments are Python, turned
into JSON one whole keyword argument at a time (so they too only grow). Text that may
still become a call's opening (a partial `<tool_call>`) is held back until it is known.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.errors import APIError

FORMATS = ("hermes", "llama3_json", "pythonic", "mistral")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARGS = ("arguments", "parameters")
_WS = " \t\n\r"
_decoder = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str | None  # None until the model has written it whole
    arguments: str = ""  # the JSON text of the arguments, so far
    done: bool = False  # the call's object is closed


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class _Bad(Exception):
    """Not a call: the text breaks the call's syntax."""


def held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _skip(text: str, pos: int, chars: str = _WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _scan(text: str, pos: int, final: bool) -> tuple[ToolCall, int | None]:
    """The call object starting at `pos`: the call so far and the end of its object (None
    while it is open). Raises _Bad on broken syntax, or on an open object when `final`."""
    call = ToolCall(None)

    def value(at: int) -> tuple[object, int] | None:
        try:
            return _decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if final:
                raise _Bad from None
            return None  # not written whole yet

    pos = _skip(text, pos)
    if pos < len(text) and text[pos] != "{":
        raise _Bad
    pos += 1
    while True:
        pos = _skip(text, pos, _WS + ",")
        if pos >= len(text):
            break
        if text[pos] == "}":
            if call.name is None:
                raise _Bad  # an object, but not a call
            if not call.done:  # a call of a function that takes nothing (vLLM's reading)
                call.arguments, call.done = "{}", True
            return call, pos + 1
        key = value(pos)
        if key is None:
            break
        pos = _skip(text, key[1])
        if pos < len(text) and text[pos] != ":" or not isinstance(key[0], str):
            raise _Bad
        pos = _skip(text, pos + 1)
        if pos >= len(text):
            break
        got = value(pos)
        if key[0] in _ARGS:
            if got is None:
                call.arguments = text[pos:]
                break
            if not isinstance(got[0], dict):
                raise _Bad
            call.arguments, call.done = text[pos : got[1]], True
        elif got is None:
            break
        elif key[0] == "name":
            if not isinstance(got[0], str):
                raise _Bad
            call.name = got[0]
        pos = got[1]
    if final:
        raise _Bad
    call.done = False
    return call, None


def _objects(text: str, pos: int, final: bool, between: str) -> list[ToolCall]:
    """Call objects from `pos` on, separated by `between` characters (and whitespace)."""
    calls: list[ToolCall] = []
    while True:
        pos = _skip(text, pos, _WS + between)
        if pos >= len(text):
            if final and not calls:
                raise _Bad
            return calls
        call, end = _scan(text, pos, final)
        calls.append(call)
        if end is None:
            return calls
        pos = end


def _hermes(text: str, final: bool) -> Parsed:
    out, pos = Parsed(), 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            rest = text[pos:]
            out.content += rest if final else rest[: len(rest) - held(rest, _OPEN)]
            return out
        out.content += text[pos:start]
        end = text.find(_CLOSE, start)
        body = text[start + len(_OPEN) : end if end >= 0 else len(text)]
        closed = end >= 0 or final  # a model may stop at its end token before the tag
        try:
            found = _objects(body, 0, closed, "")
        except _Bad:
            if not closed:  # broken already: shown as content once it closes
                return out
            out.content += text[start : end + len(_CLOSE) if end >= 0 else len(text)]
        else:
            out.calls += found
        if end < 0:
            return out
        pos = end + len(_CLOSE)


def _llama3_json(text: str, final: bool) -> Parsed:
    start = _skip(text, 0)
    if text.startswith("<|python_tag|>", start):
        start = _skip(text, start + len("<|python_tag|>"))
    if start == len(text) and not final:
        return Parsed()  # nothing yet says whether it is a call
    if not text.startswith("{", start):
        return Parsed(text)
    try:
        return Parsed("", _objects(text, start, final, ";"))
    except _Bad:
        return Parsed(text if final else "")


_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_PY_OPEN, _PY_CLOSE = "<|python_start|>", "<|python_end|>"  # Llama 4 wraps its calls
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def _python_value(text: str, pos: int, final: bool) -> int | None:
    """The end of the Python literal at `pos` (where a top-level `,` or `)` follows it),
    None while it is still being written. Raises _Bad on a bracket that does not match."""
    stack: list[str] = []
    quote = ""
    i = pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _BRACKETS:
            stack.append(_BRACKETS[c])
        elif c in ")]}" and stack:
            if c != stack.pop():
                raise _Bad
        elif c in ",)" and not stack:
            return i
        elif c in "]}":
            raise _Bad
        i += 1
    if final:
        raise _Bad
    return None


def _python_json(literal: str) -> str:
    """A Python literal's JSON text; _Bad if it is not one, or has no JSON form."""
    try:
        value = ast.literal_eval(literal.strip())
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Bad from None


def _python_call(text: str, pos: int, final: bool) -> tuple[ToolCall | None, int | None]:
    """The call `name(key=value, ...)` at `pos`: the call so far (None until its name is
    whole) and the end of the call (None while it is open)."""
    name = _NAME.match(text, pos)
    if name is None or name.end() == len(text):
        if final or name is None and pos < len(text):
            raise _Bad
        return None, None
    pos = _skip(text, name.end())
    if pos == len(text):
        if final:
            raise _Bad
        return None, None
    if text[pos] != "(":
        raise _Bad
    call, parts, pos = ToolCall(name[0]), list[str](), pos + 1
    while True:
        pos = _skip(text, pos, _WS + ",")
        if pos < len(text) and text[pos] == ")":
            call.arguments, call.done = "{" + ", ".join(parts) + "}", True
            return call, pos + 1
        key = _NAME.match(text, pos)
        value_at = key and _skip(text, key.end())
        if key is None or value_at == len(text):
            if final or key is None and pos < len(text):
                raise _Bad
            break
        assert value_at is not None
        if text[value_at] != "=":  # (a positional argument has no name to give it)
            raise _Bad
        end = _python_value(text, value_at + 1, final)
        if end is None:
            break
        parts.append(f"{json.dumps(key[0])}: {_python_json(text[value_at + 1 : end])}")
        pos = end
    call.arguments = "{" + ", ".join(parts) if parts else ""
    return call, None


def _pythonic(text: str, final: bool) -> Parsed:
    start = _skip(text, 0)
    if text.startswith(_PY_OPEN, start):
        start = _skip(text, start + len(_PY_OPEN))
    rest = text[start:]
    if not final and (not rest or _PY_OPEN.startswith(rest)):
        return Parsed()  # nothing yet says whether it is a call
    if not rest.startswith("["):
        return Parsed(text)
    out, pos = Parsed(), start + 1
    try:
        while True:
            pos = _skip(text, pos, _WS + ",")
            if pos == len(text):
                if final:
                    raise _Bad
                return out
            if text[pos] == "]":
                tail = text[pos + 1 :].strip()
                if tail not in ("", _PY_CLOSE) and (final or not _PY_CLOSE.startswith(tail)):
                    raise _Bad  # text after the calls
                if final and not out.calls:
                    raise _Bad  # `[]`: no call, a list
                return out
            call, end = _python_call(text, pos, final)
            if call is not None:
                out.calls.append(call)
            if end is None:
                return out
            pos = end
    except _Bad:
        return Parsed(text if final else "")


_TOOL_CALLS, _ARGS_TAG, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral(text: str, final: bool) -> Parsed:
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return Parsed(text if final else text[: len(text) - held(text, _TOOL_CALLS)])
    out = Parsed(text[:start])
    pos = _skip(text, start + len(_TOOL_CALLS))
    try:
        if text.startswith("[", pos):  # before v11: a JSON array of calls
            out.calls = _objects(text, pos + 1, final, ",]")
            return out
        while True:  # v11 on: name{...} per call, each after its own [TOOL_CALLS]
            if pos == len(text):
                if final:
                    raise _Bad
                return out
            name = _NAME.match(text, pos)
            if name is None or name.end() == len(text):
                if final or name is None:
                    raise _Bad
                return out
            pos = name.end()
            if text.startswith(_CALL_ID, pos):  # (an id the model made up: ours replace it)
                pos = text.find(_ARGS_TAG, pos)
                if pos < 0:
                    if final:
                        raise _Bad
                    return out
            if text.startswith(_ARGS_TAG, pos):
                pos += len(_ARGS_TAG)
            elif _ARGS_TAG.startswith(text[pos:]) or _CALL_ID.startswith(text[pos:]):
                if final:
                    raise _Bad
                return out
            pos = _skip(text, pos)
            call = ToolCall(name[0])
            out.calls.append(call)
            if pos == len(text):
                if final:
                    raise _Bad
                return out
            if text[pos] != "{":
                raise _Bad
            try:
                value, end = _decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                if final:
                    raise _Bad from None
                call.arguments = text[pos:]
                return out
            if not isinstance(value, dict):
                raise _Bad
            call.arguments, call.done = text[pos:end], True
            pos = _skip(text, end)
            if not text.startswith(_TOOL_CALLS, pos):
                rest = text[pos:]
                if rest and (final or not _TOOL_CALLS.startswith(rest)):
                    raise _Bad  # text after the calls
                return out
            pos = _skip(text, pos + len(_TOOL_CALLS))
    except _Bad:
        if not final:  # broken already: shown as content once the answer ends
            return Parsed(text[:start])
        return Parsed(text)


def detect(template: str | dict | None) -> str | None:
    """The tool-call format a chat template teaches its model, if it is one of FORMATS:
    what serves tool_choice "auto" when --tool-call-parser is not given (llama.cpp's
    server detects it likewise)."""
    if isinstance(template, dict):  # (Hugging Face's named templates: "default", "tool_use")
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not template:
        return None
    if _TOOL_CALLS in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if re.search(r"\[func_name1\(", template):  # Llama 3.2 / 4's pythonic instructions
        return "pythonic"
    if "<|python_tag|>" in template or re.search(r'"parameters": ?dictionary', template):
        return "llama3_json"
    return None


def parse(fmt: str, text: str, final: bool, function: str | None = None) -> Parsed:
    """`text` (the whole of it if `final`, else what has come so far) in format `fmt`.
    A call that does not parse is left in the content (a stream may have started it)."""
    if fmt == "hermes":
        return _hermes(text, final)
    if fmt == "llama3_json":
        return _llama3_json(text, final)
    if fmt == "pythonic":
        return _pythonic(text, final)
    if fmt == "mistral":
        return _mistral(text, final)
    if fmt == "named":
        return Parsed("", [ToolCall(function, text, final)])
    assert fmt == "required", fmt
    start = _skip(text, 0, _WS + "[")
    try:
        return Parsed("", _objects(text, start, final, ",]"))
    except _Bad:
        if not final:
            return Parsed("")
    # the grammar's array cut short in a call (max_tokens): the calls before it, whole
    try:
        calls = _objects(text, start, False, ",]")
    except _Bad:  # not the grammar's output after all
        return Parsed(text)
    return Parsed("", calls[:-1])


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON Schema of `tool_choice: "required"` outputs: an array of calls, each
    `{"name": ..., "parameters": {...}}` of one of `tools` (OpenAI's tool objects)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {
        "type": "array",
        "items": {"anyOf": calls},
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
    }


def parameters(tool: dict) -> dict:
    """The schema a forced call's arguments are generated from: the tool's (a function that
    declares none takes none: `{}`), its objects closed where it leaves them open by
    omission. An object that lists properties but says nothing of others takes no others,
    as llama.cpp's JSON-schema converter reads it: open, a small model invents properties
    until max_tokens cuts the JSON. `additionalProperties: true` (or a schema) still opens
    one. With OpenAI's `strict: true`, every property is also required, as OpenAI's strict
    mode makes them (and an object it opens is refused, as OpenAI refuses it)."""
    function = tool["function"]
    schema = function.get("parameters") or {"type": "object", "additionalProperties": False}
    return _closed(schema, function.get("strict") is True, function["name"])


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _closed(schema: Any, strict: bool, name: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], strict, name)
    for key in _SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, strict, name) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(s, strict, name) for k, s in out[key].items()}
    if isinstance(out.get("properties"), dict):
        more = out.setdefault("additionalProperties", False)
        if strict:
            if more is not False:
                raise APIError(
                    400,
                    f"tools: function `{name[:100]}` is strict, so its objects must set "
                    "additionalProperties to false",
                    "tools",
                )
            out["required"] = list(out["properties"])
    return out
