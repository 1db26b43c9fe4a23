"""Embeddings: the engine's pooled final hidden states against transformers' (its
last_hidden_state pooled the same way, float32) on the tiny models and SmolLM2, scheduled
with generation; and /v1/embeddings through the openai SDK."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine
from jpaged.engine.interface import PromptRequest
from jpaged.engine.sampling import SamplingParams
from server.parse import Options

# a 32-token budget: the 50-token prompt is embedded in two chunks
CONFIG = dict(
    block_size=16,
    max_seq_len=128,
    max_batch_size=4,
    max_num_batched_tokens=32,
    dtype="float32",
    warmup=False,
)


def embed(engine: Engine, prompts: list[list[int]], pooling: str, also: list[int] = ()) -> list:
    """The prompts' embeddings, their requests scheduled by the engine (with a generation
    request for the prompt `also`, which must still end as usual)."""
    reqs = [
        engine.prepare(PromptRequest(ids, SamplingParams(max_tokens=1), pooling=pooling))
        for ids in prompts
    ]
    if also:
        reqs.append(
            engine.prepare(PromptRequest(also, SamplingParams(max_tokens=6, temperature=0)))
        )
    for r in reqs:
        engine.add(r)
    outs = {}
    while engine.has_unfinished():
        outs |= {out.request_id: out for out in engine.step()}
    if also:
        last = outs[reqs.pop().id]
        assert last.finish_reason in ("length", "stop") and last.embedding is None
    return [outs[r.id].embedding for r in reqs]


def reference(hf, ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_pooled_hidden_states_equal_transformers(family, loaded, tiny_checkpoint, hf_reference):
    engine = Engine(loaded(family), EngineConfig(**CONFIG))
    hf = hf_reference(tiny_checkpoint(family))
    prompts = [[5, 17, 90, 3], list(range(40, 90))]
    for pooling in ("last", "mean"):
        got = embed(engine, prompts, pooling, also=[7, 8, 9])
        for ids, v in zip(prompts, got, strict=True):
            np.testing.assert_allclose(v, reference(hf, ids, pooling), atol=1e-4)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.cache.audit() == []


def test_the_demo_model_embeds_as_transformers(demo_model, demo_gguf, hf_gguf):
    tokenizer, hf = hf_gguf(demo_gguf("smollm2-135m"))
    engine = Engine(demo_model("smollm2-135m"), EngineConfig(**CONFIG))
    ids = tokenizer.encode("Paged attention keeps KV memory in blocks.")
    for pooling in ("last", "mean"):
        [got] = embed(engine, [ids], pooling)
        np.testing.assert_allclose(got, reference(hf, ids, pooling), atol=1e-4)


def test_the_embeddings_route(serve, model, tiny_llama_dir, hf_reference):
    engine = Engine(model, EngineConfig(**CONFIG))
    with serve(engine, options=Options(pooling="mean")) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="-", max_retries=0)
        texts = ["Hello there", "The sky is blue"]
        # the SDK asks for base64 and decodes it
        done = client.embeddings.create(model="tiny", input=texts)
        floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
        assert [d.index for d in done.data] == [0, 1]
        ids = [model.tokenizer.encode(t) for t in texts]
        expected = [reference(hf_reference(tiny_llama_dir), x, "mean") for x in ids]
        for d, f, v in zip(done.data, floats.data, expected, strict=True):
            np.testing.assert_allclose(d.embedding, v, atol=1e-4)
            assert f.embedding == d.embedding and len(d.embedding) == 64
        assert done.usage.prompt_tokens == sum(map(len, ids))
        one = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
        assert one.data[0].embedding == floats.data[1].embedding  # token ids, one input
        for bad, param in (({"dimensions": 8}, "dimensions"), ({"input": []}, "input")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.embeddings.create(**{"model": "tiny", "input": "x", **bad})
            assert refused.value.param == param
        served.assert_idle()
        vector = np.frombuffer(base64.b64decode(_raw_base64(served.url)), "<f4")
        np.testing.assert_allclose(vector, floats.data[0].embedding, rtol=1e-6)


def _raw_base64(url: str) -> str:
    import httpx

    body = {"input": "Hello there", "encoding_format": "base64"}
    return httpx.post(f"{url}/v1/embeddings", json=body).json()["data"][0]["embedding"]
