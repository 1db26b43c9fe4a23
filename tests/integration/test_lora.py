"""LoRA adapters against PEFT, the reference library: logits and greedy tokens with an
adapter, the merged model, one step mixing adapters and the base model, the prefix cache
kept apart per adapter, and run-time load/unload over HTTP."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from jpaged import LLM, LoRARequest, SamplingParams, models
from jpaged.config import EngineConfig
from jpaged.engine import lora as engine_lora
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.engine import Engine
from jpaged.engine.interface import PromptRequest
from jpaged.engine.lora import AdapterInUse
from jpaged.models import lora
from server.app import build_app

peft = pytest.importorskip("peft")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE = dict(
    dtype="float32", warmup=False, block_size=4, max_batch_size=4, max_seq_len=64,
    max_num_batched_tokens=32, lora={"max_loras": 3, "max_lora_rank": 8},
)  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 42, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38], [200, 7, 61], [9, 90, 19]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="session")
def peft_adapter(
    tiny_checkpoint: Callable[..., Path],
    hf_reference: Callable[[Path], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, Any]]:
    """`peft_adapter(family, seed, rank, targets, rslora)`: a random adapter (B not zero:
    not a no-op) saved by PEFT, and the PEFT model that wrote it."""
    cache: dict[tuple, tuple[Path, Any]] = {}

    def make(
        family: str,
        seed: int = 1,
        rank: int = 4,
        targets: tuple[str, ...] = ALL,
        rslora: bool = False,
    ) -> tuple[Path, Any]:
        key = (family, seed, rank, targets, rslora)
        if key not in cache:
            base = copy.deepcopy(hf_reference(tiny_checkpoint(family)))
            torch.manual_seed(seed)
            config = peft.LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(targets),
                init_lora_weights=False,
                use_rslora=rslora,
            )
            model = peft.get_peft_model(base, config).eval()
            out = tmp_path_factory.mktemp(f"lora-{family}")
            model.save_pretrained(out)
            cache[key] = (out, model)
        return cache[key]

    return make


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("family", "rank", "targets", "rslora"),
    [
        ("llama", 4, ALL, False),
        ("qwen3", 8, ("q_proj", "v_proj", "down_proj"), True),
        ("gemma3", 2, ALL, False),
    ],
)
def test_logits_and_greedy_tokens_equal_peft_and_the_merged_model(
    family: str,
    rank: int,
    targets: tuple[str, ...],
    rslora: bool,
    loaded: Callable[[str], Any],
    peft_adapter: Callable[..., tuple[Path, Any]],
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    path, reference = peft_adapter(family, rank=rank, targets=targets, rslora=rslora)
    base = loaded(family)
    adapter = lora.load_adapter(path, base.config, max_rank=8)
    ids = np.array([PROMPTS[0], PROMPTS[1][:6]], np.int32)
    with torch.no_grad():
        want = reference(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    slots = jnp.ones(ids.size, jnp.int32)
    got = models.logits(
        base.model, jnp.asarray(ids), adapters=lora.batch([adapter], slots, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    plain = np.asarray(models.logits(base.model, jnp.asarray(ids)))
    assert np.abs(plain - want).max() > 1e-2  # the adapter changes the model

    # merge_and_unload's weights, loaded as a plain checkpoint
    merged_dir = tmp_path / "merged"
    shutil.copytree(tiny_checkpoint(family), merged_dir)
    merged = copy.deepcopy(reference).merge_and_unload()
    merged.save_pretrained(tmp_path / "weights")
    shutil.copy(tmp_path / "weights" / "model.safetensors", merged_dir / "model.safetensors")
    merged_logits = models.logits(
        models.load(str(merged_dir), dtype="float32").model, jnp.asarray(ids)
    )
    np.testing.assert_allclose(np.asarray(merged_logits), np.asarray(got), atol=1e-4, rtol=1e-4)

    llm = LLM(base, **ENGINE)
    out = llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("a", 1, str(path)))
    for prompt, completion in zip(PROMPTS[:2], out, strict=True):
        assert completion.token_ids == _hf_greedy(reference, prompt, GREEDY.max_tokens)
    # the engine ran the adapter: the runners-up moved (tiny random models are so sure of
    # their greedy token that an adapter rarely changes it)
    base_out = llm.generate(PROMPTS[:2], GREEDY)
    assert [c.top_logprobs for c in out] != [c.top_logprobs for c in base_out]


def test_one_step_mixing_three_adapters_and_the_base_model(
    loaded: Callable[[str], Any], peft_adapter: Callable[..., tuple[Path, Any]]
) -> None:
    requests = [
        LoRARequest(f"ad{i}", i, str(peft_adapter("llama", seed=i, rank=r)[0]))
        for i, r in ((1, 4), (2, 8), (3, 2))
    ]
    llm = LLM(loaded("llama"), **ENGINE)
    alone = [
        llm.generate([p], GREEDY, lora_request=r)[0]
        for p, r in zip(PROMPTS, [*requests, None], strict=True)
    ]
    calls = llm.stats()["mixed_calls"] + llm.stats()["decode_calls"]
    together = llm.generate(PROMPTS, GREEDY, lora_request=[*requests, None])
    # one call per output token: every row in every step
    assert llm.stats()["mixed_calls"] + llm.stats()["decode_calls"] - calls == GREEDY.max_tokens
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids
        np.testing.assert_allclose(t.logprobs, a.logprobs, atol=1e-5)
    assert llm.stats()["lora_resident"] == 3
    # the base model's row is the base model's: an engine without LoRA agrees
    plain = LLM(loaded("llama"), **{**ENGINE, "lora": None}).generate([PROMPTS[3]], GREEDY)[0]
    assert together[3].token_ids == plain.token_ids
    np.testing.assert_allclose(together[3].logprobs, plain.logprobs, atol=1e-6)


def test_prefix_cache_hits_only_within_an_adapter(
    loaded: Callable[[str], Any], peft_adapter: Callable[..., tuple[Path, Any]]
) -> None:
    a = LoRARequest("a", 1, str(peft_adapter("llama", seed=1)[0]))
    b = LoRARequest("b", 2, str(peft_adapter("llama", seed=2)[0]))
    # (configured with vLLM's keywords)
    engine = {k: v for k, v in ENGINE.items() if k != "lora"}
    llm = LLM(loaded("llama"), **engine, enable_lora=True, max_loras=3, max_lora_rank=8)
    assert llm.engine.config.lora == {**ENGINE["lora"], "max_cpu_loras": 3}
    prompt = list(range(40, 57))  # four full blocks of 4 before the last token
    params = SamplingParams(max_tokens=1, temperature=0)

    def hits(request: LoRARequest | None) -> float:
        before = llm.stats()["kv_prefix_cache_hits"]
        llm.generate([prompt], params, lora_request=request)
        return llm.stats()["kv_prefix_cache_hits"] - before

    assert [hits(a), hits(b), hits(None), hits(a), hits(b), hits(None)] == [0, 0, 0, 16, 16, 16]


def test_server_loads_swaps_and_unloads_adapters(
    loaded: Callable[[str], Any],
    peft_adapter: Callable[..., tuple[Path, Any]],
    serve: Any,
    tmp_path: Path,
) -> None:
    paths = {
        name: str(peft_adapter("llama", seed=i, rslora=True)[0]) for i, name in enumerate("abc", 1)
    }
    # (no prefix cache: a repeated prompt would run in a smaller bucket, compiled anew)
    lora_config = {"max_loras": 2, "max_lora_rank": 8}
    config = EngineConfig(**{**ENGINE, "lora": lora_config, "enable_prefix_caching": False})
    engine = Engine(loaded("llama"), config)
    engine.register_lora(LoRARequest("a", 1, paths["a"]))
    # the runtime endpoints are off unless asked for
    off = TestClient(build_app(AsyncEngine(engine), "tiny")).post(
        "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}
    )
    assert off.status_code == 404 and "--allow-runtime-lora" in off.json()["error"]["message"]
    root = tmp_path.parent  # (every adapter's directory is beside this test's)
    options = {"allow_runtime_lora": True, "lora_root": str(root)}
    with (
        serve(engine, **options) as served,
        httpx.Client(base_url=served.url, timeout=120) as client,
    ):
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert set(cards) == {"tiny", "a"} and cards["a"]["root"] == paths["a"]

        def complete(model: str) -> tuple[str, list[float]]:
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
            r = client.post("/v1/completions", json={**body, "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            choice = r.json()["choices"][0]
            return choice["text"], choice["logprobs"]["token_logprobs"]

        first = {m: complete(m) for m in ("a", "tiny")}
        assert first["a"] != first["tiny"]
        for name in "bc":
            r = client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[name]}
            )
            assert r.status_code == 200 and name in r.text
        again = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}
        )
        assert again.status_code == 400 and "already been loaded" in again.text
        # the body is read within the limits every route has
        huge = {"lora_name": "x", "lora_path": "x" * (4 << 20)}
        assert client.post("/v1/load_lora_adapter", json=huge).status_code == 413
        missing = {"lora_name": "x", "lora_path": str(root / "nope")}
        bad = client.post("/v1/load_lora_adapter", json=missing)
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        (tmp_path / "out").symlink_to("/")
        for outside in ("/etc", str(tmp_path / "out" / "etc"), str(root / ".." / "etc")):
            body = {"lora_name": "x", "lora_path": outside}
            r = client.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400 and "--lora-root" in r.json()["error"]["message"], outside

        # three adapters, two slots: each swaps in, evicting the least recently used one,
        # and nothing compiles (same shapes, only the slots' contents change)
        before = engine.stats()

        swapped = {m: complete(m) for m in ("b", "c", "a", "tiny")}
        after = engine.stats()
        assert after["compilations"] == before["compilations"]
        assert after["lora_evictions"] - before["lora_evictions"] == 2
        assert swapped["a"] == first["a"] and swapped["tiny"] == first["tiny"]
        assert len({text for text, _ in swapped.values()}) == 4

        # under load: more adapters wanted at once than slots, requests wait their turn
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            burst = list(pool.map(complete, "abcabc"))
        for (text, logprobs), m in zip(burst, "abcabc", strict=True):
            assert text == swapped[m][0]
            np.testing.assert_allclose(logprobs, swapped[m][1], atol=1e-5)
        # the other routes: responses and tokenize serve an adapter, embeddings refuse it
        ask = {"input": "hi", "max_output_tokens": 4, "temperature": 0}
        said = {m: client.post("/v1/responses", json={**ask, "model": m}) for m in ("a", "tiny")}
        assert said["a"].status_code == 200 and said["a"].json()["model"] == "a", said["a"].text
        texts = {
            m: "".join(c["text"] for item in r.json()["output"] for c in item["content"])
            for m, r in said.items()
        }
        assert texts["a"] != texts["tiny"]
        tokens = [
            client.post("/tokenize", json={"model": m, "prompt": "hi"}).json()["tokens"]
            for m in ("a", "tiny")
        ]
        assert tokens[0] == tokens[1]
        embed = client.post("/v1/embeddings", json={"model": "a", "input": "hi"})
        assert embed.status_code == 400 and "not supported" in embed.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert "# TYPE jpaged_lora_loads counter" in metrics
        assert "jpaged_lora_resident 2.0" in metrics
        # three adapters served, two host copies (max_cpu_loras: max_loras by default)
        assert "jpaged_lora_host_copies 2.0" in metrics

        # Both slots held by long requests and a request for c waiting: c's unload is
        # refused (a waiting request once held only c's name: the engine loop died of its
        # unload), every request runs to its end and the engine stays healthy. The engine
        # thread stops once c is queued, until the unload is answered: on a fast machine a
        # and b would otherwise end, and c after them, before the unload arrives.
        queued, resume = threading.Event(), threading.Event()
        add = engine.add

        def add_then_pause(request: Any) -> Any:
            state = add(request)
            if request.lora == "c":
                queued.set()
                assert resume.wait(60)
            return state

        long = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        with (  # (the stack's exit resumes the engine before the pool waits for c)
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            contextlib.ExitStack() as stack,
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(engine, "add", add_then_pause)
            stack.callback(resume.set)  # (never leave the engine thread stopped)
            streams = [
                stack.enter_context(
                    client.stream(
                        "POST", "/v1/completions", json={**long, "model": m, "stream": True}
                    )
                )
                for m in "ab"
            ]  # (each answers once its request runs: it holds a slot)
            waiting = pool.submit(client.post, "/v1/completions", json={**long, "model": "c"})
            assert queued.wait(60) and engine.stats()["waiting"] == 1
            refused = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
            resume.set()
            assert refused.status_code == 409, refused.text
            assert "in use by 1 request" in refused.json()["error"]["message"]
            assert client.get("/health").status_code == 200
            for stream in streams:
                *events, done = [e.removeprefix("data: ") for e in stream.iter_lines() if e]
                events = [json.loads(e) for e in events]
                assert done == "[DONE]" and all("error" not in e for e in events)
                assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert waiting.result().status_code == 200, waiting.result().text
            assert waiting.result().json()["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").status_code == 200

        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200 and "removed" in r.text
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
        gone = client.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 1})
        assert gone.status_code == 404
        assert "c" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
        served.assert_idle()
        assert engine.runner.lora is not None and not engine.runner.lora.held


def test_an_adapter_is_read_outside_the_engine_lock(
    loaded: Callable[[str], Any],
    peft_adapter: Callable[..., tuple[Path, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load reads and converts its files without the lock every step takes: the engine
    steps while an adapter is being read."""
    engine = Engine(loaded("llama"), EngineConfig(**ENGINE))
    reading, go = threading.Event(), threading.Event()
    read = engine_lora.load_adapter

    def slow(*args: Any) -> lora.Adapter:
        reading.set()
        assert go.wait(60)
        return read(*args)

    monkeypatch.setattr(engine_lora, "load_adapter", slow)
    request = LoRARequest("a", 1, str(peft_adapter("llama")[0]))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(engine.register_lora, request)
        try:
            assert reading.wait(60)
            free = engine._lock.acquire(blocking=False)
            if free:
                engine._lock.release()
        finally:
            go.set()
        loading.result()
    assert free, "the engine's lock was held while the adapter was read"
    assert engine.loras() == {"a": request}


