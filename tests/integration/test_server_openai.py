"""The server as the official OpenAI SDK drives it (sync and async): model routes, batches of
prompts, echo with the prompt's logprobs (lm-evaluation-harness's loglikelihood request, against
transformers on the tiny model and on the demo model), and stream_options."""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import numpy as np
import openai
import pytest
import torch

from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine

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
ALIASES = ["tiny-alias", "org/tiny"]  # an id with a slash, as Hugging Face names go
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["Hello there", "The sky is"]


@pytest.fixture(scope="module")
def server(model, serve):
    with serve(Engine(model, EngineConfig(**CONFIG)), aliases=ALIASES) as served:
        yield served


def connect(url: str, kind: type = openai.OpenAI) -> Any:
    return kind(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(server):
    with connect(server.url) as client:
        yield client


def stream_choices(url: str, **request: Any) -> tuple[dict[int, list[Any]], Any]:
    """A streamed completion through the async SDK: each choice's chunks by index, and the
    usage chunk's usage."""

    async def run() -> list[Any]:
        async with connect(url, openai.AsyncOpenAI) as client:
            stream = await client.completions.create(
                model="tiny", stream=True, stream_options={"include_usage": True}, **request
            )
            return [chunk async for chunk in stream]

    *chunks, last = asyncio.run(run())
    assert last.choices == [] and all(len(c.choices) == 1 for c in chunks)
    by_index: dict[int, list[Any]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.choices[0].index, []).append(chunk.choices[0])
    return by_index, last.usage


def test_models_and_their_ids(sdk):
    assert [m.id for m in sdk.models.list()] == ["tiny", *ALIASES]
    for name in ("tiny", *ALIASES):
        assert sdk.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    # a request for a model this server does not serve is not answered by the one it does
    with pytest.raises(openai.NotFoundError) as other:
        sdk.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    assert (other.value.code, other.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert sdk.completions.create(model="org/tiny", prompt="hi", max_tokens=1).model == "tiny"


def test_a_batch_of_prompts(server, sdk, model):
    """Choices prompt-major, each as if its prompt came alone; usage over every prompt;
    streamed the same; one bad prompt refuses them all, naming it."""
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    alone = [
        sdk.completions.create(model="tiny", prompt=p, max_tokens=5, logprobs=1, **GREEDY)
        for p in PROMPTS
    ]
    expected = [a.choices[0] for a in alone for _ in range(2)]  # n = 2, greedy: equal
    for batch in (PROMPTS, ids):
        doc = sdk.completions.create(
            model="tiny", prompt=batch, n=2, max_tokens=5, logprobs=1, **GREEDY
        )
        assert [c.index for c in doc.choices] == [0, 1, 2, 3]
        assert [c.text for c in doc.choices] == [c.text for c in expected]
        assert [c.logprobs.tokens for c in doc.choices] == [c.logprobs.tokens for c in expected]
        assert doc.usage.prompt_tokens == sum(map(len, ids))
        assert doc.usage.completion_tokens == 4 * 5

    streamed, usage = stream_choices(server.url, prompt=PROMPTS, n=2, max_tokens=5, **GREEDY)
    assert sorted(streamed) == [0, 1, 2, 3]
    for index, choice in enumerate(doc.choices):
        assert "".join(c.text for c in streamed[index]) == choice.text
        assert streamed[index][-1].finish_reason == "length"
    assert usage == doc.usage

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt=["hi", "x" * 200], max_tokens=2)
    assert bad.value.param == "prompt" and "prompt[1]" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt=[[5, 6], [7, 320]], max_tokens=2)
    assert bad.value.param == "prompt" and "prompt[1][1]" in bad.value.message
    server.assert_idle()  # the good prompt of a refused batch holds nothing


