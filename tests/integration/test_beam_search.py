"""Beam search on shared blocks: transformers' `generate(num_beams=...)` token for token,
paged == contiguous, memory held, and beam groups inside continuous batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jpaged import LLM, BeamSearchParams, RequestError, SamplingParams, models
from jpaged.engine.interface import PromptRequest

SMALL = dict(dtype="float32", warmup=False, max_seq_len=64, max_batch_size=8, block_size=4)
PROMPTS = [[5, 17, 99, 3], list(range(30, 53))]


def hf_beams(hf, prompt, width, max_tokens, eos, length_penalty=1.0):
    """transformers' `width` best beams: (generated ids, score) each, best first."""
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt)),
        max_new_tokens=max_tokens,
        do_sample=False,
        num_beams=width,
        num_return_sequences=width,
        length_penalty=length_penalty,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=eos or None,
        pad_token_id=(eos or [0])[0],
    )
    return [
        (out.sequences[i, len(prompt) :].tolist(), float(out.sequences_scores[i]))
        for i in range(width)
    ]


def assert_matches(got, expected, length_penalty=1.0):
    """Our hypotheses are transformers' (its padding past an EOS cut off), scores to 1e-4
    (cumulative log-probabilities to 1e-4 a token: float32 rounds differently by CPU)."""
    assert len(got.sequences) == len(expected)
    for seq, (ids, score) in zip(got.sequences, expected, strict=True):
        assert seq.token_ids == ids[: len(seq.token_ids)]
        n = len(seq.token_ids)
        assert seq.cum_logprob == pytest.approx(score * n**length_penalty, abs=1e-4 * n)
        assert seq.score == pytest.approx(score, abs=1e-4)


def same(a, b):
    """The same hypotheses in the same order, their scores equal up to float32 rounding
    (two engines batch, and so round, differently)."""
    return all(
        [s.token_ids for s in x.sequences] == [s.token_ids for s in y.sequences]
        and np.allclose(
            [s.cum_logprob for s in x.sequences], [s.cum_logprob for s in y.sequences], atol=1e-5
        )
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_fixed_length_beams_equal_transformers_on_both_backends(
    family, loaded, tiny_checkpoint, hf_reference
):
    model = loaded(family)
    hf = hf_reference(tiny_checkpoint(family))
    paged = LLM(model, **SMALL)
    contiguous = LLM(model, backend="contiguous", **SMALL)
    for width in (2, 4):
        params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
        got = paged.beam_search(PROMPTS, params)
        for prompt, out in zip(PROMPTS, got, strict=True):
            assert_matches(out, hf_beams(hf, prompt, width, 8, None))
            assert {s.finish_reason for s in out.sequences} == {"length"}
        assert same(contiguous.beam_search(PROMPTS, params), got)
    assert paged.engine.cache.audit() == [] and paged.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def eos_llama(tiny_checkpoint, hf_reference, tmp_path_factory):
    """The tiny Llama with EOS's (tied) embedding between those of the tokens it likes to
    repeat, so EOS competes: some beams end early, some run to max_tokens."""

    def make(scale: float):
        path = tiny_checkpoint("llama")
        hf = type(hf_reference(path)).from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        with torch.no_grad():
            w = hf.lm_head.weight
            w[257] = scale * 0.5 * (w[3] + w[52])
        out = tmp_path_factory.mktemp(f"eos-llama-{scale}")
        hf.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (out / name).write_bytes((path / name).read_bytes())
        return models.load(str(out), dtype="float32"), hf.eval()

    return make


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_beams_that_end_on_eos_equal_transformers(eos_llama, scale):
    model, hf = eos_llama(scale)
    eos = list(model.config.eos_token_ids)
    llm = LLM(model, **SMALL)
    reasons = []
    for length_penalty in (1.0, 0.0, 2.0):
        params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=length_penalty)
        for prompt, out in zip(PROMPTS, llm.beam_search(PROMPTS, params), strict=True):
            assert_matches(out, hf_beams(hf, prompt, 4, 8, eos, length_penalty), length_penalty)
            reasons += [(s.finish_reason, len(s.token_ids)) for s in out.sequences]
    # the test means something: beams ended on EOS, before max_tokens too, and others did not
    assert ("length", 8) in reasons and any(r == "stop" and n < 8 for r, n in reasons)
    assert llm.engine.cache.audit() == []