def test_a_request_holds_its_adapter_to_its_end_and_fails_alone_without_it(
    loaded: Callable[[str], Any], peft_adapter: Callable[..., tuple[Path, Any]]
) -> None:
    engine = Engine(loaded("llama"), EngineConfig(**ENGINE))
    engine.register_lora(LoRARequest("a", 1, str(peft_adapter("llama")[0])))
    slots = engine.runner.lora
    assert slots is not None
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # held from intake, however the request ends: refused before it was added, aborted
    refused = engine.prepare(PromptRequest(PROMPTS[0], params, lora="a"))
    with pytest.raises(AdapterInUse, match="in use by 1 request"):
        engine.unregister_lora("a")
    engine.discard(refused)
    engine.add(engine.prepare(PromptRequest(PROMPTS[0], params, "gone", lora="a")))
    engine.abort("gone")
    engine.step()
    assert not slots.held

    adapted = engine.add(engine.prepare(PromptRequest(PROMPTS[0], params, lora="a")))
    base = engine.add(engine.prepare(PromptRequest(PROMPTS[1], params)))
    # What the reference forbids, done anyway (a bug elsewhere must not take the engine
    # down): the adapter goes while its request waits.
    del slots.registered["a"], slots._host["a"]
    while engine.has_unfinished():
        engine.step()
    assert adapted.choices[0].finish_reason == "error"
    assert "'a'" in (adapted.choices[0].error or "")
    assert base.choices[0].finish_reason == "length"
    assert not slots.held