def test_echo(server, sdk, model):
    """The prompt first: in the text, and with logprobs in the tokens (the first one's
    logprob null); max_tokens 0 echoes the prompt alone; streamed the same."""
    prompt = PROMPTS[0]
    texts = [model.tokenizer.decode([t]) for t in model.tokenizer.encode(prompt)]
    plain = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, logprobs=2, **GREEDY
    ).choices[0]
    echoed = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, logprobs=2, echo=True, **GREEDY
    ).choices[0]
    lp = echoed.logprobs
    assert echoed.text == prompt + plain.text
    assert lp.tokens == texts + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(texts) :] == plain.logprobs.token_logprobs
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # each top holds the token itself and its 2 alternatives (which may include it)
    assert all(
        tok in top and 2 <= len(top) <= 3
        for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
    )
    assert lp.text_offset == list(itertools.accumulate(map(len, lp.tokens[:-1]), initial=0))

    only = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, logprobs=2, echo=True, **GREEDY
    )
    (choice,) = only.choices
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert choice.logprobs.tokens == texts
    assert choice.logprobs.token_logprobs == lp.token_logprobs[: len(texts)]
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (len(texts), 0)

    streamed, usage = stream_choices(
        server.url, prompt=prompt, max_tokens=0, echo=True, n=2, **GREEDY
    )
    for chunks in streamed.values():
        assert [(c.text, c.finish_reason) for c in chunks] == [(prompt, "length")]
    assert usage.completion_tokens == 0
    streamed, _ = stream_choices(
        server.url, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY
    )
    assert "".join(c.text for c in streamed[0]) == echoed.text
    assert [t for c in streamed[0] for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in streamed[0] for o in c.logprobs.text_offset] == lp.text_offset

    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt=prompt, max_tokens=0)  # no echo
    assert bad.value.param == "max_tokens"
    server.assert_idle()


def test_stream_options_need_a_stream(sdk):
    usage: Any = {"include_usage": True}
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt="hi", max_tokens=1, stream_options=usage)
    assert bad.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            stream_options=usage,
        )
    assert bad.value.param == "stream_options"


CHAT_WORDS = (
    r"This model's maximum context length is 128 tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the "
    r"messages or completion\."
)
PROMPT_WORDS = (
    r"This model's maximum context length is 128 tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in your prompt; (\d+) for the completion\)\. Please reduce the length of the "
    r"prompt or completion\."
)
LONG = [{"role": "user", "content": "x" * 200}]  # over the context (128) once tokenized
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("route", "body", "words", "tokens"),
    [
        ("chat", {"messages": LONG}, CHAT_WORDS, None),  # max_tokens left to the server: 1
        ("chat", {"messages": LONG, "max_tokens": 4}, CHAT_WORDS, None),
        ("chat", {"messages": HI, "max_completion_tokens": 127}, CHAT_WORDS, None),
        ("completions", {"prompt": "x" * 200}, PROMPT_WORDS, None),
        ("completions", {"prompt": [5] * 100, "max_tokens": 40}, PROMPT_WORDS, (140, 100, 40)),
        ("completions", {"prompt": [5] * 300}, PROMPT_WORDS, (316, 300, 16)),  # ids: no schema cap
    ],
    ids=["chat", "chat-max_tokens", "chat-max_completion_tokens", "text", "ids-max_tokens", "ids"],
)
def test_context_length_exceeded_as_openai_words_it(server, sdk, route, body, words, tokens):
    """A prompt (with max_tokens) over the context: OpenAI's code and words, as vLLM
    answers them, so that clients that trim their context on it work."""
    create = sdk.chat.completions.create if route == "chat" else sdk.completions.create
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            create(model="tiny", stream=stream, **body)
        error = bad.value
        assert (error.code, error.type) == ("context_length_exceeded", "invalid_request_error")
        assert error.param == ("messages" if route == "chat" else "prompt")
        message = error.body["message"]  # type: ignore[index]
        found = re.fullmatch(words, message)
        assert found, message
        total, prompt, completion = map(int, found.groups())
        assert total == prompt + completion > 128
        if tokens is not None:
            assert (total, prompt, completion) == tokens
    server.assert_idle()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", 1e39, "temperature: Input should be less than or equal to 3.402e+38"),
        ("top_p", 0.0, "top_p: Input should be greater than 0,"),
        ("presence_penalty", 2.5, "presence_penalty: Input should be less than or equal to 2,"),
        ("seed", 2**40, "seed: Input should be less than or equal to 4294967295,"),
    ],
)
def test_bounds_are_plain_numbers(sdk, field, value, words):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt="hi", max_tokens=1, **{field: value})
    message = bad.value.body["message"]  # type: ignore[index]
    assert bad.value.param == field and message.startswith(words), message
    assert not re.search(r"\d{17}", message)


