"""Tiny random Hugging Face checkpoints, built with transformers itself, for every test suite.

Each config dict is the model's public `config.json` copied field for field, with
only the shapes (and token ids, to fit the tiny vocabulary) shrunk, so the loader
is tested against the layout a real download has. Weights are random with O(1)
activations (transformers' 0.02-std init would make every logit ~0 and parity
trivial); norm weights are perturbed too, so a misapplied norm shows.

Fixtures: `tiny_checkpoint(family, **config_overrides) -> Path` (session-cached),
`tiny_llama_dir`, `tiny_qwen3_dir`, `tiny_gemma3_dir`, `tiny_gemma3_mm_dir`, and
`hf_reference(path)` -> the float32 transformers model (eager attention) of a checkpoint;
`randomize_weights` and `write_tokenizer` for a test's own tiny checkpoint;
for the demo models, `demo_gguf(name)` (the file), `demo_model(name)` (loaded) and
`hf_gguf(path)` (transformers' tokenizer and model).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jpaged.engine.compile import use_compilation_cache

# Many tests compile the same small programs: persist them, as the server does (an engine
# leaves JAX's cache settings alone unless its config names a directory).
use_compilation_cache(os.environ.get("JPAGED_TEST_XLA_CACHE", "~/.cache/jpaged/xla"))
# Compiling is most of the suite's time, and its programs run a few steps each: without
# LLVM's optimizations a tiny model's test took 32% less time, a demo model's 12% more
# (2026-12-07). Read when JAX starts its backend, after this; inherited by the servers
# and scripts the tests start, and added again by a pytest run the suite starts.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"

# Llama-3.2-1B-Instruct; ids 128000+k -> 256+k.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": [257, 264, 265],
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 320,
}
LLAMA_GENERATION = {
    "bos_token_id": 256,
    "do_sample": True,
    "eos_token_id": [257, 264, 265],
    "temperature": 0.6,
    "top_p": 0.9,
    "transformers_version": "4.45.0.dev0",
}

# Qwen3-0.6B; ids 151643+k -> 256+k. head_dim 32 != hidden 64 / 4 heads.
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 40960,
    "max_window_layers": 3,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 320,
}
QWEN3_GENERATION = {
    "bos_token_id": 256,
    "do_sample": True,
    "eos_token_id": [258, 256],
    "pad_token_id": 256,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

# Qwen3-30B-A3B; ids 151643+k -> 256+k. 8 experts (128), 2 a token (8), unnormalised (the
# 30B's `true`: tests/unit/test_moe.py), and one dense layer (`mlp_only_layers`; the 30B's []).
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "decoder_sparse_step": 1,
    "eos_token_id": 258,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 40960,
    "max_window_layers": 3,
    "mlp_only_layers": [1],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 320,
}

# gemma-3-1b-it. 7 layers with the real pattern 6 give sliding, global, then sliding again;
# a 6-token window is shorter than the test prompts.
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 7,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 6,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 320,
}
GEMMA3_GENERATION = {
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "do_sample": True,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "top_k": 64,
    "top_p": 0.95,
    "transformers_version": "4.50.0.dev0",
}

# gemma-3-4b-it (Gemma3ForConditionalGeneration): a sparse text_config relying on
# Gemma3TextConfig defaults (8 heads / 4 KV heads, query_pre_attn_scalar 256, both RoPE
# bases, pattern 6) and linear RoPE scaling on global layers. vocab_size and head_dim are
# added to shrink it; final_logit_softcapping (Gemma 2 style, absent from the real file)
# exercises that path.
GEMMA3_MM_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 4,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "model_type": "gemma3_text",
        "num_hidden_layers": 7,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 5,
        "vocab_size": 320,
        "head_dim": 32,
        "final_logit_softcapping": 30.0,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 32,
        "image_size": 32,
        "intermediate_size": 64,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "patch_size": 8,
        "vision_use_head": False,
    },
}

_LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
_GEMMA_SPECIALS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    105: "<start_of_turn>",
    106: "<end_of_turn>",
}

# family -> (config, generation config, tokenizer spec)
TOKENIZERS: dict[str, dict[str, Any]] = {
    "llama": {
        "specials": {256 + i: t for i, t in enumerate(_LLAMA_SPECIALS)},
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "add_bos": True,
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}"
        ),
    },
    "qwen3": {
        "specials": {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos": False,
        "chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
    "gemma3": {
        "specials": _GEMMA_SPECIALS,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos": True,
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}<start_of_turn>"
            "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}"
        ),
    },
}

FAMILIES: dict[str, tuple[dict, dict, str]] = {
    "llama": (LLAMA_CONFIG, LLAMA_GENERATION, "llama"),
    "qwen3": (QWEN3_CONFIG, QWEN3_GENERATION, "qwen3"),
    "qwen3moe": (QWEN3_MOE_CONFIG, QWEN3_GENERATION, "qwen3"),
    "gemma3": (GEMMA3_CONFIG, GEMMA3_GENERATION, "gemma3"),
    "gemma3_mm": (GEMMA3_MM_CONFIG, GEMMA3_GENERATION, "gemma3"),
}


def build_tokenizer(path: Path, spec: dict[str, Any]) -> None:
    """A byte-level BPE (any text encodes) with the family's special tokens at their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials: dict[int, str] = spec["specials"]
    byte_chars = iter(sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab = {}
    for i in range(256 + len(specials)):
        vocab[specials[i] if i in specials else next(byte_chars)] = i
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials.values()]
    )
    if spec["add_bos"]:
        bos = spec["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    kwargs = {k: spec[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in spec}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=spec["chat_template"], **kwargs
    )
    fast.save_pretrained(path)


