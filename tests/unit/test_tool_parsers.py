"""Tool-call and reasoning parsers on recorded outputs of each format: whole, and streamed
in two pieces split at every offset and one character at a time, the deltas adding up to
the whole answer (content, thinking, calls)."""

from __future__ import annotations

import json

import pytest

from server import tools
from server.errors import APIError
from server.reply import Parsing, Reply

QWEN3_CALLS = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
)
# format, reasoning parser, output -> thinking, content, calls (name, arguments)
CASES = [
    (
        "hermes",
        "qwen3",
        QWEN3_CALLS,
        "\nThe user wants the weather.\n",
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")],
    ),
    ("hermes", None, "No tools: 1 < 2, a <tool tag.", "", "No tools: 1 < 2, a <tool tag.", []),
    (
        "hermes",
        None,
        '<tool_call>{"name": "say", "arguments": {"text": "h\\u00e9llo ✓ }"}}</tool_call>',
        "",
        None,
        [("say", '{"text": "h\\u00e9llo ✓ }"}')],
    ),
    # the model stopped at its end token before the closing tag
    (
        "hermes",
        None,
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',
        "",
        None,
        [("f", '{"a": 1}')],
    ),
    (
        "llama3_json",
        None,
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "noop", "parameters": {}}'
        ),
        "",
        None,
        [("get_weather", '{"city": "Paris"}'), ("noop", "{}")],
    ),
    ("llama3_json", None, "The answer is {4}.", "", "The answer is {4}.", []),
    # a call that leaves its arguments out takes none (vLLM's reading)
    ("hermes", None, '<tool_call>{"name": "get_time"}</tool_call>', "", None, [("get_time", "{}")]),
    ("llama3_json", None, '{"name": "noop"}', "", None, [("noop", "{}")]),
    (
        "required",
        None,
        '[{"name": "f", "parameters": {"x": [1, {"y": 2}]}}]',
        "",
        None,
        [("f", '{"x": [1, {"y": 2}]}')],
    ),
    (
        "hermes",
        "deepseek_r1",
        "think <b> hard</think>\n\nThe answer.",
        "think <b> hard",
        "The answer.",
        [],
    ),
    ("hermes", "qwen3", "No thinking here.", "", "No thinking here.", []),
    ("hermes", "deepseek_r1", "<think>cut off by max_tokens", "cut off by max_tokens", "", []),
]
# pythonic (Llama 3.2 / 4): Python literals, their JSON as the arguments
CASES += [
    (
        "pythonic",
        None,
        '[get_weather(city="San Francisco", metric="celsius"), '
        "get_time(timezone='Europe/Paris', offsets=[1, -2.5], detail={'tz': None, 'dst': True})]",
        "",
        None,
        [
            ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
            (
                "get_time",
                '{"timezone": "Europe/Paris", "offsets": [1, -2.5], '
                '"detail": {"tz": null, "dst": true}}',
            ),
        ],
    ),
    (
        "pythonic",
        None,
        "<|python_start|>[get_time()]<|python_end|>",
        "",
        None,
        [("get_time", "{}")],
    ),
    (
        "pythonic",
        None,
        '[say(text="a \\"quoted\\" ), [text]", n=3)]',
        "",
        None,
        [("say", '{"text": "a \\"quoted\\" ), [text]", "n": 3}')],
    ),
    ("pythonic", None, "The answer is 42 [citation].", "", "The answer is 42 [citation].", []),
]
# mistral: before v11 a JSON array; from v11 name{...} per call (with [ARGS], [CALL_ID])
CASES += [
    (
        "mistral",
        None,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        None,
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
        "[TOOL_CALLS]get_time[ARGS]{}",
        "",
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        None,
        '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}',
        "",
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("mistral", None, "No calls: [TOOL] [1].", "", "No calls: [TOOL] [1].", []),
]
# malformed calls: returned as content, never dropped
MALFORMED = [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call> after'),
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "argu'),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("pythonic", '[get_weather("Paris")]'),  # positional: no name for it
    ("pythonic", '[get_weather(city="Paris"]'),
    ("pythonic", "[get_weather(city=Paris)]"),  # a name, not a literal
    ("pythonic", "[f(x={1, 2})]"),  # a set has no JSON form
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[f(a=1)] and then some"),
    ("pythonic", "[f(a=1)"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": }'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": [1]}]'),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"a": 1} and more'),
    ("mistral", "[TOOL_CALLS]get_weather"),
]


