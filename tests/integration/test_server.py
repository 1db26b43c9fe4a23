"""The real server (uvicorn on a free port) on a tiny Llama, over HTTP with httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from benchmarks.common import fetch_metrics, parse_metrics
from jpaged.config import EngineConfig
from jpaged.engine import engine
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.engine import Engine
from jpaged.engine.sampling import ContextLengthError
from server import responses
from server.app import Limits, build_app
from server.errors import context_length_message
from server.format import Formatter
from server.parse import Options

# tests/integration/test_tensor_parallel.py runs the tests its SPLIT_SERVER_TESTS names
# again on a model split over 4 fake devices
TENSOR_PARALLEL = int(os.environ.get("JPAGED_TEST_TENSOR_PARALLEL", "1"))
# Warming every bucket up front takes minutes on a shared CPU; compile on first use.
CONFIG = dict(
    backend="paged",
    block_size=16,
    max_seq_len=128,
    max_batch_size=16,
    max_waiting_requests=64,
    dtype="float32",
    warmup=False,
    tensor_parallel=TENSOR_PARALLEL,
)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(model, serve):
    with serve(Engine(model, EngineConfig(**CONFIG))) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_engine_is_split_as_asked(server):
    assert len(server.engine.runner.kv.k.devices()) == TENSOR_PARALLEL


def assert_idle(served: Any, client: httpx.Client) -> dict[str, float]:
    """Poll (bounded) until no request holds blocks, then audit the pool for leaks."""
    deadline = time.monotonic() + 10
    while True:
        m = fetch_metrics(client)
        if m["kv_blocks_used"] == m["running"] == m["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still held: {m}"
        time.sleep(0.05)
    assert served.engine.cache.audit() == []
    return m


def events(r: httpx.Response) -> list[Any]:
    """SSE payloads, checking the framing: `data: ...` events, `[DONE]` last."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n")
    raw = r.text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in raw), raw
    assert raw[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-1]]


def test_models_health_metrics(client):
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE jpaged_tokens_generated counter" in r.text
    assert "# TYPE jpaged_kv_blocks_used gauge" in r.text
    # time and call counts only grow: counters too
    for counter in ("step_s", "mixed_calls", "kv_window_frees"):
        assert f"# TYPE jpaged_{counter} counter" in r.text
    for key in (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_utilization",
        "kv_fragmentation",
        "preemptions",
        "tokens_generated",
        "compilations",
        "kv_group0_blocks",
    ):
        assert key in fetch_metrics(client)


def test_completion_stream_equals_non_stream(client, model):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 10, **GREEDY}
    full = client.post("/v1/completions", json=body)
    assert full.status_code == 200, full.text
    doc = full.json()
    n_prompt = len(model.tokenizer.encode("Hello there"))
    assert doc["object"] == "text_completion"
    assert doc["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 10,
        "total_tokens": n_prompt + 10,
    }
    (choice,) = doc["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["logprobs"] is None and choice["text"]

    opts = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = events(client.post("/v1/completions", json=body | opts))
    *content, usage = chunks
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in content) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in content][-2:] == [None, "length"]
    assert usage["choices"] == [] and usage["usage"] == doc["usage"]

    ids = model.tokenizer.encode("Hello there")  # a token-id prompt is the same request
    by_ids = client.post("/v1/completions", json=body | {"prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == choice["text"]


def test_completion_logprobs(client):
    body = {"prompt": "Hello there", "max_tokens": 5, "logprobs": 2, **GREEDY}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])


def test_chat_top_logprobs_up_to_20(server, client):
    body = {**CHAT, "max_tokens": 2, **GREEDY}
    doc = client.post("/v1/chat/completions", json=body | {"logprobs": True, "top_logprobs": 20})
    assert doc.status_code == 200, doc.text
    tokens = doc.json()["choices"][0]["logprobs"]["content"]
    # (alternatives that decode to the same text share one entry: up to 20)
    assert len(tokens) == 2 and all(5 < len(t["top_logprobs"]) <= 20 for t in tokens)
    for t in tokens:  # greedy: the chosen token is the likeliest
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-5)
    r = client.post("/v1/chat/completions", json=body | {"logprobs": True, "top_logprobs": 21})
    assert assert_error(r, 400, "invalid_request_error")["param"] == "top_logprobs"