def test_width_one_is_greedy_and_bad_params_name_their_field(model):
    llm = LLM(model, **SMALL)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10))
    assert [b.sequences[0].token_ids for b in beams] == [g.token_ids for g in greedy]
    for bad, field in [
        (dict(beam_width=0), "beam_width"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(early_stopping="soon"), "early_stopping"),
    ]:
        with pytest.raises(RequestError) as e:
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
        assert e.value.field == field and field in str(e.value)
    with pytest.raises(RequestError, match="beam_width: 9 beams exceed max_batch_size"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=9, max_tokens=4))


def test_four_beams_hold_the_prompt_once_and_free_everything(model):
    """4 beams over a 256-token prompt: never more than the prompt's blocks + 4 x (generated
    blocks + 1), where 4 independent sequences hold the prompt 4 times."""
    bs, new = 16, 24
    llm = LLM(
        model,
        dtype="float32",
        warmup=False,
        max_seq_len=512,
        max_batch_size=8,
        block_size=bs,
        num_blocks=200,
    )
    prompt = np.random.default_rng(0).integers(0, 256, 256).tolist()
    engine = llm.engine
    req = engine.prepare(
        PromptRequest(prompt, BeamSearchParams(beam_width=4, max_tokens=new, ignore_eos=True))
    )
    engine.add(req)
    peak, forks = 0, 0
    while engine.has_unfinished():
        engine.step()
        used = engine.cache.stats()["blocks_used"]
        peak = max(peak, used)
        forks = max(forks, engine.cache.stats()["cow_copies"])
    bound = 256 // bs + 4 * (-(-new // bs) + 1)
    assert 256 // bs < peak <= bound and forks > 0
    assert engine.cache.stats()["blocks_used"] == 0 and engine.cache.audit() == []


