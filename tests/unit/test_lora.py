"""LoRA adapters without an engine: what a bad adapter is told, the batched update's
exact zeros, slot management (LRU, never evicting one in use), the config and the prefix
cache's salt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import SaltedIds
from jpaged.config import EngineConfig
from jpaged.engine.lora import LoRARequest, LoRASlots, from_vllm
from jpaged.models import lora
from jpaged.models.config import ModelConfig

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16,
    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
)  # fmt: skip
PREFIX = "base_model.model.model.layers"


def write_adapter(
    path: Path, rank: int = 2, config: dict | None = None, **tensors: np.ndarray
) -> Path:
    """A PEFT-layout adapter: q_proj of layer 0 and down_proj of layer 1, random."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": ["q_proj", "down_proj"], **(config or {})}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    weights = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": rng.normal(size=(rank, 8)),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": rng.normal(size=(8, rank)),
        f"{PREFIX}.1.mlp.down_proj.lora_A.weight": rng.normal(size=(rank, 16)),
        f"{PREFIX}.1.mlp.down_proj.lora_B.weight": rng.normal(size=(8, rank)),
        **tensors,
    }
    save_file(
        {k: v.astype(np.float32) for k, v in weights.items()},
        str(path / "adapter_model.safetensors"),
    )
    return path


def test_an_adapter_is_scaled_kept_at_its_rank_and_padded_for_the_device(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", config={"use_rslora": True})
    adapter = lora.load_adapter(path, CONFIG, max_rank=4)
    # on the host: its own rank, only the projections it targets
    assert set(adapter.weights) == {"q", "down"}
    a, b = adapter.weights["q"]
    assert a.shape == (2, 8, 2) and b.shape == (2, 2, 8) and not a[1].any()
    padded = adapter.padded(4)
    assert set(padded) == set(lora.dims(CONFIG))
    pa, pb = padded["q"]
    assert pa.shape == (2, 8, 4) and pb.shape == (2, 4, 8)
    assert not pa[0, :, 2:].any() and not pa[1].any()  # padding, and the layer not adapted
    np.testing.assert_array_equal(pa[..., :2], a)
    assert not padded["k"][0].any()
    from safetensors.numpy import load_file

    raw = load_file(str(path / "adapter_model.safetensors"))
    want_b = raw[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].T * (4 / np.sqrt(2))
    np.testing.assert_allclose(b[0, :2], want_b, rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"config": {"r": 8}}, "adapter_config.json: r: 8 exceeds max_lora_rank 4"),
        (
            {"config": {"target_modules": ["q_proj", "lm_head"]}},
            "target_modules: unknown modules ['lm_head']",
        ),
        ({"config": {"use_dora": True}}, "adapter_config.json: use_dora"),
        ({"config": {"peft_type": "IA3"}}, "adapter_config.json: peft_type"),
        (
            {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 9))},
            "q_proj.lora_A.weight: shape [2, 9], expected [2, 8]",
        ),
        (
            {f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight": np.zeros((2, 8))},
            "unknown module 'qkv_proj'",
        ),
        ({f"{PREFIX}.5.mlp.up_proj.lora_A.weight": np.zeros((2, 8))}, "layer 5 of a 2-layer model"),
    ],
)
def test_a_bad_adapter_names_its_file_and_field(tmp_path: Path, change: dict, where: str) -> None:
    path = write_adapter(tmp_path / "bad", **change)
    with pytest.raises(ValueError, match="adapter_") as info:
        lora.load_adapter(path, CONFIG, max_rank=4)
    assert where in str(info.value) and str(path) in str(info.value)


def test_an_adapter_on_a_mixtures_experts_is_refused(tmp_path: Path) -> None:
    """Attention's projections take adapters, and a dense layer's MLP; a sparse layer's
    MLP is experts, which take none."""
    from jpaged.models.config import MoEConfig

    path = write_adapter(tmp_path / "a")  # q_proj of layer 0, down_proj of layer 1
    for sparse in ((True, False), (False, True)):
        moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=16, sparse_layers=sparse)
        config = dataclasses.replace(CONFIG, moe=moe)
        if sparse[1]:
            with pytest.raises(ValueError, match="layer 1's MLP is experts, which take no"):
                lora.load_adapter(path, config, max_rank=4)
        else:
            assert set(lora.load_adapter(path, config, max_rank=4).weights) == {"q", "down"}


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors: missing"):
        lora.load_adapter(path, CONFIG, max_rank=4)


def test_the_update_is_each_tokens_own_and_exactly_zero_without_an_adapter() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    a = rng.normal(size=(3, 8, 4)).astype(np.float32)
    b = rng.normal(size=(3, 4, 6)).astype(np.float32)
    slots = np.array([0, 1, 3, 2, 0])
    got = np.asarray(lora.delta(x, lora.onehot(jnp.asarray(slots), 3, jnp.float32), a, b))
    for t, s in enumerate(slots):
        want = np.zeros(6) if s == 0 else x[t] @ a[s - 1] @ b[s - 1]
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
    assert (got[slots == 0] == 0).all()