def test_min_tokens_holds_stop_token_ids_back(server, sdk):
    """vLLM's: a stop token is not sampled before min_tokens (as EOS is not), so the output
    has min_tokens tokens before the stop token ends it."""
    favoured = {"logit_bias": {"42": 100}, "temperature": 0, "max_tokens": 8}  # 42 every time
    extra = {"stop_token_ids": [42], "ignore_eos": True}
    at_once = sdk.completions.create(model="tiny", prompt="hi", extra_body=extra, **favoured)
    assert (at_once.choices[0].finish_reason, at_once.usage.completion_tokens) == ("stop", 1)
    extra["min_tokens"] = 3
    held = sdk.completions.create(model="tiny", prompt="hi", extra_body=extra, **favoured)
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 4)
    server.assert_idle()


# ------------------------------------------------ lm-evaluation-harness's loglikelihood request


def teacher_forced(hf: Any, ids: list[int]) -> np.ndarray:
    """float32 [len(ids) - 1, vocab]: transformers' log-probabilities of each next token."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).numpy()


def assert_loglikelihoods(sdk: Any, model: str, hf: Any, contexts: list[list[int]]) -> None:
    """lm-evaluation-harness `local-completions`: token-id prompts in one batch, echo,
    logprobs 1, max_tokens 0; each prompt token's logprob as transformers has it (1e-3), and
    its top alternative the argmax (how the harness tells a greedy continuation)."""
    doc = sdk.completions.create(
        model=model, prompt=contexts, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    assert len(doc.choices) == len(contexts)
    for ids, choice in zip(contexts, doc.choices, strict=True):
        expected = teacher_forced(hf, ids)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        own = [float(expected[i, t]) for i, t in enumerate(ids[1:])]
        np.testing.assert_allclose(lp.token_logprobs[1:], own, atol=1e-3)
        best = [max(top.values()) for top in lp.top_logprobs[1:]]
        np.testing.assert_allclose(best, expected.max(-1), atol=1e-3)


def test_loglikelihood_matches_transformers(sdk, tiny_llama_dir, hf_reference):
    # ids below 94 decode to printable characters: no two alternatives share a text (the
    # format keys them by text, and partial UTF-8 bytes all decode to "\ufffd")
    contexts = [list(range(20, 80)), [256, 17, 90, 3, 41]]
    assert_loglikelihoods(sdk, "tiny", hf_reference(tiny_llama_dir), contexts)


def test_loglikelihood_on_the_demo_model(serve, demo_gguf, demo_model, hf_gguf):
    tokenizer, hf = hf_gguf(demo_gguf("smollm2-135m"))
    config = EngineConfig(
        dtype="float32",
        warmup=False,
        max_seq_len=64,
        max_batch_size=2,
        block_size=16,
        max_num_batched_tokens=64,
    )
    texts = [
        "Question: What is the capital of France?\nAnswer: Paris",
        "The quick brown fox jumps over the lazy dog",
    ]
    with serve(Engine(demo_model("smollm2-135m"), config), "smollm2") as served:
        with connect(served.url) as client:
            assert_loglikelihoods(client, "smollm2", hf, [tokenizer.encode(t) for t in texts])
        served.assert_idle()
