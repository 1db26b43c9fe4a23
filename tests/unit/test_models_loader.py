"""models.load: the module's state, config parsing (released and transformers-5 layouts,
full-size public configs), tokenizer and generation config, and the errors a user can hit."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jpaged import models
from jpaged.dtypes import concrete_dtype
from jpaged.models import loader
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel

FAMILIES = ["llama", "qwen3", "gemma3", "gemma3_mm"]


def parse(hf: dict) -> ModelConfig:
    return loader.family_for(hf, "config.json").model_config(hf)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_state_layout(family: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """The state the module documents (jpaged/models/config.py), filled in the asked dtype."""
    model = models.load(tiny_checkpoint(family), dtype="float32")
    c = model.config
    h, q, kv, mlp = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    )
    expected = {
        "embed.embedding": (c.vocab_size, h), "final_norm.scale": (h,),
        "layers.attn_norm.scale": (h,), "layers.mlp_norm.scale": (h,),
        "layers.attn.qkv.kernel": (h, q + 2 * kv), "layers.attn.o.kernel": (q, h),
        "layers.mlp.gate_up.kernel": (h, 2 * mlp), "layers.mlp.down.kernel": (mlp, h),
    }  # fmt: skip
    if not c.tie_word_embeddings:
        expected["lm_head.kernel"] = (h, c.vocab_size)
    if c.qk_norm:
        expected |= {
            "layers.attn.q_norm.scale": (c.head_dim,),
            "layers.attn.k_norm.scale": (c.head_dim,),
        }
    if c.sandwich_norm:
        expected |= {"layers.post_attn_norm.scale": (h,), "layers.post_mlp_norm.scale": (h,)}
    expected = {
        k: (c.num_layers, *s) if k.startswith("layers.") else s for k, s in expected.items()
    }
    state = nnx.state(model.model)
    assert {".".join(map(str, p)): w.shape for p, w in nnx.to_flat_state(state)} == expected
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers5_config_parses_the_same(
    family: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    """transformers 5 rewrites configs (rope_parameters, layer_types): same ModelConfig."""
    from transformers import AutoConfig

    path = tiny_checkpoint(family)
    released = json.loads((path / "config.json").read_text())
    saved = AutoConfig.from_pretrained(path).to_dict()
    assert "rope_parameters" in (saved.get("text_config") or saved)
    assert parse(saved) == parse(released)


def test_tokenizer_and_generation_config(tiny_llama_dir: Path) -> None:
    model = models.load(tiny_llama_dir, dtype="float32")
    assert isinstance(model, LoadedModel) and model.source == str(tiny_llama_dir)
    assert model.config.eos_token_ids == (257, 264, 265)  # generation_config's list
    assert model.config.bos_token_id == 256
    assert model.generation_config["top_p"] == 0.9
    tok = model.tokenizer
    ids = tok("Paris")["input_ids"]
    assert ids[0] == 256 and tok.decode(ids[1:]) == "Paris"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_released_full_size_configs() -> None:
    """The public config.json files at full size, incl. the sparse Gemma 3 4B text_config."""
    llama = parse(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 2048,
            "head_dim": 64,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 16,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
        }
    )
    assert llama.rope_scaling == ("llama3", 32.0, 1.0, 4.0, 8192)
    assert (llama.num_kv_heads, llama.head_dim, llama.tie_word_embeddings) == (8, 64, True)
    qwen = parse(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 1024,
            "head_dim": 128,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "num_hidden_layers": 28,
            "max_window_layers": 28,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        }
    )
    assert (qwen.head_dim, qwen.qk_norm, qwen.sliding_window) == (128, True, None)
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    gemma = parse(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 1152,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "vocab_size": 262144,
            "eos_token_id": [1, 106],
        }
    )
    assert gemma.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert (gemma.sliding_window, gemma.rope_local_base_freq, gemma.rope_theta) == (512, 1e4, 1e6)
    assert gemma.eos_token_ids == (1, 106) and gemma.attn_scale == 256**-0.5
    gemma4b = parse(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "eos_token_id": [1, 106],
            "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
        }
    )
    assert (gemma4b.num_heads, gemma4b.num_kv_heads, gemma4b.head_dim) == (8, 4, 256)
    assert (gemma4b.vocab_size, gemma4b.rope_scaling) == (262208, ("linear", 8.0))
    assert gemma4b.tie_word_embeddings and gemma4b.eos_token_ids == (1, 106)


def test_qwen3_sliding_window_layers() -> None:
    """Qwen3Config: with use_sliding_window, layers from max_window_layers on slide."""
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 4,
        "max_window_layers": 1,
        "use_sliding_window": True,
        "sliding_window": 4096,
    }
    config = parse(hf)
    assert config.sliding_layers == (False, True, True, True) and config.sliding_window == 4096
    assert parse({**hf, "use_sliding_window": False}).sliding_window is None


# --------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        models.load(tmp_path / "nowhere")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load(tmp_path)


def test_bad_dtype(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        models.load(tiny_llama_dir, dtype="int8")


def test_unsupported_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    hf = json.loads((path / "config.json").read_text())
    hf.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        models.load(path)


def test_unsupported_rope_type(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    hf = json.loads((path / "config.json").read_text())
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="yarn"):
        models.load(path)


def _edit_weights(path: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "edit, error",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "missing tensors: model.layers.1.mlp.up_proj.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}),
            "model.safetensors: unexpected tensor 'model.layers.0.self_attn.extra.weight'",
        ),
        (
            lambda t: t.update({"model.layers.7.input_layernorm.weight": np.zeros(64, np.float32)}),
            "unexpected tensor 'model.layers.7.input_layernorm.weight'",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 60))}),
            r"'model.layers.0.self_attn.q_proj.weight' has shape \(64, 60\), expected \(64, 64\)",
        ),
    ],
    ids=["missing", "extra", "layer-out-of-range", "mis-shaped"],
)
def test_bad_tensors(
    tiny_llama_dir: Path, tmp_path: Path, edit: Callable[[dict], None], error: str
) -> None:
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    _edit_weights(path, edit)
    with pytest.raises(ValueError, match=error):
        models.load(path)


def test_missing_shard(tiny_gemma3_mm_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_gemma3_mm_dir, tmp_path / "ckpt")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        models.load(path)


def test_no_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.load(path)


def test_gguf_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    fake = lambda path, dtype, mesh, quantization, int8, experts: (
        calls.append((path, dtype)) or "loaded"
    )  # noqa: E731
    monkeypatch.setattr(loader, "load_gguf", fake)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert models.load(gguf, dtype="float32") == "loaded"
    assert models.load(tmp_path) == "loaded"  # a directory holding one, no config.json
    # "auto" is resolved before the dispatch: float32 on a CPU
    assert calls == [(str(gguf), "float32"), (str(tmp_path), concrete_dtype("auto"))]
    with pytest.raises(ValueError, match="quantization must be one of"):
        models.load(gguf, quantization="int4")
    with pytest.raises(ValueError, match="activations must be one of"):
        models.load(gguf, activations="int4")
    with pytest.raises(ValueError, match="activations='int8' is for the CPU kernels"):
        models.load(gguf, tensor_parallel=2, activations="int8")  # refused before any load
    assert len(calls) == 2
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        models.load(hf, quantization="gguf")


def test_a_fused_matrix_holds_each_devices_share_of_every_part() -> None:
    from jpaged.models import fused

    q, k = np.arange(8).reshape(1, 8), 100 + np.arange(4).reshape(1, 4)
    whole = fused.fuse([q, k], 2)
    assert whole.tolist() == [[0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 102, 103]]
    assert [a.tolist() for a in fused.split(whole, (8, 4), 2)] == [q.tolist(), k.tolist()]
    box = np.zeros((1, 6), int)  # the second device's columns: what its process keeps
    for i, part in enumerate((q, k)):
        fused.write(box, part, (8, 4), i, 2, first=1)
    assert box.tolist() == whole[:, 6:].tolist()


@pytest.mark.parametrize("native", [True, False])
def test_host_copy_writes_every_transposed_element(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loaders' copy (`hostcopy.cc` 8 x 8 byte blocks and its edges, or NumPy's) against
    NumPy's assignment: codes transposed at awkward shapes, a fused matrix's part, a stack of
    experts, a cast."""
    from jpaged.models import hostcopy

    if not native:
        monkeypatch.setattr(hostcopy.cpu, "library", lambda source: None)
    elif hostcopy.cpu.library(hostcopy.SOURCE) is None:
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(0)
    for shape, dtype in [((300, 77), np.uint8), ((9, 70), np.int8), ((40, 24), np.float16)]:
        src = rng.integers(0, 100, shape).astype(dtype)
        dest = np.zeros(shape[::-1], dtype)
        hostcopy.assign(dest, src.T)
        np.testing.assert_array_equal(dest, src.T)
    fused = np.zeros((70, 2, 50), np.uint8)  # [in, devices' shares, columns]
    part = rng.integers(0, 255, (2 * 30, 70)).astype(np.uint8)  # [out, in]
    hostcopy.assign(fused[..., 10:40], part.T.reshape(70, 2, 30))
    np.testing.assert_array_equal(fused[..., 10:40], part.T.reshape(70, 2, 30))
    assert not fused[..., :10].any() and not fused[..., 40:].any()
    experts = np.zeros((5, 70, 30), np.uint8)  # [E, in, out]
    hostcopy.assign(experts, stack := rng.integers(0, 255, (5, 30, 70)).astype(np.uint8).mT)
    np.testing.assert_array_equal(experts, stack)
    cast = np.zeros((77, 300), np.float32)
    hostcopy.assign(cast, src := rng.integers(0, 100, (300, 77)).astype(np.float16).T)
    np.testing.assert_array_equal(cast, src)
    # codes put in the int8 kernels' order in place: `qdot.tile`'s permutation (3 layers, 3
    # runs of 32 inputs, 5 tiles of columns; packed codes, then int8 ones)
    from jpaged.models import qdot

    for rows, dtype in ((48, np.uint8), (96, np.int8)):
        stack = rng.integers(-128 * (dtype == np.int8), 128, (3, rows, 40)).astype(dtype)
        tiled = stack.copy()
        hostcopy.tile(tiled)
        np.testing.assert_array_equal(tiled, np.asarray(qdot.tile(stack)))
        np.testing.assert_array_equal(np.asarray(qdot.untile(tiled)), stack)


