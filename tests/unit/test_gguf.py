"""GGUF loading: tokenizer, weights and forward parity with transformers' own GGUF path.

transformers (PyTorch) is the oracle here only; `models.gguf` never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.cache import kv_pool
from jpaged.dtypes import concrete_dtype
from jpaged.kernels import ragged_plan
from jpaged.models import demo, loader, qdot, quant
from jpaged.models import gguf as models_gguf
from jpaged.models.config import ModelConfig
from jpaged.models.gguf import _dequantize
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import load_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTION = "What is the capital of France?"
TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "Ünïcödé — naïve café, 日本語のテキスト, Ελληνικά",
    "emoji 🤗🚀👩‍👩‍👧 mixed",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "tabs\t\tand\r\nnewlines\n\n  runs     of      spaces",
    "numbers 1234567890 3.14159 -42",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


def _hf_to_params(sd: dict[str, Any], arch: str, num_layers: int, tied: bool) -> dict:
    """transformers state dict → the module's state (jpaged/models/config.py) as a pure dict of
    float32 NumPy."""
    mlp_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    names = {
        "input_layernorm.weight": "attn_norm.scale",
        "self_attn.q_proj.weight": "attn.q.kernel",
        "self_attn.k_proj.weight": "attn.k.kernel",
        "self_attn.v_proj.weight": "attn.v.kernel",
        "self_attn.o_proj.weight": "attn.o.kernel",
        "self_attn.q_norm.weight": "attn.q_norm.scale",
        "self_attn.k_norm.weight": "attn.k_norm.scale",
        f"{mlp_norm}.weight": "mlp_norm.scale",
        "mlp.gate_proj.weight": "mlp.gate.kernel",
        "mlp.up_proj.weight": "mlp.up.kernel",
        "mlp.down_proj.weight": "mlp.down.kernel",
    }
    if arch == "gemma3":
        names["post_attention_layernorm.weight"] = "post_attn_norm.scale"
        names["post_feedforward_layernorm.weight"] = "post_mlp_norm.scale"
    arrays = {k: v.detach().float().numpy() for k, v in sd.items()}
    flat = {
        "embed.embedding": arrays["model.embed_tokens.weight"],
        "final_norm.scale": arrays["model.norm.weight"],
    }
    if not tied:
        flat["lm_head.kernel"] = arrays["lm_head.weight"].T
    for suffix, path in names.items():
        if f"model.layers.0.{suffix}" in arrays:
            per_layer = [arrays[f"model.layers.{i}.{suffix}"] for i in range(num_layers)]
            linear = path.endswith("kernel")
            flat[f"layers.{path}"] = np.stack([w.T if linear else w for w in per_layer])
    params: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return params


def _params(m: LoadedModel) -> dict:
    """The loaded module's state as a pure dict (what `_hf_to_params` builds), quantized
    weights dequantized."""
    return quant.dequantized(m.model)


def _max_diffs(ours: dict, ref: dict) -> dict[str, float]:
    """Max abs diff per leaf; the two trees must have the same keys and shapes."""
    flat_ours = dict(jax.tree_util.tree_flatten_with_path(ours)[0])
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
    assert set(map(jax.tree_util.keystr, flat_ours)) == set(map(jax.tree_util.keystr, flat_ref))
    out = {}
    for path, ref_leaf in flat_ref.items():
        mine = np.asarray(flat_ours[path], np.float32)
        assert mine.shape == ref_leaf.shape, jax.tree_util.keystr(path)
        out[jax.tree_util.keystr(path)] = float(np.abs(mine - ref_leaf).max())
    return out


@functools.partial(jax.jit, donate_argnames=("kv",))
def _forward(model: Any, kv: kv_pool.KVPool, tokens: jax.Array, meta: Any, last: Any):
    return model(kv, tokens, meta, last)


def _step(
    m: LoadedModel,
    kv: kv_pool.KVPool,
    new: list[list[int]],
    tables: np.ndarray,
    lens: list[int],
    block_size: int,
) -> tuple[jax.Array, kv_pool.KVPool]:
    """One flat step: sequence i writes `new[i]` and then holds `lens[i]` tokens."""
    q = np.array([len(n) for n in new])
    meta = ragged_plan.plan(
        q,
        np.array(lens),
        tables,
        num_tokens=int(q.sum()),
        num_seqs=len(new),
        width=tables.shape[1],
        block_size=block_size,
        impl="xla",
    )
    tokens = jnp.asarray(np.concatenate(new), jnp.int32)
    return _forward(m.model, kv, tokens, meta, jnp.asarray(np.cumsum(q) - 1))


def _prefill(
    m: LoadedModel, prompts: list[list[int]], block_size: int, width: int
) -> tuple[np.ndarray, kv_pool.KVPool, np.ndarray]:
    """Prefill `prompts` in one step over shuffled (non-contiguous) blocks."""
    c = m.config
    b = len(prompts)
    kv = kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=block_size,
        num_blocks=b * width + 1,
        dtype=m.model.embed.embedding.dtype,
    )
    tables = np.random.default_rng(0).permutation(np.arange(1, b * width + 1)).reshape(b, width)
    logits, kv = _step(m, kv, prompts, tables, [len(p) for p in prompts], block_size)
    return np.asarray(logits), kv, tables


# ------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smol_path(demo_gguf: Callable[[str], Path]) -> Path:
    return demo_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def smol(demo_model: Callable[[str], LoadedModel]) -> LoadedModel:
    return demo_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_smol(smol_path: Path, hf_gguf: Callable[[Path], Any]) -> tuple[Any, Any]:
    return hf_gguf(smol_path)


def _chat_ids(tok: Any) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def test_demo_model_path(smol_path: Path) -> None:
    assert smol_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol_path.is_file()


def test_smollm2_config(smol: LoadedModel) -> None:
    c = smol.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.head_dim, c.vocab_size, c.intermediate_size) == (64, 49152, 1536)
    assert c.tie_word_embeddings and smol.model.lm_head is None
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (100000.0, 1e-5, None)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smol.generation_config["eos_token_id"] == 2


def test_tokenizer_matches_transformers(smol: LoadedModel, hf_smol: tuple[Any, Any]) -> None:
    ours, ref = smol.tokenizer, hf_smol[0]
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert sorted(ours.all_special_ids) == sorted(ref.all_special_ids)
    conv = [{"role": "user", "content": QUESTION}]
    text = ours.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _chat_ids(ours) == _chat_ids(ref)


def test_weights_match_transformers(smol: LoadedModel, hf_smol: tuple[Any, Any]) -> None:
    model = hf_smol[1]
    c = model.config
    ref = _hf_to_params(model.state_dict(), "llama", c.num_hidden_layers, c.tie_word_embeddings)
    diffs = _max_diffs(_params(smol), ref)
    print(f"SmolLM2 weights: max abs diff vs transformers {max(diffs.values()):.2e}")
    assert max(diffs.values()) <= 1e-6, {k: v for k, v in diffs.items() if v > 1e-6}


@pytest.fixture(scope="module")
def smol_run(smol: LoadedModel, hf_smol: tuple[Any, Any]) -> dict[str, Any]:
    """Prefill a chat prompt and a plain one together, then decode both greedily."""
    tok, _ = hf_smol
    prompts = [_chat_ids(tok), tok("The quick brown fox")["input_ids"]]
    block_size, width, steps = 16, 4, 12
    logits, kv, tables = _prefill(smol, prompts, block_size, width)
    lens = [len(p) for p in prompts]
    generated: list[list[int]] = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(steps - 1):
        lens = [n + 1 for n in lens]
        new = [[g[-1]] for g in generated]
        step_logits, kv = _step(smol, kv, new, tables, lens, block_size)
        for g, t in zip(generated, np.asarray(step_logits).argmax(-1), strict=True):
            g.append(int(t))
    return {"prompts": prompts, "prefill_logits": logits, "generated": generated}


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_prefill_logits_match_transformers(
    smol_run: dict[str, Any], hf_smol: tuple[Any, Any]
) -> None:
    model = hf_smol[1]
    for row, prompt in enumerate(smol_run["prompts"]):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1].numpy()
        diff = float(np.abs(smol_run["prefill_logits"][row] - ref).max())
        print(f"prefill row {row} ({len(prompt)} tokens): max abs logit diff {diff:.2e}")
        assert diff <= 1e-3


def test_greedy_chat_answer_matches_transformers(
    smol_run: dict[str, Any], hf_smol: tuple[Any, Any], smol: LoadedModel
) -> None:
    tok, model = hf_smol
    eos = smol.config.eos_token_ids[0]
    for prompt, ours in zip(smol_run["prompts"], smol_run["generated"], strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=len(ours),
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        ref = out[0, len(prompt) :].tolist()
        assert _until_eos(ours, eos) == _until_eos(ref, eos)
    answer = smol.tokenizer.decode(
        _until_eos(smol_run["generated"][0], eos), skip_special_tokens=True
    )
    print(f"greedy chat answer: {answer!r}")
    assert answer.strip() == "The capital of France is Paris."


# ------------------------------------------------- tiny GGUFs from transformers

BYTE_CHARS = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # only for the merges below
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_vocab() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = TINY_SPECIALS + alphabet + ["".join(m) for m in TINY_MERGES] + ["<think>"]
    types = [3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS) - 1) + [4]
    return tokens, types


TINY_VOCAB = len(_tiny_vocab()[0])


def _tiny_hf_config(arch: str) -> Any:
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":  # Llama 3.2-style: llama3 rope scaling, tied embeddings, GQA 2
        return transformers.LlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    if arch == "qwen3":  # head_dim != hidden / heads, untied, GQA 1
        return transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            max_position_embeddings=4096,
        )
    # Gemma 3 4B-style: 5 sliding layers + 1 global, linear scaling on the global one, GQA 4
    return transformers.Gemma3TextConfig(
        **common,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=4096,
        hidden_activation="gelu_pytorch_tanh",
    )


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (the forward direction)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors for rope_type llama3."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _write_tiny_gguf(
    path: Path,
    arch: str,
    hf_config: Any,
    sd: dict[str, np.ndarray],
    *,
    tokenizer_model: str = "gpt2",
    pre: str = "default",
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """Follow llama.cpp's convert_hf_to_gguf.py conventions for these three architectures;
    `extra` tensors (GGUF names, NumPy shapes) are written as they are."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)

    tokens, types = _tiny_vocab()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in TINY_MERGES])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    w.add_add_bos_token(arch == "llama")  # Llama 3 prepends BOS; exercise that path
    w.add_chat_template(CHATML)

    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c.num_hidden_layers
    )
    for hf_name, tensor in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        data = np.array(tensor, np.float32)
        if arch == "llama" and base.endswith("q_proj"):
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's (1 + w)
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            try:
                raw = gguf.quants.quantize(data, qtype)
            except NotImplementedError:  # no NumPy quantizer: zero blocks of the right size
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = np.zeros((*data.shape[:-1], data.shape[-1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(c.rope_parameters, head_dim))
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf_model(arch: str) -> Any:
    torch.manual_seed({"llama": 0, "qwen3": 1, "gemma3": 2}[arch])
    model = transformers.AutoModelForCausalLM.from_config(
        _tiny_hf_config(arch), attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") and arch != "gemma3" else 0.0
            # fp16-representable values, so an F16 GGUF stores them exactly
            p.copy_((centre + torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.08)).half().float())
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    arch = request.param
    model = _tiny_hf_model(arch)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp(f"tiny_{arch}")
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    # Qwen3 stores its matrices as F16 (exact: the weights are fp16-representable)
    qtypes = (
        {
            f"blk.{i}.{n}.weight": gguf.GGMLQuantizationType.F16
            for i in range(model.config.num_hidden_layers)
            for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        }
        if arch == "qwen3"
        else None
    )
    pre = {"llama": "llama-bpe", "qwen3": "qwen2", "gemma3": "default"}[arch]
    _write_tiny_gguf(gguf_dir / "tiny.gguf", arch, model.config, sd, pre=pre, qtypes=qtypes)
    loaded = load_gguf(gguf_dir, "float32")  # a directory holding one .gguf
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    loaded.tokenizer.save_pretrained(hf_dir)
    return {"arch": arch, "model": model, "loaded": loaded, "gguf_dir": gguf_dir, "hf_dir": hf_dir}


def test_tiny_gguf_weights_match_transformers(tiny: dict) -> None:
    model = tiny["model"]
    c = model.config
    ref = _hf_to_params(
        model.state_dict(), tiny["arch"], c.num_hidden_layers, c.tie_word_embeddings
    )
    diffs = _max_diffs(_params(tiny["loaded"]), ref)
    # Exact, except Gemma norms: the file holds float32(1 + w), so w comes back within an ulp of 1
    assert max(diffs.values()) <= 1.2e-7, diffs


def test_tiny_gguf_loads_in_the_dtype_asked(tiny: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the file's tensor types (F32, and F16 for Qwen3): the dtype asked, else auto.
    On a terminal the load shows its progress in the file's bytes."""
    file = tiny["gguf_dir"] / "tiny.gguf"
    terminal = io.StringIO()
    terminal.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", terminal)
    m = load_gguf(file, "bfloat16")
    assert "tiny.gguf: 100%" in terminal.getvalue()
    assert {x.dtype for x in jax.tree_util.tree_leaves(_params(m))} == {jnp.dtype(jnp.bfloat16)}
    ref = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), _params(tiny["loaded"]))
    assert jax.tree.all(
        jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), _params(m), ref)
    )
    auto = {x.dtype for x in jax.tree_util.tree_leaves(_params(load_gguf(file)))}
    assert auto == {jnp.dtype(concrete_dtype("auto"))}  # float32 on a CPU


