"""Speculative decoding end to end on tiny checkpoints: outputs equal speculation off."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jpaged import LLM, SamplingParams, models

NGRAM = {
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 8,
}
SMALL = dict(dtype="float32", warmup=False, max_seq_len=96, max_batch_size=8, block_size=4)
# repetitive prompts (the tiny random models also tend to repeat themselves), one shared
# prefix for the prefix cache
rng = np.random.default_rng(0)
PROMPTS = [[int(t) for t in rng.integers(3, 250, 5)] * 3 for _ in range(4)]
PROMPTS += [PROMPTS[0] + [7, 8, 9], list(range(30, 50))]


def run(model, params, **options):
    llm = LLM(model, **SMALL, **options)
    out = llm.generate(PROMPTS, params)
    stats_ = llm.stats()
    assert stats_["kv_blocks_used"] == 0 and llm.engine.cache.audit() == []
    return out, stats_


def choices(completions):
    return [(c.token_ids, c.finish_reason) for comp in completions for c in comp.choices]


@pytest.mark.parametrize(
    ("family", "backend", "options"),
    [
        ("llama", "paged", {}),
        # chunked prompts, and drafts that must leave every decode its token of the budget
        ("llama", "paged", {"async_scheduling": False, "max_num_batched_tokens": 8}),
        ("qwen3", "paged", {}),
        ("gemma3", "paged", {}),
        ("llama", "contiguous", {}),
        ("gemma3", "contiguous", {}),
        ("llama-untied", "paged", {}),  # diverse outputs: many drafts rejected
    ],
)
def test_greedy_equals_speculation_off(family, backend, options, loaded, tiny_checkpoint):
    if family == "llama-untied":
        path = tiny_checkpoint("llama", tie_word_embeddings=False)
        model = models.load(str(path), dtype="float32")
    else:
        model = loaded(family)
    paged = backend == "paged"
    # paged: n = 2, and a pool that preempts (Gemma's KV groups hold more blocks a token)
    opts = dict(backend=backend, **options)
    if paged:
        opts["num_blocks"] = 90 if family == "gemma3" else 30
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=0,
            logprobs=2,
            ignore_eos=True,
            n=2 if paged and i == 1 else 1,
        )
        for i in range(len(PROMPTS))
    ]
    off, _ = run(model, params, **opts)
    on, s_on = run(model, params, speculative=NGRAM, **opts)
    assert choices(on) == choices(off)
    for a, b in zip(on, off, strict=True):
        for ca, cb in zip(a.choices, b.choices, strict=True):
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-4)
            assert [list(t) for t in ca.top_logprobs] == [list(t) for t in cb.top_logprobs]
    assert s_on["spec_accepted_tokens"] > 0  # the test can fail: drafts were taken
    assert sum(c.num_accepted_tokens for c in on) == s_on["spec_accepted_tokens"]
    if family == "llama-untied":
        assert s_on["spec_draft_tokens"] > s_on["spec_accepted_tokens"] + 10  # rolled back
    if paged and family != "llama-untied" and not options:
        assert s_on["preemptions"] > 0


def test_stop_strings_and_max_tokens_cut_inside_accepted_drafts(loaded):
    model = loaded("qwen3")
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    off, _ = run(model, params)
    # stop at text a few tokens into each completion: accepted drafts run past it
    stops = [c.text[len(c.text) // 3 :][:2] or "x" for c in off]
    with_stops = [
        SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, stop=[s]) for s in stops
    ]
    off, _ = run(model, with_stops)
    on, s_on = run(model, with_stops, speculative=NGRAM)
    assert [(c.text, c.token_ids, c.finish_reason) for c in on] == [
        (c.text, c.token_ids, c.finish_reason) for c in off
    ]
    assert any(c.finish_reason == "stop" for c in on) and s_on["spec_accepted_tokens"] > 0


def test_sampled_tokens_follow_the_distribution_without_speculation(loaded):
    """Different seeds on and off: the tokens sampled at the drafted positions have the
    same distribution (chi-square); the same seeds give the same tokens (each position
    draws with its output index's key)."""
    model = loaded("llama")  # at temperature 2 it repeats its last token about 6 times in 7
    prompt = [40, 41, 40, 41, 40, 41, 40]

    def sample(seeds, **options):
        llm = LLM(model, **options, **SMALL)
        params = [
            SamplingParams(max_tokens=3, temperature=2.0, seed=s, ignore_eos=True) for s in seeds
        ]
        # a few at a time: with requests waiting for a row, nobody drafts
        out = [
            c
            for i in range(0, len(seeds), 4)
            for c in llm.generate([prompt] * 4, params[i : i + 4])
        ]
        return np.array([c.token_ids for c in out]), llm.stats()

    n = 240
    off, _ = sample(range(n))
    on, s_on = sample(range(n, 2 * n), speculative=NGRAM)
    assert s_on["spec_accepted_tokens"] > 50
    assert s_on["spec_draft_tokens"] > s_on["spec_accepted_tokens"] + 10  # and rejected
    for pos in (1, 2):  # the positions drafts were verified at
        tokens, counts = np.unique(np.concatenate([off[:, pos], on[:, pos]]), return_counts=True)
        common = tokens[counts >= 10]  # the others pooled into one category
        table = np.array(
            [
                [np.sum(x[:, pos] == t) for t in common] + [np.sum(~np.isin(x[:, pos], common))]
                for x in (off, on)
            ]
        )
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > 0.001, table
    # reproducible, and the same as without speculation for the same seeds
    again, _ = sample(range(n, 2 * n), speculative=NGRAM)
    plain, _ = sample(range(n, 2 * n))
    assert (again == on).all() and (plain == on).all()


def test_zero_compilations_after_warmup_with_speculation(loaded):
    llm = LLM(
        loaded("llama"),
        dtype="float32",
        max_seq_len=128,
        max_batch_size=4,
        block_size=4,
        max_num_batched_tokens=32,
        speculative=NGRAM,
    )
    warm = llm.engine.warmup_compilations
    # 5 step programs; sample rows 1, 4, 8 and 16 (4 sequences + 3 drafts each) for the
    # 4 sampler variants; the block copy
    assert warm <= 5 + 4 * 4 + 1
    params = [
        SamplingParams(max_tokens=int(m), temperature=t, ignore_eos=True, seed=1, logprobs=lp)
        for m, t, lp in ((30, 0, None), (20, 0.8, 2), (9, 0, 1), (25, 0.8, None))
    ]
    out = llm.generate([PROMPTS[0], PROMPTS[1], [5], PROMPTS[5]], params)
    assert [len(c.token_ids) for c in out] == [p.max_tokens for p in params]
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 0 and s["compilations_after_warmup"] == 0


def test_grammar_and_penalty_rows_beside_drafting_rows(demo_model):
    """Rows that sample several positions shift the others': grammar masks and penalty
    slots still reach their own rows (those requests never draft)."""
    from jpaged.engine.sampling import StructuredOutputsParams

    model = demo_model("smollm2-135m")
    listing = "\n".join(f"{k}. item {k * 7}" for k in range(1, 9))
    prompts = [f"Copy this list:\n{listing}\n\nCopy:\n1.", "The answer is", "Once upon"]
    params = [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(
            max_tokens=6, temperature=0, structured=StructuredOutputsParams(regex="( yes| no)+")
        ),
        SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.0),
    ]
    opts = dict(dtype="float32", warmup=False, max_seq_len=128, max_batch_size=4)
    off = LLM(model, **opts).generate(prompts, params)
    llm = LLM(model, speculative=NGRAM, **opts)
    on = llm.generate(prompts, params)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert on[0].num_accepted_tokens > 0 and on[1].num_draft_tokens == on[2].num_draft_tokens == 0


