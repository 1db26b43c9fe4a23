"""Structured outputs and sampling controls over HTTP, on the demo model (SmolLM2)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
CHAT = {
    "messages": [{"role": "user", "content": "Name a city as JSON."}],
    "max_tokens": 40,
    "temperature": 0.7,
    "seed": 0,
}


@pytest.fixture(scope="module")
def client(demo_model, serve):
    config = EngineConfig(
        dtype="float32", max_seq_len=256, max_batch_size=8, warmup=False, compilation_cache_dir=None
    )
    with (
        serve(Engine(demo_model("smollm2-135m"), config), "smollm2") as served,
        httpx.Client(base_url=served.url, timeout=120) as c,
    ):
        yield c


def test_response_format_json_schema_on_both_routes(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    chat = client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt, "n": 2})
    assert chat.status_code == 200, chat.text
    texts = [c["message"]["content"] for c in chat.json()["choices"]]
    done = client.post(
        "/v1/completions",
        json={"prompt": "A city in JSON:", "max_tokens": 40, "response_format": fmt, "seed": 1},
    )
    texts.append(done.json()["choices"][0]["text"])
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"city", "rank"} and value["rank"] in (1, 2, 3)
    obj = client.post(
        "/v1/chat/completions",
        json={**CHAT, "response_format": {"type": "json_object"}, "max_tokens": 8},
    ).json()["choices"][0]
    # any object: cut by max_tokens, it is a prefix of one, and says so
    assert obj["finish_reason"] == "length" or isinstance(
        json.loads(obj["message"]["content"]), dict
    )
    assert obj["message"]["content"].startswith("{")


def test_vllm_structured_outputs(client):
    for extra, check in (
        ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"regex": "[A-Z][a-z]{2,5}"}, re.compile("[A-Z][a-z]{2,5}").fullmatch),
        ({"json": json.dumps(SCHEMA)}, json.loads),
    ):
        r = client.post(
            "/v1/completions",
            json={"prompt": "Pick one:", "max_tokens": 30, "structured_outputs": extra},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_cut_by_max_tokens_says_length(client):
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    r = client.post(
        "/v1/completions", json={"prompt": "JSON:", "max_tokens": 3, "response_format": fmt}
    )
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_penalties_and_bias_are_accepted(client):
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "Hello",
            "max_tokens": 5,
            "presence_penalty": 1,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"28": 100},
            "min_tokens": 2,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][0]["text"]
        == client.post(
            "/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 5,
                "logit_bias": {"28": 100},
                "temperature": 0,
            },
        ).json()["choices"][0]["text"]
    )  # a +100 bias wins whatever the penalties


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}
                    },
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_tokens": 50}, "min_tokens"),  # past max_tokens
    ],
)
def test_bad_fields_are_400s_naming_them(client, body, param):
    for route, base in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 8}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 8}),
    ):
        r = client.post(route, json={**base, **body})
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["param"] == param, (route, r.text)


def test_openapi_publishes_the_fields(client):
    doc = client.get("/openapi.json").json()
    text = json.dumps(doc)
    for name in (
        "response_format",
        "structured_outputs",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
    ):
        assert name in text


# what a client writes: no additionalProperties, which a small model reads as licence to go on
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL]}


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_closes_its_arguments(client, choice):
    """llama.cpp's reading of a schema without additionalProperties (closed): the demo
    model's forced call ends well inside 64 tokens with arguments that validate."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {**ASK, "tool_choice": named if choice == "named" else "required"}
    r = client.post(
        "/v1/chat/completions",
        json=body | {"max_tokens": 64, "temperature": 0.7, "seed": 0, "parallel_tool_calls": False},
    )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["finish_reason"] == ("stop" if choice == "named" else "tool_calls"), answer
    assert r.json()["usage"]["completion_tokens"] < 64
    [call] = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, {**WEATHER, "additionalProperties": False})