def test_tiny_gguf_config(tiny: dict) -> None:
    c, hf = tiny["loaded"].config, tiny["model"].config
    assert c.architecture == tiny["arch"]
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.intermediate_size,
        hf.vocab_size,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    )
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.max_position_embeddings == hf.max_position_embeddings
    if tiny["arch"] == "llama":
        assert c.rope_theta == 500000.0
        assert c.rope_scaling == ("llama3", 32.0, 1.0, 4.0, 8192)
    elif tiny["arch"] == "qwen3":
        assert c.qk_norm and c.rope_scaling is None and c.rope_theta == 1e6
    else:
        assert c.qk_norm and c.norm_plus_one and c.embed_scale and c.sandwich_norm
        assert c.hidden_act == "gelu_pytorch_tanh"
        assert c.rope_scaling == ("linear", 8.0) and c.rope_theta == 1e6
        assert c.rope_local_base_freq == 10000.0
        assert c.sliding_window == 8 and c.query_pre_attn_scalar == 32
        assert c.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types)


def test_tiny_gguf_tokenizer_matches_transformers(tiny: dict) -> None:
    ours = tiny["loaded"].tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(tiny["gguf_dir"], gguf_file="tiny.gguf")
    for text in [*TEXTS, "<think>the thin ant</think>", "x  the   the\n\nthe"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert (ours("the")["input_ids"][0] == 1) == (tiny["arch"] == "llama")  # add_bos_token
    conv = [{"role": "user", "content": "the thin"}]
    assert ours.apply_chat_template(conv, add_generation_prompt=True) == ref.apply_chat_template(
        conv, add_generation_prompt=True
    )


def test_tiny_gguf_forward_matches_transformers(tiny: dict) -> None:
    """Config derived from GGUF metadata reproduces the HF model (window cuts for Gemma 3)."""
    loaded, model = tiny["loaded"], tiny["model"]
    prompt = list(np.random.default_rng(3).integers(3, TINY_VOCAB, size=13))
    logits, _, _ = _prefill(loaded, [prompt], block_size=4, width=4)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1].numpy()
    assert float(np.abs(logits[0] - ref).max()) <= 1e-4