def test_chat_stream_and_non_stream(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, **GREEDY}
    doc = client.post("/v1/chat/completions", json=body).json()
    template = model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    n_prompt = len(model.tokenizer.encode(template, add_special_tokens=False))
    assert doc["object"] == "chat.completion"
    assert doc["usage"]["prompt_tokens"] == n_prompt and doc["usage"]["completion_tokens"] == 8
    (choice,) = doc["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"

    chunks = events(client.post("/v1/chat/completions", json=body | {"stream": True}))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == (choice["message"]["content"])
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_vllms_sampling_extras(server, client):
    """stop_token_ids (once min_tokens are out), include_stop_str_in_output,
    skip_special_tokens and min_p do what vLLM's do; a logit bias makes the output."""
    tokenizer = server.engine.tokenizer
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    eos = server.engine.model_config.eos_token_ids[0]
    only_a = {**PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100}}

    def complete(**extra: Any) -> dict:
        r = client.post("/v1/completions", json=only_a | extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0] | {"usage": r.json()["usage"]}

    # the stop token is held back while fewer than min_tokens are out (vLLM's): three
    # others, then it stops (counted, not shown)
    stopped = complete(stop_token_ids=[a], min_tokens=3)
    assert stopped["finish_reason"] == "stop" and "a" not in stopped["text"]
    assert stopped["usage"]["completion_tokens"] == 4
    shown = complete(stop_token_ids=[a], min_tokens=3, include_stop_str_in_output=True)
    assert shown["text"] == stopped["text"] + "a"
    assert complete(stop=["aa"])["text"] == ""
    assert complete(stop=["aa"], include_stop_str_in_output=True)["text"] == "aa"
    specials = {"logit_bias": {str(eos): 100}, "ignore_eos": True, "max_tokens": 2}
    assert complete(**specials)["text"] == ""
    shown = complete(**specials, skip_special_tokens=False)["text"]
    assert shown == tokenizer.decode([eos]) * 2 != ""
    # min_p 1 keeps the likeliest token alone: sampling at temperature 1 is greedy
    body = {**PROMPT, "max_tokens": 6, "ignore_eos": True}
    greedy = client.post("/v1/completions", json=body | {"temperature": 0}).json()
    sampled = client.post("/v1/completions", json=body | {"min_p": 1.0, "seed": 1}).json()
    assert sampled["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_an_ignored_field_is_logged_once(client, caplog):
    with caplog.at_level("WARNING", logger="server.parse"):
        for _ in range(2):
            r = client.post("/v1/completions", json={**PROMPT, "max_tokens": 1, "best_of": 2})
            assert r.status_code == 200, r.text
    said = [r.getMessage() for r in caplog.records if "best_of" in r.getMessage()]
    assert len(said) == 1 and "ignored" in said[0]


def test_32_concurrent_requests(server, client):
    before = fetch_metrics(client)["tokens_generated"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            return await asyncio.gather(
                *(
                    ac.post(
                        "/v1/completions",
                        json={
                            "prompt": f"request {i}",
                            "max_tokens": 8,
                            "stream": i % 2 == 1,
                            **GREEDY,
                        },
                    )
                    for i in range(32)
                )
            )

    responses = asyncio.run(burst())
    for i, r in enumerate(responses):
        if i % 2:
            assert events(r)[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    m = assert_idle(server, client)
    assert m["tokens_generated"] - before == 32 * 8


def test_n_choices_stream_and_non_stream(server, client):
    body = {
        "prompt": "Choose",
        "max_tokens": 6,
        "temperature": 30.0,
        "seed": 11,
        "ignore_eos": True,
        "n": 3,
        "logprobs": 1,
    }
    doc = client.post("/v1/completions", json=body).json()
    choices = doc["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in choices)
    assert len({c["text"] for c in choices}) > 1  # each choice has its own seed
    assert doc["usage"]["completion_tokens"] == 18
    single = client.post("/v1/completions", json=body | {"n": 1}).json()["choices"]
    assert single[0]["text"] == choices[0]["text"]  # choice 0 keeps the request's seed

    opts = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = events(client.post("/v1/completions", json=body | opts))
    *content, usage = chunks
    assert all(len(c["choices"]) == 1 for c in content)
    for choice in choices:
        mine = [c["choices"][0] for c in content if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert [c["logprobs"]["text_offset"][0] for c in mine if c["logprobs"]["tokens"]][0] == 0
    assert usage["usage"] == doc["usage"]

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "n": 2,
        "temperature": 0,
    }
    doc = client.post("/v1/chat/completions", json=chat).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["choices"][0]["message"] == doc["choices"][1]["message"]  # greedy
    chunks = events(client.post("/v1/chat/completions", json=chat | {"stream": True}))
    firsts = {}
    for c in chunks:
        firsts.setdefault(c["choices"][0]["index"], c["choices"][0]["delta"])
    assert sorted(firsts) == [0, 1] and all(d["role"] == "assistant" for d in firsts.values())

    m = assert_idle(server, client)
    for key in (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prefix_cache_hit_rate",
        "prefix_cache_evictable_blocks",
        "prefix_cache_evictions",
        "prefix_cache_evicted_blocks",
        "cow_copies",
        "shared_blocks",
    ):
        assert f"kv_{key}" in m
    assert m["kv_cow_copies"] > 0 and m["kv_prefix_cache_hits"] > 0
    assert "# TYPE jpaged_kv_prefix_cache_hits counter" in client.get("/metrics").text


PROMPT = {"prompt": "hi"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"model": 3, **PROMPT}, "model"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [1, 320]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),  # over the cap of 64
    ("/v1/completions", {"prompt": [1, 2, 320]}, "prompt"),  # vocab_size is 320
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 200}, "prompt"),  # the prompt alone is over 128
    # over the context: OpenAI's context_length_exceeded names the prompt, as vLLM's does
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 40}, "prompt"),  # together
    ("/v1/completions", {**PROMPT, "stop_token_ids": [320]}, "stop_token_ids"),
    ("/v1/completions", {**PROMPT, "min_p": 2}, "min_p"),
    ("/v1/completions", {**PROMPT, "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 126}, "prompt"),  # 3 + 126 > 128
    ("/v1/completions", {**PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {**PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**PROMPT, "top_k": 1.5}, "top_k"),
    ("/v1/completions", {**PROMPT, "seed": -1}, "seed"),
    ("/v1/completions", {**PROMPT, "stop": [1]}, "stop"),
    ("/v1/completions", {**PROMPT, "stop": [""]}, "stop"),
    ("/v1/completions", {**PROMPT, "stop": ["a"] * 17}, "stop"),  # over the cap of 16
    ("/v1/completions", {**PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {**PROMPT, "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {**PROMPT, "logprobs": 9}, "logprobs"),
    ("/v1/completions", {**PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**PROMPT, "n": 0}, "n"),
    ("/v1/completions", {**PROMPT, "n": 17}, "n"),  # > max_batch_size
    ("/v1/completions", {**PROMPT, "n": 10**6}, "n"),
    ("/v1/chat/completions", b"", None),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 500}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 17}, "stop"),
]


@pytest.fixture(scope="module")
def chat(server):
    """The chat route's parser on the module's engine (a body -> its Call, nothing run)."""
    return build_app(AsyncEngine(server.engine), "tiny").state.parsers["/v1/chat/completions"]


def test_max_completion_tokens_wins_over_max_tokens(chat):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert chat(body | {"max_completion_tokens": 3}).params.max_tokens == 3  # as in vLLM
    assert chat(body).params.max_tokens == 5


def test_mistral_tool_calls_keep_their_special_token(server):
    """Mistral's calls open with [TOOL_CALLS], a special token: its parser reads the text
    with special tokens (as vLLM's sets skip_special_tokens false)."""
    options = Options(tool_call_parser="mistral")
    app = build_app(AsyncEngine(server.engine), "tiny", options=options)
    chat = app.state.parsers["/v1/chat/completions"]
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert chat(body | {"tools": [tool]}).params.skip_special_tokens is False
    assert chat(body).params.skip_special_tokens is True


def test_the_developer_role_is_the_system_role(chat):
    said = [{"role": "user", "content": "hi"}]
    as_system = chat({"messages": [{"role": "system", "content": "Be brief."}, *said]})
    as_developer = chat({"messages": [{"role": "developer", "content": "Be brief."}, *said]})
    assert as_developer.prompts == as_system.prompts


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[str(b)[:60] for _, b, _ in BAD])
def test_bad_input_is_400_naming_the_field(client, path, body, param):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


LONG_CHAT = [{"role": "user", "content": "x" * 200}]  # over max_seq_len (128) once tokenized
HALF_CHAT = [{"role": "user", "content": "x" * 100}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * 200}, "prompt"),
        ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 40}, "prompt"),
        ("/v1/chat/completions", {"messages": LONG_CHAT}, "messages"),  # default max_tokens
        ("/v1/chat/completions", {"messages": LONG_CHAT, "max_tokens": 4}, "messages"),
        ("/v1/chat/completions", {"messages": HALF_CHAT, "max_tokens": 100}, "messages"),
        ("/v1/chat/completions", {"messages": HALF_CHAT, "max_completion_tokens": 100}, "messages"),
    ],
)
def test_prompt_checks_are_the_engines(server, client, path, body, param):
    """The server does not check the prompt against the context itself: the body parses,
    the engine refuses it, and its numbers come back as OpenAI's context_length_exceeded
    (a 400 naming the prompt's field as the route calls it, whichever part overflowed)."""
    parsers = build_app(AsyncEngine(server.engine), "tiny").state.parsers  # not started
    call = parsers[path](body)
    with pytest.raises(ContextLengthError) as refused:
        server.engine.prepare(call.request(0))
    r = client.post(path, json=body)
    error = assert_error(r, 400, "invalid_request_error")
    exc = refused.value
    words = context_length_message(
        exc.max_seq_len, exc.prompt_tokens, exc.max_tokens, param == "messages"
    )
    assert error["message"] == words and error["param"] == param, error
    assert error["code"] == "context_length_exceeded"


