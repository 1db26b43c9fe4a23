"""Data parallelism on fake CPU devices: 2 replicas x tensor parallel 2 behind one router
give a single engine's tokens, keep prefix-cache hits, and show the router in /metrics.

Runs in the subprocess with 8 devices that tests/integration/test_tensor_parallel.py
starts; collected in the main process it skips.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax
import pytest

import jpaged
from jpaged import SamplingParams, models
from jpaged.engine.interface import PromptRequest
from jpaged.engine.router import Replicas

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: tests/integration/test_tensor_parallel.py"
)

ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_seq_len=64,
    max_batch_size=4,
    max_num_batched_tokens=8,
    warmup=False,
    compilation_cache_dir=None,
)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], list(range(30, 43)), [40, 41, 42, 43, 44, 45, 46, 47, 9], [200, 7]]
PARAMS = [GREEDY, GREEDY, GREEDY, dataclasses.replace(GREEDY, n=2)]
# six prompt families of four, each sharing a 3-block prefix: the second to fourth of a
# family hit the first's blocks, if they run where it ran
SHARED = [[10 * f + t for t in range(12)] for f in range(6)]
FAMILIES = [[*SHARED[f], 100 + i] for i in range(4) for f in range(6)]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", num_attention_heads=8, num_key_value_heads=8)


def tokens(outs: list[jpaged.Completion]) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.choices] for out in outs]


def devices_of(engine: Any) -> set[jax.Device]:
    return set(engine.runner.kv.k.sharding.device_set) | {
        d for leaf in jax.tree.leaves(engine.runner.state) for d in leaf.sharding.device_set
    }


def test_two_replicas_of_two_devices_generate_one_engines_tokens(llama):
    single = jpaged.LLM(models.load(llama, dtype="float32"), **ENGINE)
    expected = tokens(single.generate(PROMPTS, PARAMS))
    llm = jpaged.LLM(str(llama), tensor_parallel=2, data_parallel=2, **ENGINE)
    assert isinstance(llm.engine, Replicas)
    a, b = llm.engine.replicas
    assert devices_of(a) == set(jax.devices()[:2]) and devices_of(b) == set(jax.devices()[2:4])
    assert tokens(llm.generate(PROMPTS, PARAMS)) == expected
    adapter = jpaged.LoRARequest("a", 1, str(llama))  # LoRA is not served with replicas yet
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=adapter)
    stats = llm.stats()
    # nothing shares a prefix: least loaded, alternately
    assert stats['router_routed{replica="0"}'] == stats['router_routed{replica="1"}'] == 2
    assert stats["router_least_loaded"] == 4 and stats["router_prefix"] == 0
    assert stats["requests_finished"] == 4 and stats["kv_blocks_used"] == 0
    # beam searches go through the router too, each on one replica
    beams = jpaged.BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    want = [[s.token_ids for s in o.sequences] for o in single.beam_search(PROMPTS[:2], beams)]
    got = [[s.token_ids for s in o.sequences] for o in llm.beam_search(PROMPTS[:2], beams)]
    assert got == want
    assert all(e.cache.audit() == [] for e in llm.engine.replicas)


def test_prefix_sharing_workload_keeps_its_hit_rate(llama):
    rates = []
    for dp in (1, 2):
        llm = jpaged.LLM(str(llama), data_parallel=dp, **ENGINE)
        outs = llm.generate(FAMILIES, GREEDY)
        assert all(o.finish_reason == "length" for o in outs)
        rates.append(llm.stats()["kv_prefix_cache_hit_rate"])
    stats = llm.stats()
    assert rates[0] > 0.5 and rates[1] >= 0.9 * rates[0], rates
    assert stats["router_prefix"] == 18 and stats["router_least_loaded"] == 6
    assert stats['router_routed{replica="0"}'] == stats['router_routed{replica="1"}'] == 12
    for i in "01":  # each replica's own hits, beside the totals
        assert stats[f'kv_prefix_cache_hits{{replica="{i}"}}'] > 0


def test_too_few_devices_are_refused_before_loading(llama):
    with pytest.raises(
        ValueError,
        match=r"data_parallel=5 x tensor_parallel=2 needs 10 devices, "
        r"but JAX sees 8 cpu",
    ):
        jpaged.LLM("no/such/checkpoint", tensor_parallel=2, data_parallel=5, **ENGINE)
    with pytest.raises(ValueError, match="EngineConfig.data_parallel must be a positive int"):
        jpaged.LLM(str(llama), data_parallel=0, **ENGINE)


def test_server_over_replicas_answers_and_labels_metrics(llama, integration):
    config = jpaged.EngineConfig(tensor_parallel=2, data_parallel=2, **ENGINE)
    engine = Replicas(models.load(llama, dtype="float32", tensor_parallel=2), config)
    with integration("conftest")._serve(engine, api_keys=["k"]) as served:
        auth = {"Authorization": "Bearer k"}
        body = {"prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0, "n": 2}
        with httpx.Client(base_url=served.url, timeout=60) as client:
            assert client.post("/v1/completions", json=body).status_code == 401
            # a batch of two: the second arrives while the first runs, so it goes to replica 1
            prompts = [[5, 17, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
            r = client.post("/v1/completions", json={**body, "prompt": prompts}, headers=auth)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 4
            text = client.get("/metrics").text
        assert 'jpaged_router_routed{replica="0"} 1.0' in text
        assert 'jpaged_router_routed{replica="1"} 1.0' in text
        assert "# TYPE jpaged_router_routed counter" in text
        assert 'jpaged_requests_finished{replica="1"} 1.0' in text
        assert "\njpaged_requests_finished 2.0" in text
        assert text.count("# TYPE jpaged_running gauge") == 1
    assert all(e.cache.audit() == [] for e in engine.replicas)


def test_ratios_stay_ratios(llama):
    ngram = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = jpaged.LLM(str(llama), data_parallel=2, speculative=ngram, **ENGINE)
    repetitive = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]  # one each replica, both drafting
    llm.generate(repetitive, GREEDY)
    stats = llm.stats()
    drafted = [stats[f'spec_draft_tokens{{replica="{i}"}}'] for i in "01"]
    assert all(drafted), drafted
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == pytest.approx(rate)
    length = 1 + stats["spec_accepted_tokens"] / stats["spec_drafts"]
    assert stats["spec_mean_acceptance_length"] == pytest.approx(length)


def test_a_full_queue_turns_a_prefix_match_away_and_early_aborts_hold(llama):
    # room for one waiting request a replica, and a slack a prefix match stays within
    options = {**ENGINE, "max_num_batched_tokens": 64, "max_waiting_requests": 1}
    engine = jpaged.LLM(str(llama), data_parallel=2, **options).engine
    first, second = (engine.prepare(PromptRequest(p, GREEDY)) for p in (FAMILIES[0], FAMILIES[6]))
    engine.add(first)
    engine.add(second)  # its prefix's replica (0) has no room left: the other one takes it
    assert [e.scheduler.num_waiting for e in engine.replicas] == [1, 1]
    assert engine.router.counters["router_prefix_overruled"] == 1
    # an abort that comes before its request is routed (an engine loop adds it later)
    late = engine.prepare(PromptRequest(FAMILIES[1], GREEDY))
    engine.abort(late.id)
    engine.add(late)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    reasons = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert reasons == {first.id: "length", second.id: "length", late.id: "abort"}
    assert all(e.cache.audit() == [] for e in engine.replicas)


def test_bench_serving_drives_replicas(llama, tmp_path):
    from benchmarks import bench_serving

    common = ["--model", str(llama), "--backend", "paged", "--workload", "long_tail"]
    common += ["--num-requests", "6", "--max-seq-len", "64", "--block-size", "16"]
    common += ["--paged-batch-sizes", "4", "--warmup", "workload", "--no-progress"]
    runs = []
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}.json"
        flags = ["--data-parallel", str(dp), "--out", str(out), "--plot", "none"]
        bench_serving.main([*common, *flags])
        (run,) = json.loads(out.read_text())["runs"]
        runs.append(run)
    one, two = runs
    assert two["label"] == "paged b4 dp2" and two["config"]["data_parallel"] == 2
    assert two["completed"] == 6 and two["failed"] == 0
    assert two["generated_tokens"] == one["generated_tokens"]
    assert two["kv_bytes"] == 2 * one["kv_bytes"] and two["compilations_in_run"] == 0
    assert sum(two["decode_buckets"].values()) == two["decode_calls"] > 0
