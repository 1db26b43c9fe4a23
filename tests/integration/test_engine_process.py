"""The engine core in a process of its own (`core_client.CoreClient`): what streams out is
what an engine in this process streams, token for token and byte for byte."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.beam import BeamSearchParams
from jpaged.engine.core_client import CoreClient
from jpaged.engine.core_process import Launch, load_path
from jpaged.engine.engine import Engine
from jpaged.engine.interface import PromptRequest
from jpaged.engine.lora import LoRARequest
from jpaged.engine.sampling import SamplingParams

CONFIG = EngineConfig(
    max_batch_size=8,
    max_seq_len=128,
    block_size=16,
    dtype="float32",
    warmup=False,
    compilation_cache_dir=os.path.expanduser(
        os.environ.get("JPAGED_TEST_XLA_CACHE", "~/.cache/jpaged/xla")
    ),
)


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Any) -> Iterator[CoreClient]:
    load = functools.partial(load_path, str(tiny_llama_dir))
    c = CoreClient(Launch(load, functools.partial(dataclasses.replace, CONFIG)))
    try:
        yield c
    finally:
        c.close()


def _run(engine: Any, asks: list[PromptRequest], abort_after: int = 0) -> list[dict]:
    """Every request's outputs through the async front, concatenated a choice (`abort_after`:
    the last request's stream is closed after that many outputs)."""

    async def one(aengine: AsyncEngine, ask: PromptRequest, cut: int) -> dict:
        got: dict = {}
        seen = 0
        async for o in aengine.generate(ask):
            c = got.setdefault(o.index, {"text": "", "ids": [], "logprobs": [], "top": []})
            c["text"] += o.text
            c["ids"] += o.token_ids
            c["logprobs"] += o.logprobs
            c["top"] += o.top_logprobs or []
            c["finish"] = o.finish_reason
            c["prompt_logprobs"] = c.get("prompt_logprobs") or o.prompt_logprobs
            seen += 1
            if seen == cut:
                break
        return got

    async def main() -> list[dict]:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            cuts = [0] * (len(asks) - 1) + [abort_after]
            streams = (one(aengine, a, k) for a, k in zip(asks, cuts, strict=True))
            return await asyncio.gather(*streams)
        finally:
            aengine.stop()

    return asyncio.run(main())


def _idle(engine: Any) -> None:
    deadline = time.monotonic() + 10
    while (stats := engine.stats())["kv_blocks_used"] or stats["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert engine.audit() == []


def test_an_engine_process_streams_what_an_engine_here_does(client, model):
    greedy = {"temperature": 0, "max_tokens": 12}
    local = Engine(model, CONFIG)
    # a stop string the greedy text reaches (after its first token: a stop in mid-stream)
    text = _run(local, [PromptRequest("the quick", SamplingParams(**greedy))])[0][0]["text"]
    stop = text[2:4]
    asks = [
        PromptRequest("the quick", SamplingParams(**greedy, stop=[stop])),
        PromptRequest("hello", SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7)),
        PromptRequest("a b c", SamplingParams(**greedy, logprobs=2, prompt_logprobs=1)),
        PromptRequest([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)),
        PromptRequest("search", BeamSearchParams(beam_width=2, max_tokens=6)),
        PromptRequest("cut me", SamplingParams(max_tokens=100, ignore_eos=True)),
    ]
    here, there = _run(local, asks, abort_after=3), _run(client, asks, abort_after=3)
    assert there == here
    assert there[0][0]["finish"] == "stop" and stop not in there[0][0]["text"]
    assert len(there[1]) == 3 and there[2][0]["top"] and there[2][0]["prompt_logprobs"]
    assert len(there[4]) == 2  # both beams' hypotheses
    assert len(there[5][0]["ids"]) == 3  # the last one was aborted after 3 outputs
    _idle(local)
    _idle(client)  # the stopped and the aborted choices' blocks are back
    # every choice's handle forgotten, the stopped one's too (once the core's step that
    # finished it is read: the async front may have read it already)
    deadline = time.monotonic() + 10
    while client._choices:
        assert time.monotonic() < deadline, client._choices
        if client._steps.empty():
            time.sleep(0.01)
        else:
            client.step()
    assert client.stats()["outputs_s"] > 0


def test_an_engine_process_raises_what_an_engine_here_raises(client, model):
    """A bad request (its field named, for the server's 400) and an adapter the engine
    refuses raise what they raise in this process, and leave the core serving."""
    local = Engine(model, CONFIG)
    ask = PromptRequest("x", SamplingParams(max_tokens=4), lora="nope")
    adapter = LoRARequest("a", 1, "/nowhere")
    for call in (lambda e: e.prepare(ask), lambda e: e.register_lora(adapter)):
        with pytest.raises(ValueError) as here:
            call(local)
        with pytest.raises(ValueError) as there:
            call(client)
        assert type(there.value) is type(here.value) and str(there.value) == str(here.value)
        assert getattr(there.value, "field", None) == getattr(here.value, "field", None)
    assert client.loras() == {} and client.stats()["running"] == 0