def test_a_broken_grammar_reaches_the_client_as_an_error(server, client, monkeypatch):
    # a mask that lets every token through: the biased "b" breaks the grammar at once
    monkeypatch.setattr(engine, "fill_mask", lambda matcher, out: None)
    (b,) = server.engine.tokenizer.encode("b", add_special_tokens=False)
    body = {
        "prompt": "x",
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": {str(b): 100},
        "structured_outputs": {"regex": "a{3}"},
    }
    message = 'structured output broke its grammar: Parser Error: token "b" doesn\'t'
    for stream in (False, True):  # the first token fails: no stream begins
        r = client.post("/v1/completions", json={**body, "stream": stream})
        assert assert_error(r, 500, "server_error")["message"].startswith(message)
    assert_idle(server, client)


def test_disconnect_mid_stream_frees_blocks(server, client):
    before = fetch_metrics(client)["tokens_generated"]
    body = {"prompt": "abort me", "max_tokens": 110, "stream": True, **GREEDY}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break  # leaving the block closes the connection mid-stream
    m = assert_idle(server, client)
    assert m["tokens_generated"] - before < 110  # aborted, not run to the end
    assert client.get("/health").status_code == 200


def _faulty(aengine: AsyncEngine, monkeypatch: Any, fault: Exception, late: bool) -> None:
    """The engine's output iterator raises `fault` after its first output; with `late`, only
    a batch's second prompt does, once the first prompt has sent an output."""
    real = aengine.generate
    first_out = asyncio.Event()

    async def generate(request: Any) -> Any:
        if late and request.request_id.endswith("-1"):
            await first_out.wait()
            raise fault
        async with contextlib.aclosing(real(request)) as outs:
            async for out in outs:
                yield out
                first_out.set()
                if not late:
                    raise fault

    monkeypatch.setattr(aengine, "generate", generate)


