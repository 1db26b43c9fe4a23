"""Sampling controls and structured outputs through the whole engine.

Controls: greedy decoding with penalties and a logit bias equals a step-by-step reference
(transformers' model, the same processing in NumPy), under preemption, n > 1 and
prefix caching. Structured outputs on the real demo model (SmolLM2): JSON-schema
generations all parse and validate, regex and choice outputs match, and greedy
constrained output equals an offline reference that applies llguidance's mask in NumPy.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import re
import time

import numpy as np
import pytest

import jpaged
from jpaged import SamplingParams, models
from jpaged.config import EngineConfig
from jpaged.engine import engine
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.engine import Engine
from jpaged.engine.interface import PromptRequest
from jpaged.engine.sampling import RequestError, StructuredOutputsParams

CONTROLS = dict(
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.6,
    logit_bias={5: 2.0, 17: -3.0},
)


def reference_controls(
    hf, prompt, steps, presence_penalty, frequency_penalty, repetition_penalty, logit_bias
):
    """Greedy tokens with the controls applied in NumPy, one forward pass a token."""
    import torch

    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float64)
        for t, b in logit_bias.items():
            logits[t] += b
        seen = np.zeros(len(logits), bool)
        seen[ids] = True
        logits = np.where(
            seen & (logits < 0),
            logits * repetition_penalty,
            np.where(seen, logits / repetition_penalty, logits),
        )
        counts = np.bincount(ids[len(prompt) :], minlength=len(logits))
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0)
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :]


def test_greedy_controls_equal_the_reference_under_preemption_and_forks(
    model, tiny_llama_dir, hf_reference
):
    hf = hf_reference(tiny_llama_dir)
    prompts = [[5, 17, 99, 3, 5, 5], list(range(30, 43)), [40, 41, 42, 43, 44, 45, 46, 47, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2, **CONTROLS)
    # 10 blocks of 4 tokens for three groups of two 20-token choices: preemption
    llm = jpaged.LLM(
        model,
        dtype="float32",
        block_size=4,
        num_blocks=14,
        max_seq_len=64,
        max_batch_size=6,
        warmup=False,
        compilation_cache_dir=None,
    )
    outs = llm.generate(prompts, params)
    assert llm.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference_controls(hf, prompt, 12, **CONTROLS)
        assert [c.token_ids for c in out.choices] == [want, want]
    # a prefix-cache hit starts from the same counts
    again = llm.generate(
        [prompts[2]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **CONTROLS)
    )
    assert again[0].token_ids == outs[2].token_ids


def test_min_tokens_holds_eos_back(model):
    llm = jpaged.LLM(
        model,
        dtype="float32",
        max_seq_len=64,
        max_batch_size=2,
        warmup=False,
        compilation_cache_dir=None,
    )
    eos = model.config.eos_token_ids[0]
    # a bias that makes EOS the likeliest token from the first step
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == [eos]
    held = llm.generate([[5, 6, 7]], SamplingParams(**{**vars(params), "min_tokens": 3}))[0]
    assert eos not in held.token_ids[:3] and held.token_ids[3] == eos


def test_a_broken_grammar_ends_its_choice_with_an_error(model, monkeypatch):
    llm = jpaged.LLM(
        model, dtype="float32", max_seq_len=64, warmup=False, compilation_cache_dir=None
    )
    # a mask that lets every token through: the biased "b" breaks the grammar at once
    monkeypatch.setattr(engine, "fill_mask", lambda matcher, out: None)
    (b,) = model.tokenizer.encode("b", add_special_tokens=False)
    broken = SamplingParams(
        max_tokens=8,
        temperature=0,
        logit_bias={b: 100.0},
        structured=StructuredOutputsParams(regex="a{3}"),
    )
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [broken, SamplingParams(max_tokens=4)])
    assert outs[0].token_ids == [b] and outs[0].finish_reason == "error"
    assert outs[0].error == (
        "structured output broke its grammar: "
        "Parser Error: token \"b\" doesn't satisfy the grammar; byte 'b' fails parse"
    )
    assert outs[1].finish_reason in ("stop", "length")
    stats = llm.stats()
    assert stats["requests_failed"] == 1 and stats["requests_finished"] == 1


def test_logit_bias_ids_past_the_vocabulary_name_the_field(model):
    llm = jpaged.LLM(
        model, dtype="float32", max_seq_len=64, warmup=False, compilation_cache_dir=None
    )
    with pytest.raises(RequestError) as raised:
        llm.generate([[1, 2]], SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
    assert raised.value.field == "logit_bias"


# -- structured outputs on SmolLM2 --------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height": {"type": "number"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height", "pets", "address"],
    "additionalProperties": False,
}


def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smol(demo_model):
    return jpaged.LLM(
        demo_model("smollm2-135m"),
        dtype="float32",
        max_seq_len=256,
        max_batch_size=20,
        warmup=False,
        compilation_cache_dir=None,
    )


def test_twenty_json_schema_generations_validate(smol):
    import jsonschema

    prompts = [chat(f"Describe person {i} in JSON.") for i in range(4)]
    params = SamplingParams(
        max_tokens=100,
        temperature=0.7,
        seed=0,
        n=5,
        structured=StructuredOutputsParams(json=SCHEMA),
    )
    outs = smol.generate(prompts, params)  # 20 generations in one call
    choices = [c for out in outs for c in out.choices]
    assert len(choices) == 20
    for c in choices:
        if c.finish_reason == "length":  # cut by max_tokens: the only excuse
            continue
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert sum(c.finish_reason == "stop" for c in choices) >= 16
    assert len({c.text for c in choices}) > 10  # sampled, not one answer


def test_regex_choice_and_json_object(smol):
    regex, choices = r"[0-9]{3}-[a-z]{2,4}", ["yes", "no", "maybe so"]
    prompts = [chat("Give me a code."), chat("Is the sky blue?")]
    specs = [
        StructuredOutputsParams(regex=regex),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(json_object=True),
    ]
    for spec in specs:
        params = SamplingParams(max_tokens=60, temperature=0.8, seed=1, n=3, structured=spec)
        for out in smol.generate(prompts, params):
            for c in out.choices:
                assert c.finish_reason == "stop", c.text
                if spec.regex:
                    assert re.fullmatch(regex, c.text)
                elif spec.choice:
                    assert c.text in choices
                else:
                    assert isinstance(json.loads(c.text), dict)


def test_a_schema_the_backend_cannot_compile_names_the_field(smol):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "frob"}}})
    with pytest.raises(RequestError) as raised:
        smol.generate([chat("x")], SamplingParams(structured=bad))
    assert raised.value.field == "structured.json"
    with pytest.raises(RequestError) as raised:
        smol.generate([chat("x")], SamplingParams(structured=StructuredOutputsParams(regex="(")))
    assert raised.value.field == "structured.regex"


def test_greedy_constrained_output_equals_the_masked_reference(smol, demo_gguf, hf_gguf):
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import torch

    tokenizer, hf = hf_gguf(demo_gguf("smollm2-135m"))
    engine = smol.engine
    prompt = chat("Describe a person in JSON.")
    params = SamplingParams(
        max_tokens=24, temperature=0, structured=StructuredOutputsParams(json=SCHEMA)
    )
    got = smol.generate([prompt], params)[0].token_ids

    vocab = engine.model_config.vocab_size
    eos = list(engine.model_config.eos_token_ids)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    ids = engine.tokenizer.encode(prompt)
    want: list[int] = []
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    past, feed = None, ids
    while len(want) < 24 and not matcher.is_stopped():
        with torch.no_grad():
            out = hf(torch.tensor([feed]), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1].numpy(), out.past_key_values
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        token = int(np.argmax(np.where(bits, logits, -np.inf)))
        assert matcher.consume_token(token)
        want.append(token)
        feed = [token]
    assert got == want


def test_a_new_schema_never_stalls_a_stream(demo_model, tiny_checkpoint):
    """Preparing a structured request (its grammar, and on a model's first one llguidance's
    tokenizer: ~0.5 s for SmolLM2's 49k tokens) keeps off the event loop: a stream running
    meanwhile gets its tokens as ever. A tiny model with SmolLM2's tokenizer keeps the
    steps short."""
    tokenizer = demo_model("smollm2-135m").tokenizer
    tiny = models.load(str(tiny_checkpoint("llama", vocab_size=49152)), dtype="float32")
    config = EngineConfig(
        dtype="float32",
        max_seq_len=512,
        max_batch_size=2,
        warmup=False,
        compilation_cache_dir=None,
    )
    plain = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    late = SamplingParams(max_tokens=4, structured=StructuredOutputsParams(json=SCHEMA))

    async def stream_while_a_schema_arrives(aengine):
        stamps, started, done = [], asyncio.Event(), asyncio.Event()

        async def stream():
            async with contextlib.aclosing(
                aengine.generate(PromptRequest([5, 6, 7], plain))
            ) as outs:
                async for _ in outs:
                    stamps.append(time.perf_counter())
                    if len(stamps) == 3:
                        started.set()
                    if done.is_set():
                        return

        async def schema():
            await started.wait()
            start = time.perf_counter()
            async for _ in aengine.generate(PromptRequest([8, 9], late)):
                pass
            done.set()
            return start, time.perf_counter()

        _, (start, end) = await asyncio.gather(stream(), schema())
        assert stamps[-1] > end, "the stream ended before the structured request did"
        return [b - a for a, b in itertools.pairwise(stamps) if b > start and a < end]

    def run():
        # a copy of the tokenizer: a new model to llguidance, whose tokenizer it builds again
        model = dataclasses.replace(tiny, tokenizer=copy.deepcopy(tokenizer))
        aengine = AsyncEngine(Engine(model, config))
        aengine.start()
        try:
            return asyncio.run(stream_while_a_schema_arrives(aengine)), aengine.stats()
        finally:
            aengine.stop()

    run()  # compiles the programs both runs need (jitted programs outlive their engine)
    gaps, stats = run()
    assert stats["compilations"] == 0
    assert gaps and max(gaps) < 0.1, gaps