def test_server_reports_drafts_in_usage_and_metrics(loaded, serve):
    import httpx

    from jpaged.config import EngineConfig
    from jpaged.engine.engine import Engine

    engine = Engine(loaded("llama"), EngineConfig(speculative=NGRAM, **SMALL))
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
    with serve(engine) as served, httpx.Client(base_url=served.url) as client:
        doc = client.post("/v1/completions", json=body).json()
        metrics = client.get("/metrics").text
    details = doc["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert f"jpaged_spec_accepted_tokens {details['accepted_prediction_tokens']}" in metrics
    assert "# TYPE jpaged_spec_draft_tokens counter" in metrics


def test_no_drafts_past_disable_by_batch_size(loaded):
    # six sequences decode together to the end: more than two run at every step
    spec = {**NGRAM, "disable_by_batch_size": 2}
    _, s = run(
        loaded("llama"),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        speculative=spec,
    )
    assert s["spec_draft_tokens"] == 0


def test_bench_serving_runs_each_configuration_off_and_on(tiny_llama_dir, tmp_path, capsys):
    from benchmarks import bench_serving

    report = bench_serving.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--backend",
            "paged",
            "--workload",
            "long_tail",
            "--num-requests",
            "3",
            "--out",
            str(tmp_path / "s.json"),
            "--plot",
            "none",
            "--max-seq-len",
            "64",
            "--block-size",
            "16",
            "--max-num-batched-tokens",
            "32",
            "--contiguous-batch-size",
            "2",
            "--paged-batch-sizes",
            "4",
            "--no-progress",
            "--speculative-ngram",
            "3",
            "--prompt-lookup-min",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert [r["label"] for r in report["runs"]] == ["paged b4", "paged b4 ngram3"]
    assert "spec: mean acceptance length" in printed
    assert "paged b4 ngram3 / paged b4: output tok/s x" in printed
    assert report["runs"][1]["spec_accepted_tokens"] > 0