def test_slots_evict_the_least_recently_used_idle_adapter(tmp_path: Path) -> None:
    spec = {"max_loras": 2, "max_lora_rank": 4, "max_cpu_loras": 3}
    slots = LoRASlots(spec, CONFIG, jnp.float32)
    for i, name in enumerate("abc", 1):
        slots.register(LoRARequest(name, i, str(write_adapter(tmp_path / name))))
    sa, sb = slots.acquire("a"), slots.acquire("b")
    assert {sa, sb} == {1, 2}
    assert slots.acquire("c") is None  # both in use: c waits, nobody is evicted
    slots.release("a")
    assert slots.acquire("b") == sb  # resident already: no load
    assert slots.acquire("c") == sa and slots.evictions == 1 and slots.loads == 3
    np.testing.assert_array_equal(
        slots.weights["q"][0][:, sa - 1], slots._host["c"].padded(4)["q"][0]
    )
    with pytest.raises(ValueError, match="in use"):
        slots.unregister("c")
    slots.release("c")
    slots.unregister("c")
    assert slots.stats()["lora_resident"] == 1 and 'lora_running{adapter="b"}' in slots.stats()


def test_host_copies_are_capped_least_recently_used_first(tmp_path: Path) -> None:
    spec = {"max_loras": 1, "max_lora_rank": 4, "max_cpu_loras": 2}
    slots = LoRASlots(spec, CONFIG, jnp.float32)
    requests = {
        name: LoRARequest(name, i, str(write_adapter(tmp_path / name)))
        for i, name in enumerate("abc", 1)
    }
    for request in requests.values():
        slots.register(request)
    assert list(slots._host) == ["b", "c"]  # a, least recently used, dropped
    # (only a request's hold reads it again: unheld, it cannot take a slot)
    assert not slots.usable("a") and slots.usable("b")
    assert slots.hold(requests["a"]) and list(slots._host) == ["c", "a"]  # read again
    assert slots.acquire("a") == 1
    assert slots.hold(requests["b"]) and list(slots._host) == ["a", "b"]
    # every copy held: one more goes past the cap while they are, never dropping theirs
    assert slots.hold(requests["c"]) and list(slots._host) == ["a", "b", "c"]
    for name in "bc":
        slots.unhold(name)
    assert list(slots._host) == ["a", "c"]  # back under the cap once they are not
    slots.register(LoRARequest("d", 4, requests["c"].lora_path))
    assert list(slots._host) == ["a", "d"] and slots.stats()["lora_host_copies"] == 2


def test_an_adapter_name_cannot_forge_a_metric(tmp_path: Path) -> None:
    from server.app import prometheus

    slots = LoRASlots({"max_loras": 1, "max_lora_rank": 4}, CONFIG, jnp.float32)
    name = 'evil\\"\nfake_metric 1'
    slots.register(LoRARequest(name, 1, str(write_adapter(tmp_path / "a"))))
    slots.acquire(name)
    lines = prometheus(slots.stats()).splitlines()
    assert not any(line.startswith("fake_metric") for line in lines)
    assert 'jpaged_lora_running{adapter="evil\\\\\\"\\nfake_metric 1"} 1.0' in lines


def test_config() -> None:
    assert EngineConfig(lora={}).lora == {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": 1}
    # vLLM's keywords (LLM's)
    vllm = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}
    assert EngineConfig(**from_vllm({**vllm, "seed": 1})).lora == {
        "max_loras": 4,
        "max_lora_rank": 8,
        "max_cpu_loras": 4,
    }
    assert EngineConfig(**from_vllm({"enable_lora": True, "max_cpu_loras": 3})).lora == {
        "max_loras": 1,
        "max_lora_rank": 16,
        "max_cpu_loras": 3,
    }
    with pytest.raises(ValueError, match="max_cpu_loras .1. must be at least max_loras .2."):
        EngineConfig(lora={"max_loras": 2, "max_cpu_loras": 1})
    assert from_vllm({"enable_lora": False, "seed": 1}) == {"seed": 1}
    with pytest.raises(ValueError, match="max_loras: set only with enable_lora=True"):
        from_vllm({"max_loras": 4})
    with pytest.raises(ValueError, match="not both"):
        from_vllm({**vllm, "lora": {}})
    with pytest.raises(ValueError, match="EngineConfig.lora.max_loras"):
        EngineConfig(lora={"max_loras": 0})
    with pytest.raises(ValueError, match="EngineConfig.lora.rank: unknown key"):
        EngineConfig(lora={"rank": 8})


def test_the_prefix_cache_keeps_adapters_apart() -> None:
    cache = PagedKVCache(num_blocks=32, block_size=4)
    prompt = list(range(13))
    ids = SaltedIds(prompt, b"a")
    seq = cache.allocate_seq(len(ids), ids)
    cache.append(seq, len(ids))
    cache.cache_blocks(seq, ids, len(ids))
    assert cache.num_cached_tokens(SaltedIds(prompt, b"a")) == 12
    assert cache.num_cached_tokens(SaltedIds(prompt, b"b")) == 0
    assert cache.num_cached_tokens(prompt) == 0