def whole(parsing: Parsing, text: str) -> tuple[str, str | None, list[tuple[str, str]]]:
    message, _ = Reply(parsing).message(text)
    assert message.get("reasoning") == message.get("reasoning_content")  # vLLM's both names
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    return message.get("reasoning_content") or "", message["content"], calls


def streamed(parsing: Parsing, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reply, deltas = Reply(parsing), []
    for i, piece in enumerate(pieces):
        deltas.append(reply.delta(piece, final=i == len(pieces) - 1))
        assert deltas[-1].get("reasoning") == deltas[-1].get("reasoning_content")
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            if "id" in piece:  # the first piece of a call: id, type and name
                assert piece["index"] == len(calls) and piece["type"] == "function"
                if parsing.tools == "mistral":  # (Mistral's templates take no other ids)
                    assert len(piece["id"]) == 9 and piece["id"].isalnum()
                else:
                    assert piece["id"].startswith("call_")
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
    return thought, content, [(n, a) for n, a in calls.values()]


def splits(text: str) -> list[list[str]]:
    return [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text) + [""]]


@pytest.mark.parametrize(("fmt", "think", "text", "thought", "content", "calls"), CASES)
def test_recorded_outputs(fmt, think, text, thought, content, calls):
    parsing = Parsing(reasoning=think, tools=fmt)
    assert whole(parsing, text) == (thought, content, calls)
    for arguments in (a for _, a in calls):
        json.loads(arguments)
    for pieces in splits(text):
        got = streamed(parsing, pieces)
        # a stream's content keeps the whitespace around calls that the message trims
        assert (got[0], got[1].strip() or None, got[2]) == (thought, content or None, calls) or (
            got == (thought, content, calls)
        ), pieces


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_calls_stay_content(fmt, text):
    parsing = Parsing(tools=fmt)
    assert whole(parsing, text) == ("", text, [])
    for pieces in splits(text):
        # a stream may have begun a call before it broke; its text still ends as content
        assert streamed(parsing, pieces)[1] == text, pieces


def test_one_call_unless_parallel():
    parsing = Parsing(reasoning="qwen3", tools="hermes", parallel=False)
    assert [name for name, _ in whole(parsing, QWEN3_CALLS)[2]] == ["get_weather"]
    assert [name for name, _ in streamed(parsing, list(QWEN3_CALLS))[2]] == ["get_weather"]


def test_named_function_streams_its_arguments():
    parsing = Parsing(tools="named", function="f")
    assert whole(parsing, '{"a": 1}') == ("", None, [("f", '{"a": 1}')])
    assert streamed(parsing, ["{", '"a"', ": 1}", ""])[2] == [("f", '{"a": 1}')]


def test_forced_arguments_close_objects_left_open_by_omission():
    inner = {"type": "object", "properties": {"properties": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"where": inner, "tags": {"type": "array", "items": inner}},
        "required": ["where"],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    closed = tools.parameters(tool)
    assert closed["additionalProperties"] is False and closed["required"] == ["where"]
    # (a property named "properties" is a property, not a keyword)
    assert closed["properties"]["where"] == {**inner, "additionalProperties": False}
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    opened = {**schema, "additionalProperties": True}
    tool["function"]["parameters"] = opened
    assert tools.parameters(tool)["additionalProperties"] is True  # said so: stays open
    # OpenAI's strict mode: every property required, and an open object refused
    tool["function"] |= {"parameters": schema, "strict": True}
    assert tools.parameters(tool)["required"] == ["where", "tags"]
    assert tools.parameters(tool)["properties"]["where"]["required"] == ["properties"]
    tool["function"]["parameters"] = opened
    with pytest.raises(APIError, match="additionalProperties") as refused:
        tools.parameters(tool)
    assert refused.value.param == "tools"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}", "hermes"),
        ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]", "mistral"),
        (
            "Respond in the format [func_name1(params_name1=params_value1, "
            "params_name2=params_value2...), func_name2(params)]",
            "pythonic",
        ),
        (
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. {{- '<|python_tag|>' }}",
            "llama3_json",
        ),
        ({"default": "{{ messages }}", "tool_use": "<tool_call>"}, "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_the_format_a_template_teaches_is_detected(template, fmt):
    assert tools.detect(template) == fmt