def _randomize(model: Any, seed: int, plus_one_norms: bool) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                base = 0.0 if ("norm" not in name or plus_one_norms) else 1.0
                p.copy_(base + 0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def build_tiny_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random `family` checkpoint (float32 safetensors, public-layout config.json,
    generation_config.json, tokenizer) into `path`; `overrides` patch the config dict
    (`text_config` keys for gemma3_mm)."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    hf_config, generation, tokenizer = copy.deepcopy(FAMILIES[family])
    multimodal = "text_config" in hf_config
    (hf_config["text_config"] if multimodal else hf_config).update(overrides)
    text = hf_config["text_config"] if multimodal else hf_config
    config = AutoConfig.for_model(**{k: v for k, v in text.items() if k != "torch_dtype"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, plus_one_norms=family.startswith("gemma"))
    path.mkdir(parents=True, exist_ok=True)
    if multimodal:
        # The released layout: text weights under `language_model.`, the SigLIP tower's
        # under `vision_tower.vision_model.`, sharded.
        tensors = {
            f"language_model.{k}": v.contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"
        }
        vc = {k: v for k, v in hf_config["vision_config"].items() if k != "model_type"}
        vision = SiglipVisionModel(SiglipVisionConfig(**vc))
        _randomize(vision, seed, plus_one_norms=False)
        # (transformers 5 names SiglipVisionModel's weights without `vision_model.`)
        tensors |= {
            f"vision_tower.vision_model.{k.removeprefix('vision_model.')}": v
            for k, v in vision.state_dict().items()
        }
        vh, th = vc["hidden_size"], text["hidden_size"]
        gen = torch.Generator().manual_seed(seed)
        tensors["multi_modal_projector.mm_input_projection_weight"] = (
            torch.randn(vh, th, generator=gen) / vh**0.5
        )
        tensors["multi_modal_projector.mm_soft_emb_norm.weight"] = 0.1 * torch.randn(
            vh, generator=gen
        )
        names = sorted(tensors)
        shards = {
            "model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2 :],
        }
        for file, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, path / file, metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    build_tokenizer(path, TOKENIZERS[tokenizer])
    return path


def load_hf_reference(path: Path) -> Any:
    """transformers' float32 model of a tiny checkpoint, eager attention (softcapping)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = json.loads((path / "config.json").read_text())
    if "text_config" not in hf_config:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    text = {k: v for k, v in hf_config["text_config"].items() if k != "model_type"}
    config = AutoConfig.for_model("gemma3_text", **text)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state |= {
            k.removeprefix("language_model."): v
            for k, v in load_file(file).items()
            if k.startswith("language_model.")
        }
    model.load_state_dict(state, strict=False)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(family: str, **overrides: Any) -> Path:
        key = json.dumps([family, overrides], sort_keys=True)
        if key not in cache:
            cache[key] = build_tiny_checkpoint(
                family, tmp_path_factory.mktemp(f"tiny-{family}"), **overrides
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def randomize_weights() -> Callable[[Any, int, bool], None]:
    """`randomize_weights(torch_model, seed, plus_one_norms)`: the tiny checkpoints' O(1)
    random weights, for a test that builds its own model."""
    return _randomize


@pytest.fixture(scope="session")
def write_tokenizer() -> Callable[[Path, str], None]:
    """`write_tokenizer(path, family)`: the tiny checkpoints' tokenizer of `family`."""
    return lambda path, family: build_tokenizer(path, TOKENIZERS[family])


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path], Any]:
    cache: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in cache:
            cache[path] = load_hf_reference(path)
        return cache[path]

    return get