STREAMED = {"max_tokens": 6, "stream": True, **GREEDY}


@pytest.mark.parametrize(
    ("path", "body", "late", "fault", "error"),
    [
        ("/v1/completions", {"prompt": "x"}, False, RuntimeError("boom"), "server_error"),
        ("/v1/chat/completions", CHAT, False, RuntimeError("boom"), "server_error"),
        (
            "/v1/completions",
            {"prompt": ["x", "y"]},
            True,
            ValueError("no"),
            "invalid_request_error",
        ),
    ],
    ids=["engine", "chat-engine", "later-prompt"],
)
def test_a_stream_that_fails_ends_with_an_error_and_done(
    server, client, monkeypatch, path, body, late, fault, error
):
    _faulty(server.aengine, monkeypatch, fault, late)
    *chunks, last = events(client.post(path, json=body | STREAMED))
    assert chunks and last["error"]["type"] == error, last
    if late:
        assert "prompt[1] of the batch" in last["error"]["message"]
    else:  # what an unexpected exception says stays in the log
        assert last["error"]["message"] == "internal server error"
    assert_idle(server, client)


def test_a_formatter_that_fails_ends_the_stream_with_an_error_and_done(server, client, monkeypatch):
    calls = []
    real = Formatter.chunk

    def chunk(self: Formatter, out: Any) -> Any:
        calls.append(out)
        if len(calls) == 2:
            raise KeyError("formatter")
        return real(self, out)

    monkeypatch.setattr(Formatter, "chunk", chunk)
    *chunks, last = events(client.post("/v1/completions", json={"prompt": "x"} | STREAMED))
    assert len(chunks) == 1 and last["error"]["type"] == "server_error", last
    assert_idle(server, client)


