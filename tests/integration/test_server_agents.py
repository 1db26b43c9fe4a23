"""What agents send, against a real server on the tiny Qwen3 with a tool-aware chat
template (--chat-template), the hermes tool-call parser and the qwen3 reasoning parser,
driven by the official SDK: tool calls (required and named, forced by the grammar; auto,
parsed), streamed deltas re-assembled by the SDK, /tokenize and /detokenize, deadlines."""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine
from server.parse import Options

# Qwen3's tool conventions, short: tools in a system turn, calls as <tool_call> JSON; and a
# loop of `spin` thousand rounds first (a chat_template_kwargs variable): a slow template
TEMPLATE = """\
{%- for _ in range(spin or 0) %}{% for _ in range(1000) %}{% endfor %}{% endfor %}
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls is defined %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "a forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 200}
# what a Qwen3 answer that thinks, talks and calls a tool looks like; a tiny random model
# writes it when a grammar makes it
RECORDED = (
    "<think>Paris, then.</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
CONFIG = dict(block_size=16, max_seq_len=1024, max_batch_size=8, dtype="float32", warmup=False)


@pytest.fixture(scope="module")
def server(loaded, serve):
    options = Options(TEMPLATE, "hermes", "qwen3", priorities=True)
    with serve(Engine(loaded("qwen3"), EngineConfig(**CONFIG)), options=options) as served:
        yield served


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_and_named_calls_are_valid_for_their_schema(sdk, server):
    # (parallel calls: a random model adds calls to the array until max_tokens)
    done = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = calls(choice.message)
    if name == "get_weather":
        jsonschema.validate(arguments, WEATHER)
    else:
        assert name == "get_time" and arguments == {}
    named = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    )
    [(name, arguments)] = calls(named.choices[0].message)
    # a named call is the whole answer: "stop", as OpenAI and vLLM give it
    assert name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(arguments, WEATHER)
    # streamed, re-assembled by the SDK's helper: the same call as the answer in one piece
    with sdk.chat.completions.stream(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    ) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 1  # the arguments came in pieces
    assert calls(final.choices[0].message) == [(name, arguments)]
    assert final.choices[0].message.tool_calls[0].id.startswith("call_")
    server.assert_idle()


def test_auto_parses_thinking_text_and_calls(sdk, client):
    # the grammar makes the tiny model write RECORDED; the hermes and qwen3 parsers read it
    forced = {"structured_outputs": {"choice": [RECORDED]}}
    done = sdk.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, extra_body=forced, **GREEDY
    )
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert message.model_extra["reasoning_content"] == "Paris, then."
    assert calls(message) == [("get_weather", {"city": "Paris", "days": 2})]
    with sdk.chat.completions.stream(
        model="tiny", messages=ASK, tools=TOOLS, extra_body=forced, **GREEDY
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert thought == "Paris, then." and final.choices[0].finish_reason == "tool_calls"
    assert calls(final.choices[0].message) == calls(message)
    assert final.choices[0].message.content.strip() == "Checking."
    # a call whose arguments do not parse is content, never a 500
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "tools": TOOLS,
            "structured_outputs": {"choice": [broken]},
            **GREEDY,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == broken
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    # streamed, the call's name went out before its JSON broke: it ends as the answer did
    with sdk.chat.completions.stream(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        extra_body={"structured_outputs": {"choice": [broken]}},
        **GREEDY,
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == broken


def test_a_tool_loop_renders_into_the_template(client):
    """The assistant's call and the tool's answer round-trip into the template (arguments
    as the object they encode); chat_template_kwargs reach it."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {
        "messages": messages,
        "tools": TOOLS[1:],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["count"] == len(doc["tokens"]) and doc["max_model_len"] == 1024
    text = client.post("/detokenize", json={"tokens": doc["tokens"]}).json()["prompt"]
    assert text == (
        '<|im_start|>system\n{"type": "function", "function": {"name": "get_time"}}\n<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 1}}</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response id="call_1">sunny</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # the chat route renders the same prompt
    chat = client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == doc["count"]
    prompt = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert client.post("/detokenize", json={"tokens": prompt["tokens"]}).json() == {
        "prompt": "héllo"
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"messages": ASK, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": ASK, "priority": "high"}, "priority"),
        ({"messages": ASK, "timeout": 0}, "timeout"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(client, body, param):
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("body", "param"), [({}, "prompt"), ({"prompt": "a", "messages": ASK}, "prompt")]
)
def test_bad_tokenize_is_a_400(client, body, param):
    r = client.post("/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/detokenize", json={"tokens": [320]}).json()["error"]["param"] == "tokens"


def spin_for(seconds: float) -> int:
    """The `spin` that keeps this machine's Jinja busy `seconds` or more (CPUs differ: a
    fixed count ran in under a second on one), timed at its fastest of a few renders: one
    timed while another test worker held the core ran 0.6 s where 1.5 were asked."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    loop = ImmutableSandboxedEnvironment().from_string(TEMPLATE.splitlines()[0])
    fastest = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        loop.render(spin=200)
        fastest = min(fastest, time.perf_counter() - start)
    return int(seconds * 200 / fastest) + 1


def test_a_slow_template_does_not_stall_other_streams(client, server):
    """Templating runs off the event loop: while a template loops for a second or more,
    another stream's tokens keep coming."""
    arrivals: list[float] = []
    flowing, done = threading.Event(), threading.Event()

    def read() -> None:
        # (a completion: no parser holds its text back)
        body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as other,
            other.stream("POST", "/v1/completions", json=body) as events,
        ):
            for _ in events.iter_lines():
                arrivals.append(time.monotonic())
                if len(arrivals) == 8:
                    flowing.set()
                if done.is_set():
                    return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert flowing.wait(60)
        start = time.monotonic()
        # refused once rendered (the prompt leaves no room for max_tokens): no step of its
        # own, so the other stream's gaps are the template's doing alone
        spin = {"spin": spin_for(1.5)}
        slow = {"messages": ASK, "max_tokens": 1023, "chat_template_kwargs": spin}
        r = client.post("/v1/chat/completions", json=slow)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        end = time.monotonic()
    finally:
        done.set()
        reader.join(60)
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > start and a < end]
    assert end - start > 1, "the template was not slow: the test shows nothing"
    assert gaps and max(gaps) < 0.3 * (end - start), (max(gaps), end - start)
    server.assert_idle()