def test_host_arrays_become_cpu_device_buffers_without_a_copy() -> None:
    """The loaders' arrays start where XLA:CPU adopts them as they are (a copy of the
    largest weight doubled it at the load's peak); an array off that boundary is copied."""
    from jpaged.models import hostcopy

    for dtype in (np.uint8, np.float32, jnp.bfloat16):
        values = np.arange(2 * 100).reshape(2, 100)  # exact in every dtype
        host = hostcopy.aligned(values, dtype)
        assert host.ctypes.data % hostcopy.ALIGN == 0
        device = jax.device_put(host)
        assert device.unsafe_buffer_pointer() == host.ctypes.data
        np.testing.assert_array_equal(np.asarray(device, np.float32), values)
    # NumPy's own arrays fall on a 64-byte boundary by chance (CI's did): step one byte off it.
    raw = np.empty((1 << 20) + hostcopy.ALIGN, np.uint8)
    plain = raw[-raw.ctypes.data % hostcopy.ALIGN + 1 :]
    assert jax.device_put(plain).unsafe_buffer_pointer() != plain.ctypes.data


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's smaps")
def test_host_arrays_lie_in_small_pages() -> None:
    """The loaders' arrays are mapped with huge pages refused ("nh"): NumPy's own large
    arrays ask for them, and an 8B file's load then took twice as long (`hostcopy.empty`)."""
    from jpaged.models import hostcopy

    host = hostcopy.empty((16 << 20,), np.uint8)
    host[...] = 1
    start, inside = host.ctypes.data, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            inside = lo <= start < hi
        elif inside and line.startswith("VmFlags:"):
            assert " nh" in line and " hg" not in line, line
            return
    raise AssertionError("the array's mapping is not in /proc/self/smaps")