def response_events(r: httpx.Response) -> list[dict]:
    """The Responses stream's events, checking each `event:` line names its payload's type."""
    assert r.status_code == 200, r.text
    out = []
    for raw in r.text.removesuffix("\n\n").split("\n\n"):
        kind, data = raw.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}", raw
        out.append(payload)
    return out


@pytest.mark.parametrize("where", ["engine", "answer"])
def test_a_responses_stream_that_fails_ends_with_response_failed(
    server, client, monkeypatch, where
):
    if where == "engine":
        _faulty(server.aengine, monkeypatch, RuntimeError("boom"), late=False)
    else:
        real = responses.Answer.feed
        fed = []

        def feed(self: responses.Answer, piece: str, final: bool) -> list[str]:
            fed.append(piece)
            if len(fed) == 2:
                raise KeyError("answer")
            return real(self, piece, final)

        monkeypatch.setattr(responses.Answer, "feed", feed)
    body = {"input": "hi", "max_output_tokens": 6, "stream": True, "temperature": 0}
    *seen, last = response_events(client.post("/v1/responses", json=body))
    assert seen[0]["type"] == "response.created", seen
    assert last["type"] == "response.failed", last
    failed = last["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"] == "internal server error"
    assert_idle(server, client)


def test_queue_overflow_is_503_and_serving_goes_on(model, serve):
    # One running + one waiting request at most. The pool has the main server's
    # shape, so the programs it compiled are reused.
    config = EngineConfig(
        **{**CONFIG, "max_batch_size": 1, "max_waiting_requests": 1, "num_blocks": 16 * 8}
    )
    body = {"prompt": "burst", "max_tokens": 24, **GREEDY}
    with (
        serve(Engine(model, config)) as small,
        httpx.Client(base_url=small.url, timeout=120) as client,
    ):

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=small.url, timeout=120) as ac:
                return await asyncio.gather(
                    *(ac.post("/v1/completions", json=body) for _ in range(24))
                )

        responses = asyncio.run(burst())
        assert {r.status_code for r in responses} == {200, 503}, [r.text for r in responses]
        for r in responses:
            if r.status_code == 503:
                error = r.json()["error"]
                assert error["type"] == "server_overloaded" and "queue" in error["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        r = client.post("/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text  # the burst is over: served again
        # a batch is admitted whole or not at all: three prompts overflow a queue of one
        r = client.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
        assert_error(r, 503, "server_overloaded")
        assert_idle(small, client)

        small.aengine.stop()
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json=body).status_code == 503


KEYS = ["key-one", "key-two"]


@pytest.fixture(scope="module")
def guarded(model, serve):
    """A server with API keys, a metrics key and small limits."""
    limits = Limits(max_body_bytes=2048, body_timeout_s=0.5)
    engine = Engine(model, EngineConfig(**CONFIG))
    with serve(engine, api_keys=KEYS, metrics_keys=["metrics-key"], limits=limits) as served:
        yield served


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (
        error["type"] == kind
        and error["message"]
        and set(error) == {"message", "type", "param", "code"}
    )
    return error