def test_a_deadline_ends_a_request_with_408_and_frees_it(client, server):
    body = {"messages": ASK, "max_tokens": 400, "timeout": 0.05, "priority": 1}
    body |= {"ignore_eos": True, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 408 and r.json()["error"]["param"] == "timeout", r.text
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    server.assert_idle()


def test_required_calls_cut_by_max_tokens_are_the_whole_ones(sdk):
    """tool_choice "required" cut by max_tokens (a random model adds calls to the array until
    then): the calls written whole, finish_reason "length", no JSON text as content; the
    stream's last chunk says the same and sends no content either."""
    request: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0
    )
    done = sdk.chat.completions.create(max_tokens=60, **request)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content, choice
    assert choice.message.tool_calls
    for name, arguments in calls(choice.message):
        assert name == "get_time" or jsonschema.validate(arguments, WEATHER) is None
    chunks = list(sdk.chat.completions.create(max_tokens=60, stream=True, **request))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.content for c in chunks), chunks


def test_responses_api(sdk):
    text = sdk.responses.create(
        model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=5, temperature=0
    )
    assert text.status == "incomplete" and text.incomplete_details.reason == "max_output_tokens"
    assert text.output[0].type == "message" and text.output_text
    assert text.usage.output_tokens == 5
    forced = sdk.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    [call] = forced.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    shaped = sdk.responses.create(
        model="tiny",
        input="A forecast as JSON",
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        temperature=0,
    )
    jsonschema.validate(json.loads(shaped.output_text), WEATHER)
    # a second turn: the call and its output go back as input items
    follow = sdk.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        max_output_tokens=3,
        temperature=0,
    )
    assert follow.output[0].type == "message"
    with pytest.raises(openai.BadRequestError) as stored:
        sdk.responses.create(model="tiny", input="Hi", previous_response_id="resp_1")
    assert stored.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(model="tiny", input=[{"type": "image", "url": "x"}])
    assert bad.value.param == "input" and "input[0].type" in bad.value.message


def test_responses_stream_events(sdk):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    with sdk.responses.stream(
        model="tiny",
        input="Weather?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with sdk.responses.stream(model="tiny", input="Hi", max_output_tokens=4, temperature=0) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # OpenAI's last event when cut short
    assert "".join(deltas) == events[-1].response.output_text and deltas


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_agent_framework_runs_a_tool_loop(server, api):
    """openai-agents: the model calls the tool (forced for the first turn), the tool's answer
    goes back, the model answers (tool_choice is reset after a call) in the agent's output
    type (a JSON schema: the grammar ends the tiny model's answer, which max_tokens would
    cut, an error for the Responses API)."""
    import agents
    import pydantic

    class Forecast(pydantic.BaseModel):
        sky: Literal["sunny", "rainy"]

    agents.set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: Literal[1, 2, 3]) -> str:
        """The forecast for a city."""
        seen.append((city, days))
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    kind = (
        agents.OpenAIChatCompletionsModel
        if api == "chat_completions"
        else agents.OpenAIResponsesModel
    )
    agent = agents.Agent(
        name="forecaster",
        instructions="Use the tool.",
        tools=[get_weather],
        output_type=Forecast,
        model=kind(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0
        ),
    )
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0][0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(result.final_output, Forecast)
    server.assert_idle()