def test_tiny_gguf_matches_hf_checkpoint_loader(tiny: dict) -> None:
    """The GGUF and the HF safetensors of one model load to the same config and params."""
    from_hf = loader.load(tiny["hf_dir"], "float32")
    ours = tiny["loaded"]
    diffs = _max_diffs(_params(ours), jax.tree.map(np.asarray, _params(from_hf)))
    assert max(diffs.values()) <= 1.2e-7, diffs
    fields = (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "qk_norm",
        "rope_theta",
        "rope_scaling",
        "sliding_window",
        "sliding_layers",
        "rope_local_base_freq",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
    )
    for f in fields:
        assert getattr(_normalized(ours.config), f) == getattr(_normalized(from_hf.config), f), f


def _normalized(c: ModelConfig) -> ModelConfig:
    """No sliding layers may be spelled `()` or all False."""
    return dataclasses.replace(c, sliding_layers=c.sliding_layers if any(c.sliding_layers) else ())


def test_loading_imports_no_torch(tiny: dict, tiny_gemma3_mm_dir: Path) -> None:
    """`models.load` never imports torch: on a safetensors checkpoint, on a GGUF directory
    (through `load_gguf`) and, where installed, on the real Gemma 3 file (its quantized
    tensors, its own tokenizer). One fresh process for all: each costs a JAX start-up."""
    if tiny["arch"] != "gemma3":
        pytest.skip("one architecture is enough for a subprocess check")
    paths = [tiny_gemma3_mm_dir, tiny["gguf_dir"]]
    with contextlib.suppress(FileNotFoundError):
        paths.append(demo.model_path("gemma-3-270m", download=None, log=lambda _: None))
    code = textwrap.dedent("""
        import sys
        from jpaged import models
        for path in sys.argv[1:]:
            m = models.load(path, "float32")
            assert "torch" not in sys.modules, f"torch imported loading {path}"
            print(m.config.architecture)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["gemma3"] * len(paths), out.stdout


# ------------------------------------------------------------------- errors


def _tiny_sd(arch: str = "qwen3") -> tuple[Any, dict[str, np.ndarray]]:
    model = _tiny_hf_model(arch)
    return model.config, {k: v.numpy() for k, v in model.state_dict().items()}


def test_unsupported_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    cfg, sd = _tiny_sd()
    path = tmp_path / "q81.gguf"
    q81 = gguf.GGMLQuantizationType.Q8_1  # `gguf` has no NumPy dequantizer for it
    _write_tiny_gguf(path, "qwen3", cfg, sd, qtypes={"blk.1.ffn_up.weight": q81})
    with pytest.raises(ValueError, match=r"q81\.gguf.*'blk\.1\.ffn_up\.weight'.*Q8_1"):
        load_gguf(path)


def test_projections_are_one_matrix_only_where_the_file_holds_them_alike(tmp_path: Path) -> None:
    """q/k/v become one matrix where the file stores them in one type, and stay apart where
    it does not (one form would widen the codes); either way the weights are the file's."""
    from flax import nnx

    cfg, sd = _tiny_sd("llama")
    t = gguf.GGMLQuantizationType

    def load(name: str, v_type: gguf.GGMLQuantizationType) -> tuple[LoadedModel, set[str]]:
        types = {
            f"blk.{i}.attn_{p}.weight": v_type if p == "v" else t.Q8_0
            for i in range(2)
            for p in "qkv"
        }
        _write_tiny_gguf(tmp_path / name, "llama", cfg, sd, qtypes=types)
        m = load_gguf(tmp_path / name, "float32")
        dense = _params(load_gguf(tmp_path / name, "float32", quantization="none"))
        assert max(_max_diffs(_params(m), dense).values()) <= 1e-6
        return m, {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m.model))}

    alike, alike_paths = load("alike.gguf", t.Q8_0)
    apart, apart_paths = load("apart.gguf", t.Q4_0)
    assert alike.config.fused_projections and "layers.attn.qkv.kernel.codes" in alike_paths
    assert not apart.config.fused_projections and "layers.attn.v.kernel.codes" in apart_paths