def test_beam_groups_batch_with_requests_preempt_whole_and_cancel(model):
    """Beam groups beside sampled requests in one step, in a pool so small that groups are
    preempted (whole) and recomputed: the same results as a roomy pool, nothing leaked."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, 20).tolist() for _ in range(4)]
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    roomy = LLM(model, **SMALL)
    want = roomy.beam_search(prompts, params)
    want_greedy = roomy.generate(prompts, greedy)
    tight = LLM(model, **dict(SMALL, num_blocks=24))
    engine = tight.engine
    beams = [engine.add(engine.prepare(PromptRequest(p, params))) for p in prompts]
    plain = [engine.add(engine.prepare(PromptRequest(p, greedy))) for p in prompts]
    mixed = False
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        mixed |= any(r.beam for r in running) and any(not r.beam for r in running)
    assert mixed and engine.scheduler.num_preemptions > 0
    from jpaged.engine.llm import BeamSearchOutput, Completion

    assert same([BeamSearchOutput.of(s, 1.0) for s in beams], want)
    assert [Completion.of(s).token_ids for s in plain] == [c.token_ids for c in want_greedy]
    assert engine.cache.audit() == [] and engine.cache.stats()["blocks_used"] == 0
    # cancelled mid-search: every beam's blocks come back
    req = engine.prepare(PromptRequest(prompts[0], params))
    state = engine.add(req)
    for _ in range(4):
        engine.step()
    engine.abort(req.id)
    while engine.has_unfinished():
        engine.step()
    assert {c.finish_reason for c in state.choices} == {"abort"}
    assert engine.cache.audit() == [] and engine.cache.stats()["blocks_used"] == 0


def test_prefix_caching_and_stop_strings(model):
    llm = LLM(model, **SMALL)
    off = LLM(model, enable_prefix_caching=False, **SMALL)
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    first = llm.beam_search(PROMPTS, params)
    assert same(llm.beam_search(PROMPTS, params), first)
    assert same(off.beam_search(PROMPTS, params), first)
    assert llm.stats()["kv_prefix_cache_hits"] > 0
    # a stop string ends a beam as EOS would: its text stops before it
    text = llm.tokenizer.decode(first[1].sequences[0].token_ids)
    stop = text[2:4]
    out = llm.beam_search(
        PROMPTS[1], BeamSearchParams(beam_width=2, max_tokens=8, stop=[stop], ignore_eos=True)
    )[0]
    best = out.sequences[0]
    assert best.finish_reason == "stop" and stop not in best.text and len(best.token_ids) < 8


def test_smollm2_beams_equal_transformers(demo_model, demo_gguf, hf_gguf):
    model = demo_model("smollm2-135m")
    tok, hf = hf_gguf(demo_gguf("smollm2-135m"))
    llm = LLM(model, dtype="float32", warmup=False, max_seq_len=128, max_batch_size=8)
    prompt = tok.encode("The three primary colors are")
    for width in (2, 4):
        params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
        assert_matches(llm.beam_search([prompt], params)[0], hf_beams(hf, prompt, width, 8, None))


def test_server_answers_the_beams_as_choices(model, serve):
    import httpx

    from jpaged.config import EngineConfig
    from jpaged.engine.engine import Engine

    config = EngineConfig(**dict(SMALL, max_waiting_requests=8))
    want = LLM(model, **SMALL).beam_search(
        PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    )
    with serve(Engine(model, config)) as served, httpx.Client(base_url=served.url) as client:
        body = {
            "prompt": PROMPTS,
            "n": 3,
            "use_beam_search": True,
            "max_tokens": 6,
            "ignore_eos": True,
            "length_penalty": 0.5,
            "temperature": 1.0,
        }
        r = client.post("/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        assert [c["text"] for c in choices] == [s.text for o in want for s in o.sequences]
        assert {c["finish_reason"] for c in choices} == {"length"}
        for field, extra in [
            ("stream", {"stream": True}),
            ("echo", {"echo": True}),
            ("logprobs", {"logprobs": 0}),
            ("length_penalty", {"length_penalty": 11}),
        ]:
            r = client.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = client.post("/v1/completions", json={**body, "n": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        props = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert {"use_beam_search", "length_penalty"} <= set(props["properties"])
        served.assert_idle()


def test_a_failed_step_fails_the_whole_search(model, monkeypatch):
    from jpaged.engine import programs
    from jpaged.engine.llm import BeamSearchOutput

    llm = LLM(model, **SMALL)
    real = programs.step_fn

    def flaky(fail_at):
        calls = {"n": 0}

        def step(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise RuntimeError("boom")
            return real(*args, **kwargs)

        return step

    for fail_at in (1, 3):  # the prompt's step (3 beams not forked yet), or a search step
        monkeypatch.setattr(programs, "step_fn", flaky(fail_at))
        engine = llm.engine
        state = engine.add(
            engine.prepare(PromptRequest(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=8)))
        )
        for _ in range(20):
            engine.step()
        assert not engine.has_unfinished()
        out = BeamSearchOutput.of(state, 1.0)
        assert [s.finish_reason for s in out.sequences] == ["error"] * 4 and "boom" in out.error
        assert engine.cache.audit() == [] and llm.stats()["kv_blocks_used"] == 0


def test_beams_beside_drafting_requests(model):
    """Speculative decoding drafts for the sampled requests, never for beams: both give
    what they give without it."""
    from jpaged.engine.llm import BeamSearchOutput, Completion

    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
        "disable_by_batch_size": 8,
    }
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(model, **SMALL)
    llm = LLM(model, speculative=spec, **SMALL)
    engine = llm.engine
    beams = [engine.add(engine.prepare(PromptRequest(p, params))) for p in PROMPTS]
    sampled = [engine.add(engine.prepare(PromptRequest(p, greedy))) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert same([BeamSearchOutput.of(s, 1.0) for s in beams], plain.beam_search(PROMPTS, params))
    assert [Completion.of(s).token_ids for s in sampled] == [
        c.token_ids for c in plain.generate(PROMPTS, greedy)
    ]
    assert llm.stats()["spec_accepted_tokens"] > 0 and engine.cache.audit() == []