def test_api_keys(guarded):
    body = {"prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=guarded.url, timeout=120) as c:
        for headers in (
            {},
            bearer("key-three"),
            bearer("key-on"),
            {"Authorization": "key-one"},
            {"Authorization": "Basic key-one"},
            bearer("metrics-key"),
        ):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert assert_error(r, 401, "invalid_request_error")["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models").status_code == 401
        for key in KEYS:
            assert c.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
            assert c.get("/v1/models", headers=bearer(key)).status_code == 200
        assert c.get("/health").status_code == 200  # load balancers probe it without a key
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=bearer(KEYS[0])).status_code == 401
        assert c.get("/metrics", headers=bearer("metrics-key")).status_code == 200


def test_oversized_and_slow_bodies(guarded):
    with httpx.Client(base_url=guarded.url, timeout=120, headers=bearer(KEYS[0])) as c:
        big = {"prompt": "x" * 4096}
        assert_error(c.post("/v1/completions", json=big), 413, "invalid_request_error")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            yield b"x" * 4096

        assert_error(c.post("/v1/completions", content=chunks()), 413, "invalid_request_error")

        # headers and half a body, then silence: 408 once the body timeout is over
        with socket.create_connection(_address(guarded.url), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one"
                b"\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
                b'{"prompt": '
            )
            start = time.monotonic()
            head, _, doc = _read_response(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and 0.4 < time.monotonic() - start < 5
        assert json.loads(doc)["error"]["type"] == "invalid_request_error"

        r = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert r.status_code == 200, r.text
        c.headers.update(bearer("metrics-key"))
        assert_idle(guarded, c)


def _address(url: str) -> tuple[str, int]:
    host, port = urlsplit(url).netloc.split(":")
    return host, int(port)


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):  # the server closes the connection after the error
        data += chunk
    return data


# `python -m server` where PyTorch cannot be imported, as after the README's install
WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "
    "runpy.run_module('server', run_name='__main__', alter_sys=True)"
)