def test_a_weight_whose_layers_differ_in_type_holds_each_layer_in_its_own(
    tmp_path: Path,
) -> None:
    """FFN down in Q8_0 and Q4_0 layers (as a Q4_K_M file mixes Q6_K and Q4_K): a stack of
    each type's layers in its own form (int8 codes; 4-bit two a byte), the layers at their
    places, and the model the file's: weights and logits as the file dequantized."""
    cfg, sd = _tiny_sd("gemma3")
    t = gguf.GGMLQuantizationType
    order = [t.Q8_0, t.Q4_0, t.Q4_0, t.Q8_0, t.Q4_0, t.Q8_0]
    types = {f"blk.{i}.ffn_down.weight": q for i, q in enumerate(order)}
    _write_tiny_gguf(tmp_path / "mixed.gguf", "gemma3", cfg, sd, qtypes=types)
    m = load_gguf(tmp_path / "mixed.gguf", "float32")
    dense = load_gguf(tmp_path / "mixed.gguf", "float32", quantization="none")
    q8 = quant.Form(32, False, half=True)
    q4 = quant.Form(32, False, packed=True, half=True, tiled=qdot.int8_kernel())
    down = quant.layout_of(m.model)["layers.mlp.down.kernel"]
    assert down == quant.Mixed((q8, q4), (0, 1, 1, 0, 1, 0))
    assert down.slots() == (0, 0, 1, 1, 2, 2)
    assert max(_max_diffs(_params(m), _params(dense)).values()) <= 1e-6
    prompt = list(np.random.default_rng(5).integers(3, TINY_VOCAB, size=13))
    got, _, _ = _prefill(m, [prompt], block_size=4, width=4)
    want, _, _ = _prefill(dense, [prompt], block_size=4, width=4)
    assert float(np.abs(got - want).max()) <= 1e-4
    # on a GPU (a switch would be a conditional in the step) one form holds both
    f = models_gguf.read(tmp_path / "mixed.gguf", quantized=True)
    one = loader._layout(f.config, f.layouts, loader.GGUF_NAMING, mixed=False)
    assert one["layers.mlp.down.kernel"] == quant.Form(32, False, half=True)
    # tensor parallelism splits one form a weight: a mixed one is refused, by name
    module = loader.abstract(m.config, np.float32)
    with pytest.raises(ValueError, match=r"layers\.mlp\.down\.kernel: .* 2 forms"):
        quant.quantize(module, {"layers.mlp.down.kernel": down}, devices=2)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="exactly one .gguf"):
        load_gguf(tmp_path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all" * 8)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_gguf(path)


def test_unsupported_tokenizer(tmp_path: Path) -> None:
    cfg, sd = _tiny_sd()
    path = tmp_path / "wordpiece.gguf"
    _write_tiny_gguf(path, "qwen3", cfg, sd, tokenizer_model="bert")
    expected = r"wordpiece\.gguf.*GGUF tokenizer 'bert'.*'gpt2' \(byte-level BPE\), 'llama' \(Sent"
    with pytest.raises(ValueError, match=expected):
        load_gguf(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"phi\.gguf.*'phi3'.*llama, qwen3, gemma3"):
        load_gguf(path)


def test_missing_tensor(tmp_path: Path) -> None:
    cfg, sd = _tiny_sd()
    del sd["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "holes.gguf"
    _write_tiny_gguf(path, "qwen3", cfg, sd)
    with pytest.raises(
        ValueError, match=r"holes\.gguf: .*missing tensors: blk\.1\.ffn_up\.weight$"
    ):
        load_gguf(path)


@pytest.mark.parametrize(
    "drop, extra, error",
    [
        (
            None,
            {"blk.2.attn_norm.weight": np.ones(64, np.float32)},
            r"bad\.gguf: unexpected tensor 'blk\.2\.attn_norm\.weight': the model has 2 layers",
        ),
        (
            None,
            {"blk.0.attn_extra.weight": np.ones(3, np.float32)},
            r"bad\.gguf: unexpected tensor 'blk\.0\.attn_extra\.weight' for a qwen3 model",
        ),
        (
            None,
            {"output_bias": np.ones(3, np.float32)},
            r"bad\.gguf: unexpected tensor 'output_bias' for a qwen3 model",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            {"blk.0.attn_q.weight": np.ones((60, 64), np.float32)},
            r"bad\.gguf: tensor 'blk\.0\.attn_q\.weight' has shape \(60, 64\), expected \(96, 64\)",
        ),
    ],
    ids=["past-block-count", "extra", "extra-global", "mis-shaped"],
)
def test_bad_tensors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    drop: str | None,
    extra: dict[str, np.ndarray],
    error: str,
) -> None:
    """The checks of `models.loader.assemble`, named in the GGUF file's own terms,
    made before the offending tensor is dequantized."""
    cfg, sd = _tiny_sd()
    if drop:
        del sd[drop]
    path = tmp_path / "bad.gguf"
    _write_tiny_gguf(path, "qwen3", cfg, sd, extra=extra)
    dequantized: list[str] = []
    spy = lambda t: dequantized.append(t.name) or _dequantize(t)  # noqa: E731
    monkeypatch.setattr("jpaged.models.gguf._dequantize", spy)
    with pytest.raises(ValueError, match=error):
        load_gguf(path)
    assert not set(extra) & set(dequantized)


def test_llama3_rope_freqs_roundtrip() -> None:
    """Non-default Llama 3 parameters are recovered from llama.cpp's rope_freqs tensor."""
    from jpaged.models.gguf import _llama3_from_factors

    rope = {
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 8192,
    }
    factors = _llama_cpp_rope_freqs(rope, 128).astype(np.float64)
    kind, factor, low, high, ctx = _llama3_from_factors(factors, 128, 500000.0)
    assert (kind, factor, ctx) == ("llama3", 16.0, 8192)
    assert np.allclose((low, high), (2.0, 8.0), rtol=1e-3)


def test_metadata_reads_as_ggufs_own_reader(tmp_path: Path) -> None:
    """`models.gguf.Reader`'s one-pass arrays against gguf's element-by-element parse:
    every kind of value, empty and nested arrays, non-ASCII strings, a tensor after them."""
    from jpaged.models.gguf import Reader

    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "héllo wörld", "Ġthe", "<|eot_id|>"])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.string", "plain")
    w.add_uint32("t.scalar", 9)
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = Reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert ours.fields["t.strings"].contents()[2] == "héllo wörld"
    np.testing.assert_array_equal(ours.tensors[0].data, theirs.tensors[0].data)