@pytest.fixture(scope="session")
def demo_gguf() -> Callable[[str], Path]:
    """`demo_gguf(name)`: a demo model's installed GGUF, or a skip that says how to install it."""
    from jpaged.models import demo

    def get(name: str) -> Path:
        try:
            return demo.model_path(name, download=None, log=lambda _: None)
        except FileNotFoundError as e:
            pytest.skip(str(e))

    return get


@pytest.fixture(scope="session")
def demo_model(demo_gguf: Callable[[str], Path]) -> Callable[[str], Any]:
    """`demo_model(name)`: a demo model loaded in float32, once a session (its params are
    never mutated), or a skip that says how to install it."""
    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            from jpaged import models

            cache[name] = models.load(str(demo_gguf(name)), "float32")
        return cache[name]

    return get


@contextlib.contextmanager
def _one_gguf_reader_a_file() -> Iterator[None]:
    """transformers parses a GGUF's metadata for the tokenizer, the config and the weights
    alike: three `gguf.GGUFReader`s, ~17 s each for Gemma 3's 262k-token vocabulary here.
    Inside, one reader a file serves all three (they only read it), gguf's own parser over
    a plain view of the file's map (`models.gguf.Reader`: 3.4x faster)."""
    import gguf

    from jpaged.models.gguf import Reader

    real, readers = gguf.GGUFReader, {}

    def shared(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = Reader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


@pytest.fixture(scope="session")
def hf_gguf() -> Callable[[Path], tuple[Any, Any]]:
    """`hf_gguf(path)`: transformers' own float32 tokenizer and model of a GGUF file (loaded
    once a session: dequantizing takes seconds)."""
    cache: dict[Path, tuple[Any, Any]] = {}

    def get(path: Path) -> tuple[Any, Any]:
        import torch
        import transformers

        if path not in cache:
            kw = {"gguf_file": path.name}
            with _one_gguf_reader_a_file():
                tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path.parent, dtype=torch.float32, **kw
                )
            cache[path] = tok, model.eval()
        return cache[path]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("gemma3")


@pytest.fixture(scope="session")
def tiny_gemma3_mm_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("gemma3_mm")


# An XLA:CPU program holds ~140 memory mappings and a process only vm.max_map_count
# (65530) in all: one pytest process compiling every test's programs ran past it and
# segfaulted inside XLA's compiler. Past this many mappings, the jit caches are dropped
# between modules (their programs reload from the persistent cache when needed again).
MAX_MAPPINGS = 40_000


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_mappings() -> Any:
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and len(maps.read_text().splitlines()) > MAX_MAPPINGS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


# --------------------------------------------------------------------------- Gemma 3 vision

# the tiny vision-language model's image tokens (within its 320-token vocabulary)
BOI, EOI, IMAGE = 297, 298, 299
MM_TOKENS = 4


@dataclasses.dataclass
class Tiny:
    path: Path
    hf: Any  # transformers' Gemma3ForConditionalGeneration, float32, eager attention
    loaded: Any  # models.LoadedModel


@pytest.fixture(scope="session")
def tiny_gemma3_vision(
    tmp_path_factory: pytest.TempPathFactory,
    randomize_weights: Callable[[Any, int, bool], None],
) -> Tiny:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from jpaged import models

    config = Gemma3Config(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 320,
            "sliding_window": 5,  # shorter than the prompts: the window cuts into images
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
            "vision_use_head": False,
        },
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    randomize_weights(hf, 0, True)
    path = tmp_path_factory.mktemp("tiny-gemma3-vision")
    hf.save_pretrained(path)
    build_tokenizer(path, TOKENIZERS["gemma3"])
    # its image tokens at the config's ids (262 ... 296 unused, as the real vocabulary has)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    unused = [f"<unused{i}>" for i in range(BOI - len(tok))]
    images = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok.add_special_tokens({"additional_special_tokens": unused + images})
    assert tok.convert_tokens_to_ids(images) == [BOI, EOI, IMAGE]
    tok.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    hf.set_attn_implementation("eager")
    return Tiny(path, hf, models.load(path, dtype="float32"))