def _launch(
    checkpoint: Path, *flags: str, without_torch: bool = False
) -> tuple[subprocess.Popen, str]:
    """`python -m server` on the tiny checkpoint and a free port, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            *(["-c", WITHOUT_TORCH] if without_torch else ["-m", "server"]),
            "--model",
            str(checkpoint),
            "--port",
            str(port),
            "--no-warmup",
            "--dtype",
            "float32",
            "--block-size",
            "16",
            "--max-seq-len",
            "128",
            "--max-batch-size",
            "4",
            "--log-level",
            "warning",
            "--tensor-parallel",
            str(TENSOR_PARALLEL),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def _until_draining(url: str) -> None:
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{url}/health")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert r.status_code == 503 and r.json()["status"] == "shutting down"


def _exit_clean(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "every KV block free (audited)" in out


@pytest.mark.parametrize("layout", [(), ("--engine-process",)], ids=["one", "engine-process"])
def test_ctrl_c_stops_as_sigterm_does_without_its_grace(tiny_llama_dir, layout):
    """SIGINT: no new requests, a running stream ends with an error event and [DONE] at
    once, no traceback; the pool audited; the shell's status for it. (Started where PyTorch
    is missing, as after the README's install: no banner about it either.) With the engine
    core in a process of its own too: the server drains it and stops it."""
    proc, url = _launch(tiny_llama_dir, "--max-seq-len", "2048", *layout, without_torch=True)
    try:
        body = {"prompt": "cancel me", "max_tokens": 2000, "stream": True, **GREEDY}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGINT)
            *_, last, done = lines
        assert json.loads(last.removeprefix("data: "))["error"]["type"] == "server_error"
        assert done == "data: [DONE]"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "every KV block free (audited)" in out, out
        assert "Traceback" not in out and "Exception in ASGI application" not in out, out
        assert "PyTorch was not found" not in out, out
    finally:
        proc.kill()


def test_sigterm_lets_running_requests_finish(tiny_llama_dir):
    proc, url = _launch(tiny_llama_dir, "--shutdown-timeout", "60")
    try:
        body = json.dumps({"prompt": "finish me", "max_tokens": 4, **GREEDY}).encode()
        with socket.create_connection(_address(url), 30) as s:
            # admitted before the signal: its body is still on the way
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body[:10])
            )
            deadline = time.monotonic() + 10
            while parse_metrics(httpx.get(f"{url}/metrics").text)["http_requests_in_flight"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            _until_draining(url)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "too late"})
            assert_error(r, 503, "server_error")
            s.sendall(body[10:])
            head, _, doc = _read_response(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert json.loads(doc)["usage"]["completion_tokens"] == 4
        _exit_clean(proc)
    finally:
        proc.kill()


def test_sigterm_cancels_what_outlives_the_timeout(tiny_llama_dir):
    # requests long enough to outlive the signal's handling on a loaded machine (110 tokens
    # once finished first under CI's two workers)
    proc, url = _launch(tiny_llama_dir, "--shutdown-timeout", "0", "--max-seq-len", "2048")
    try:
        body = {"prompt": "cancel me", "max_tokens": 2000, "stream": True, **GREEDY}
        asked = {"input": "cancel me", "max_output_tokens": 1900, "stream": True}
        with (
            httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r,
            httpx.stream("POST", f"{url}/v1/responses", json=asked, timeout=30) as answer,
        ):
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: {")
            events = (line for line in answer.iter_lines() if line.startswith("data: "))
            assert "response.created" in next(events)
            proc.send_signal(signal.SIGTERM)
            *_, last, done = lines
            *_, failed = events
        assert json.loads(last.removeprefix("data: "))["error"]["type"] == "server_error"
        assert done == "data: [DONE]"
        failed = json.loads(failed.removeprefix("data: "))
        assert failed["type"] == "response.failed", failed
        assert failed["response"]["error"]["code"] == "server_error"
        _exit_clean(proc)
    finally:
        proc.kill()


def _unread(url: str, body: dict) -> socket.socket:
    """A client that posts `body` to /v1/completions and never reads the answer.

    Its small receive buffer closes the TCP window at once; its small segments keep the
    server's send buffer small too (Linux sizes it by segments: ~100 KB at 536 bytes, not
    the ~3 MB of loopback's 64 KiB segments), so a large answer backs up into the server."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: both
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.connect(_address(url))
    doc = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(doc), doc)
    )
    return s


def _received(s: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):  # the server dropped the connection
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_sigterm_drops_clients_that_stopped_reading(tiny_llama_dir):
    """Neither a finished answer its client never reads nor a stream whose client stopped
    reading holds the shutdown up: past --shutdown-timeout both connections are dropped, and
    the process exits 0 after the pool's audit."""
    timeout = 2.0
    proc, url = _launch(tiny_llama_dir, "--shutdown-timeout", str(timeout))
    # ~0.5 MB, several times what the buffers on the way hold, and quick to compute: the
    # prompts' echoed logprobs in each of n choices
    large = {
        "prompt": [c * 99 for c in "abcdefgh"],
        "n": 4,
        "echo": True,
        "logprobs": 5,
        "max_tokens": 20,
        **GREEDY,
    }

    def until(client: httpx.Client, **want: float) -> None:
        deadline = time.monotonic() + 30
        while any(fetch_metrics(client)[k] != v for k, v in want.items()):
            assert time.monotonic() < deadline, want
            time.sleep(0.02)

    try:
        with httpx.Client(base_url=url, timeout=60) as client, _unread(url, large) as answer:
            until(client, requests_finished=8, http_requests_in_flight=0)  # written, not read
            with _unread(url, {**large, "stream": True}) as stream:
                until(client, http_requests_in_flight=1)
                proc.send_signal(signal.SIGTERM)
                start = time.monotonic()
                out, _ = proc.communicate(timeout=timeout + 30)
                took = time.monotonic() - start
                got_answer, got_stream = _received(answer), _received(stream)
        assert proc.returncode == 0 and "every KV block free (audited)" in out, out
        # the unread answer was given the whole grace period, then no more than seconds
        assert timeout <= took < timeout + 5, took
        head, _, body = got_answer.partition(b"\r\n\r\n")
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        assert head.startswith(b"HTTP/1.1 200 ") and len(body) < int(headers[b"content-length"])
        assert b"data: [DONE]" not in got_stream
    finally:
        proc.kill()