def test_types_without_a_form_of_their_own_load_requantized(tmp_path: Path) -> None:
    """IQ4_NL (a non-linear 4-bit type no kernel here reads) loads as the file's values
    requantized to int8 a scale per 32 (`gguf_blocks.requantize`): each weight within half
    a step of its sub-block's largest."""
    cfg, sd = _tiny_sd("llama")
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    types = {f"blk.{i}.ffn_{p}.weight": iq4 for i in range(2) for p in ("up", "down")}
    path = tmp_path / "iq4_nl.gguf"
    _write_tiny_gguf(path, "llama", cfg, sd, qtypes=types)
    rng = np.random.default_rng(0)
    for tensor in gguf.GGUFReader(path, "r+").tensors:  # random codes, a trained layer's scale
        if tensor.name in types:
            blocks = tensor.data.reshape(-1, gguf.GGML_QUANT_SIZES[iq4][1])
            blocks[:] = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
            scales = rng.uniform(1e-4, 1e-3, len(blocks)).astype(np.float16)
            blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    m = load_gguf(path, "float32")
    assert quant.layout_of(m.model)["layers.mlp.down.kernel"] == quant.Form(32, False)
    ours = _params(m)["layers"]["mlp"]["down"]["kernel"]
    file = _params(load_gguf(path, "float32", quantization="none"))["layers"]["mlp"]["down"]
    want = np.asarray(file["kernel"]).reshape(2, -1, 32, cfg.hidden_size)  # [layer, sub-block]
    step = np.abs(want).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(np.asarray(ours).reshape(want.shape) - want) <= step / 2 + 1e-7)
    assert np.abs(want).max() > 0.05  # (the values are the random blocks', not zeros)
