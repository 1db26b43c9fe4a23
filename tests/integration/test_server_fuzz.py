"""GET /openapi.json, and hypothesis drawing requests from it (and broken ones) at a live server.

Whatever comes in: never a 5xx, never a hung connection (every request has a
client timeout), an OpenAI-shaped error for every 4xx, strict JSON (no NaN) for
every success, and at the end the server is alive with every KV block free.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.common import fetch_metrics
from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.engine import Engine
from server.app import APIError, build_app
from server.openapi import POSTS

# test_server.py's engine shape, so a run of both compiles each program once
CONFIG = dict(
    backend="paged",
    block_size=16,
    max_seq_len=128,
    max_batch_size=16,
    max_waiting_requests=64,
    dtype="float32",
    warmup=False,
)
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
# A valid request may still fail on the prompt's length, which no schema can say
CONTEXT = {"prompt", "messages", "max_tokens", "max_completion_tokens"}
# texts a schema cannot tell valid from invalid: regular expressions, grammars, JSON schemas
# (response formats, tools' parameters), tool calls' JSON arguments, template variables; and
# a tool_choice the tools or the server's flags do not allow
GRAMMAR_FIELDS = (
    "structured_outputs.",
    "response_format",
    "tools",
    "tool_choice",
    "messages",
    "chat_template_kwargs",
)
# what keeps a drawn request cheap on a CPU: tokens, choices, list and string lengths, and
# alternatives (more than 5 compile sampler variants of their own)
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 4, "top_logprobs": 5}
# derandomized: CI draws the same examples every run; a live server is slow for hypothesis
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def server(model, serve):
    with serve(Engine(model, EngineConfig(**CONFIG))) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:  # a hang fails the test
        yield c


@pytest.fixture(scope="module")
def schemas(client) -> dict[str, dict]:
    r = client.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()["components"]["schemas"]


def strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in a response: not JSON")

    return json.loads(text, parse_constant=refuse)


def post(
    client: httpx.Client,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    content_type: str | None = "application/json",
) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": content_type} if content_type else {}
    with client.stream("POST", path, content=content, headers=headers) as r:
        r.read()
    return r


def check(r: httpx.Response) -> dict | list | None:
    """The properties every answer has; -> the error, the document or the SSE chunks."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = strict(r.text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error"
        return error
    assert r.status_code == 200, r.text
    if not r.headers["content-type"].startswith("text/event-stream"):
        doc = strict(r.text)
        assert doc["choices"] and "usage" in doc
        return doc
    assert r.text.endswith("\n\n")
    raw = r.text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in raw), raw
    assert raw[-1] == "data: [DONE]", raw[-3:]  # an error event comes before it: see below
    chunks = [strict(e.removeprefix("data: ")) for e in raw[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


# ------------------------------------------------------------------------ the document


def test_openapi_document_lists_every_route(client, schemas):
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/metrics",
        "/openapi.json",
    }
    for path, (name, _) in POSTS.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert name in schemas
    # what agents send (test_server_agents.py serves them)
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"} <= set(chat)
    assert {"priority", "timeout"} <= set(chat) & set(schemas["CompletionRequest"]["properties"])
    assert chat["priority"]["maximum"] == 0  # without --scheduling-policy priority
    assert schemas["ResponsesRequest"]["required"] == ["input"]
    assert schemas["EmbeddingRequest"]["required"] == ["input"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    props = schemas["CompletionRequest"]["properties"]
    # the ranges are the engine's: test_server.py's CONFIG and the tiny model's vocabulary
    assert props["max_tokens"]["maximum"] == 127 and props["n"]["maximum"] == 16
    assert props["prompt"]["anyOf"][1]["items"]["maximum"] == 319
    assert [p["maxItems"] for p in props["prompt"]["anyOf"][2:4]] == [64, 64]  # a batch
    assert props["max_tokens"]["minimum"] == 0 and props["echo"]["type"] == ["boolean", "null"]
    assert props["model"]["anyOf"][:-1] == [{"const": "tiny"}]
    assert props["temperature"]["default"] == 0.6  # the checkpoint's generation_config
    assert props["stop"]["anyOf"][1]["maxItems"] == 16
    assert props["top_p"]["type"] == ["number", "null"]  # null = left out


WRONG = [[[]]]  # fits no field: not a scalar, an object, a string array nor a token array


def test_the_published_fields_are_the_validated_fields(server, schemas):
    """What the parsers read of a body is exactly the published schema's fields (their
    models'), and each of those is checked: a value of the wrong shape is a 400 naming it."""
    parsers = build_app(AsyncEngine(server.engine), "tiny").state.parsers  # not started
    parser = parsers["/v1/completions"].__self__
    valid = {
        "/v1/completions": {"prompt": "hi"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    }
    for path, name in ROUTES.items():
        fields = set(schemas[name]["properties"])
        assert set(parser.requests[name].model_fields) == fields
        parsers[path]({**valid[path], "frequency_penalty": 0, "user": "x"})
        assert "user" in parser.ignored  # a field no route reads is logged, once
        for field in fields:
            with pytest.raises(APIError) as exc:
                parsers[path]({**valid[path], field: WRONG})
            assert exc.value.status == 400 and exc.value.param == field


def test_the_other_routes_refuse_each_bad_field_by_name(client, schemas):
    """/v1/responses, /v1/embeddings, /tokenize and /detokenize: a valid body is served, and
    any of its published fields given a wrong value is a 400 naming that field."""
    valid = {
        "/v1/responses": {"input": "hi", "max_output_tokens": 1},
        "/v1/embeddings": {"input": "hi"},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [5]},
    }
    for path, body in valid.items():
        assert post(client, path, body).status_code == 200, path
        for field in schemas[POSTS[path][0]]["properties"]:
            r = post(client, path, {**body, field: WRONG})
            assert r.status_code == 400 and check(r)["param"] == field, (path, field, r.text)


def step(x: float, kind: str, direction: int) -> float:
    """The next integer or double from `x` in `direction` (1 or -1)."""
    return x + direction if kind == "integer" else math.nextafter(x, direction * math.inf)


def test_ranges_at_their_bounds(client, schemas):
    """At each numeric bound of the completion schema: the bound is served, one step past
    it is a 400 naming the field."""
    base = {"prompt": [5], "max_tokens": 1, "temperature": 0, "echo": True}  # max_tokens 0
    for field, spec in schemas["CompletionRequest"]["properties"].items():
        kind = spec.get("type", [None])[0]
        if kind not in ("integer", "number"):
            continue
        inside, outside = [], []
        if "minimum" in spec:
            inside.append(spec["minimum"])
            outside.append(step(spec["minimum"], kind, -1))
        if "exclusiveMinimum" in spec:
            inside.append(step(spec["exclusiveMinimum"], kind, 1))
            outside.append(spec["exclusiveMinimum"])
        if "maximum" in spec:
            inside.append(spec["maximum"])
            outside.append(step(spec["maximum"], kind, 1))
        assert inside and outside, field
        # min_tokens is bounded by max_tokens too: give it the room its bound needs
        room = {"max_tokens": spec["maximum"]} if field == "min_tokens" else {}
        for value in inside:
            r = post(client, "/v1/completions", {**base, **room, field: value})
            # the shortest deadline passes before any answer
            assert r.status_code == (408 if field == "timeout" else 200), (field, value, r.text)
            check(r)
        for value in outside:
            r = post(client, "/v1/completions", {**base, **room, field: value})
            error = check(r)
            assert r.status_code == 400 and isinstance(error, dict), (field, value, r.text)
            assert error["param"] == field, (value, error)


# ------------------------------------------------------------------------ the fuzzing


def from_schema(schema: dict, cap: int | None = None) -> st.SearchStrategy[Any]:
    """Values that fit a published schema (the keywords the server uses)."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s, cap) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return st.one_of([_typed(kind, schema, cap) for kind in kinds])


def _typed(kind: str, s: dict, cap: int | None) -> st.SearchStrategy[Any]:
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        hi = s.get("maximum")
        return st.integers(s.get("minimum"), hi if cap is None or hi is None else min(cap, hi))
    if kind == "number":
        return st.floats(
            s.get("minimum", s.get("exclusiveMinimum")),
            s.get("maximum"),
            exclude_min="exclusiveMinimum" in s,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        return st.text(min_size=s.get("minLength", 0), max_size=12)
    if kind == "array":
        return st.lists(
            from_schema(s["items"]),
            min_size=s.get("minItems", 0),
            max_size=min(s.get("maxItems", 3), 3),
        )
    assert kind == "object", kind
    props, required = s.get("properties", {}), s.get("required", [])
    return st.fixed_dictionaries(
        {k: from_schema(props[k]) for k in required},
        optional={k: from_schema(v, CAPS.get(k)) for k, v in props.items() if k not in required},
    )


@st.composite
def valid_requests(draw: st.DrawFn, schemas: dict[str, dict]) -> tuple[str, dict]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = draw(from_schema(schemas[ROUTES[path]]))
    body["stream"] = draw(st.booleans())  # half the responses are SSE, whatever the shrinker does
    if not body["stream"]:
        body.pop("stream_options", None)  # only allowed with a stream
    if body.get("max_tokens") == 0:
        body["echo"] = True  # the prompt alone: only with echo
    body.pop("timeout", None)  # a deadline may pass first: HTTP 408 (test_server_agents.py)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        # a chat's default fills the context: too slow here
        body["max_tokens"] = draw(st.integers(1, CAPS["max_tokens"]))
    # what the schema cannot say: one way to constrain the output, and min_tokens within
    # max_tokens and never with a grammar (a complete output allows only EOS)
    if body.get("structured_outputs") is not None:
        body.pop("response_format", None)
    limit = next(
        body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None
    )
    constrained = (
        body.get("structured_outputs") is not None
        or (body.get("response_format") or {}).get("type", "text") != "text"
    )
    if body.get("min_tokens"):
        body["min_tokens"] = 0 if constrained else min(body["min_tokens"], limit)
    if body.get("use_beam_search"):  # a search answers at its end, its output unconstrained
        body.update(stream=False, echo=False, max_tokens=max(1, body.get("max_tokens") or 1))
        for field in ("stream_options", "structured_outputs", "response_format", "logprobs"):
            body.pop(field, None)
    return path, body


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers()
    | st.integers(2**31, 2**200)
    | st.integers(-(2**200), -1)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def test_requests_drawn_from_the_schema_are_served(client, schemas):
    @settings(FUZZ, max_examples=60)
    @given(valid_requests(schemas))
    def run(request: tuple[str, dict]) -> None:
        path, body = request
        r = post(client, path, body)
        got = check(r)
        if r.status_code == 400 and got["param"].startswith(GRAMMAR_FIELDS):
            return
        if r.status_code == 400:  # else only the prompt's length may still be refused
            assert isinstance(got, dict) and got["param"] in CONTEXT, got
            assert got["code"] == "context_length_exceeded", got
        elif isinstance(got, dict):
            prompt = body.get("prompt")
            batch = isinstance(prompt, list) and isinstance(prompt[0], str | list)
            assert len(got["choices"]) == (body.get("n") or 1) * (len(prompt) if batch else 1)

    run()


def test_broken_fields_are_refused_cleanly(client, schemas):
    """A valid request with one field replaced by any JSON, fields added, or a required one
    taken away: a 200 or a 400 that names a field of the schema."""

    @st.composite
    def broken(draw: st.DrawFn) -> tuple[str, dict, str | None]:
        path, body = draw(valid_requests(schemas))
        fields = schemas[ROUTES[path]]["properties"]
        how = draw(st.sampled_from(["replace", "add", "drop"]))
        if how == "replace":
            body[draw(st.sampled_from(sorted(fields)))] = draw(JSON)
        elif how == "add":
            body |= draw(
                st.dictionaries(
                    st.text(max_size=12).filter(lambda k: k not in fields),
                    JSON,
                    min_size=1,
                    max_size=3,
                )
            )
        else:
            (required,) = schemas[ROUTES[path]]["required"]
            del body[required]
            return path, body, required
        return path, body, None

    @settings(FUZZ, max_examples=80)
    @given(broken())
    def run(request: tuple[str, dict, str | None]) -> None:
        path, body, dropped = request
        r = post(client, path, body)
        got = check(r)
        if dropped:
            assert r.status_code == 400 and isinstance(got, dict) and got["param"] == dropped
        elif r.status_code == 400:
            assert isinstance(got, dict)
            # a field of the schema, or one inside it (`structured_outputs.regex`)
            assert got["param"].split(".")[0] in schemas[ROUTES[path]]["properties"], got

    run()


NASTY = [
    b"",
    b" ",
    b"null",
    b"[]",
    b'"prompt"',
    b"NaN",
    b"Infinity",
    b'{"prompt": NaN}',
    b'{"prompt": "a", "temperature": Infinity}',
    b'{"prompt": "a", "temperature": -Infinity}',
    b'{"prompt": "a", "temperature": 1e999}',
    b'{"prompt": "a", "max_tokens": 1e999}',
    b'{"prompt": "a", "top_k": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "a", "seed": ' + b"9" * 4000 + b"}",
    b"[" * 100_000,
    b'{"a":' * 50_000,
    b'{"prompt": "\\ud800"}',
    b'{"prompt": ["\\udfff"]}',
    b'{"prompt": "a", "stop": "\\udc00"}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
    b'{"messages": [{"role": "\\ud800", "content": "hi"}]}',
    b'{"prompt": "a", "user": "\\ud800"}',
    b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
    b'\xff\xfe{"prompt": "a"}',
    b'{"prompt": "a"',
    b'{"prompt": "a", "prompt": 5}',
    b'{"prompt": "tab\there"}',
    b'{"prompt": "a\\u0000b", "max_tokens": 1}',
    b'{"prompt": "a", "max_tokens": 1.0}',
    b'{"prompt": "a", "n": true}',
    b'{"prompt": [[1, 2]], "max_tokens": 1}',
    b'{"prompt": [1e3], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": "user", "content": null}]}',
    b'{"messages": [{}]}',
]
CONTENT_TYPES = [
    None,
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-16",
]


def test_malformed_bodies_are_refused_cleanly(client):
    bodies = (
        st.sampled_from(NASTY)
        | st.binary(max_size=64)
        | JSON.map(lambda v: json.dumps(v).encode())
        | st.text(max_size=40).map(str.encode)
    )

    @settings(FUZZ, max_examples=60)
    @given(st.sampled_from(sorted(ROUTES)), bodies, st.sampled_from(CONTENT_TYPES))
    def run(path: str, raw: bytes, content_type: str | None) -> None:
        check(post(client, path, raw=raw, content_type=content_type))

    run()
    for raw in NASTY:  # every one of them, whatever hypothesis picked
        for path in ROUTES:
            check(post(client, path, raw=raw))


def test_other_routes_and_methods_get_openai_errors(client):
    for method, path, status in [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/models", 405),
        ("DELETE", "/health", 405),
        ("GET", "/v2/completions", 404),
        ("GET", "/v1/models/gpt-4o", 404),
        ("POST", "/openapi.json", 405),
        ("GET", "/", 404),
    ]:
        r = client.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        check(r)


def test_server_is_alive_and_every_block_free(server, client):
    """Last: whatever the fuzzing did, the server serves and holds nothing."""
    assert client.get("/health").status_code == 200
    r = post(client, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:
        values = fetch_metrics(client)
        if values["kv_blocks_used"] == values["running"] == 0:
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.05)
    assert server.engine.cache.audit() == []
    assert values["requests_failed"] == 0  # no request failed inside the engine