def test_bench_serving_spreads_requests_over_adapters(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--lora-adapters 2`: each configuration without, then with 2 random adapters (every
    projection), requests round-robin over them; the ratio line and the slot bytes."""
    from benchmarks import bench_serving

    report = bench_serving.main(
        ["--model", str(tiny_llama_dir), "--backend", "paged", "--workload", "long_tail",
         "--num-requests", "3", "--out", str(tmp_path / "s.json"), "--plot", "none",
         "--max-seq-len", "64", "--block-size", "16", "--max-num-batched-tokens", "32",
         "--contiguous-batch-size", "2", "--paged-batch-sizes", "4", "--no-progress",
         "--lora-adapters", "2", "--lora-rank", "4"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    base, adapted = report["runs"]
    assert (base["label"], adapted["label"]) == ("paged b4", "paged b4 lora2xr4")
    assert "paged b4 lora2xr4 / paged b4: output tok/s x" in printed
    assert "MiB per resident adapter" in printed
    config = models.load(tiny_llama_dir, dtype="float32").config
    per_layer = sum(4 * (i + o) for i, o in lora.dims(config).values())
    assert adapted["lora_bytes_per_adapter"] == 4 * config.num_layers * per_layer
    for r in (base, adapted):
        assert r["completed"] == 3 and not r["errors"]
        assert r["compilations_after_warmup"] == 0
    with pytest.raises(SystemExit):  # adapters are served in process only
        bench_serving.main(["--model", str(tiny_llama_dir), "--through-server",
                            "--lora-adapters", "2"])  # fmt: skip


def test_several_decode_steps_a_call_mix_adapters_as_one_step_does(
    loaded: Callable[[str], Any], peft_adapter: Callable[..., tuple[Path, Any]]
) -> None:
    requests = [
        LoRARequest(f"ad{i}", i, str(peft_adapter("llama", seed=i, rank=r)[0]))
        for i, r in ((1, 4), (2, 8))
    ]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, calls = [], []
    for k in (1, 4):
        llm = LLM(loaded("llama"), **ENGINE, num_scheduler_steps=k)
        got = llm.generate(PROMPTS[:3], params, lora_request=[*requests, None])
        outs.append([o.token_ids for o in got])
        calls.append(llm.stats()["decode_calls"])
    assert outs[1] == outs[0] and calls[1] < calls[0]
