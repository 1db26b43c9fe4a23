"""Hugging Face checkpoint directory (or GGUF file) -> LoadedModel.

Weights go from safetensors straight to NumPy in the requested dtype (bfloat16
through ml_dtypes, no PyTorch), are transposed to `[in, out]` and stacked per
layer into preallocated arrays, then moved to the device one param at a time
so peak host memory stays near one copy of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from jpaged.dtypes import concrete_dtype, resolve_dtype
from models import demo, gemma3, llama, qwen3
from models.config import LoadedModel, ModelConfig

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, gemma3)
SUPPORTED = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)
# Params stored transposed from PyTorch's [out, in].
LINEAR = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
           "lm_head.weight": "lm_head"}  # fmt: skip


def family_for(hf: dict, source: str) -> ModuleType:
    archs = hf.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.ARCHITECTURES for a in archs):
            return family
    for family in FAMILIES:
        if not archs and hf.get("model_type") in family.MODEL_TYPES:
            return family
    raise ValueError(
        f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED)}"
    )


def param_shapes(c: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(global, per-layer) param shapes of the pytree documented in models/config.py;
    per-layer shapes exclude the stacked leading [num_layers] axis."""
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    top = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        top["lm_head"] = (c.hidden_size, c.vocab_size)
    layer = {
        "attn_norm": (c.hidden_size,),
        "q": (c.hidden_size, q_out), "k": (c.hidden_size, kv_out),
        "v": (c.hidden_size, kv_out), "o": (q_out, c.hidden_size),
        "mlp_norm": (c.hidden_size,),
        "gate": (c.hidden_size, c.intermediate_size), "up": (c.hidden_size, c.intermediate_size),
        "down": (c.intermediate_size, c.hidden_size),
    }  # fmt: skip
    if c.attention_bias:
        layer |= {"q_bias": (q_out,), "k_bias": (kv_out,), "v_bias": (kv_out,),
                  "o_bias": (c.hidden_size,)}  # fmt: skip
    if c.mlp_bias:
        layer |= {"gate_bias": (c.intermediate_size,), "up_bias": (c.intermediate_size,),
                  "down_bias": (c.hidden_size,)}  # fmt: skip
    if c.qk_norm:
        layer |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    if c.sandwich_norm:
        layer |= {"post_attn_norm": (c.hidden_size,), "post_mlp_norm": (c.hidden_size,)}
    return top, layer


def _target(name: str, family: ModuleType, c: ModelConfig) -> tuple[str, int | None] | None:
    """(param key, layer or None) for an HF tensor name; None when the tensor is ignored."""
    for alias, canonical in getattr(family, "TENSOR_ALIASES", {}).items():
        if name.startswith(alias):
            name = canonical + name[len(alias) :]
            break
    ignored = getattr(family, "IGNORED_PREFIXES", ())
    if name.startswith(ignored) or name.endswith("rotary_emb.inv_freq"):  # old rope buffers
        return None
    if name == "lm_head.weight" and c.tie_word_embeddings:
        return None  # some tied checkpoints store the copy anyway
    if name in _GLOBAL:
        return _GLOBAL[name], None
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in family.LAYER_TENSORS:
        return family.LAYER_TENSORS[m.group(2)], int(m.group(1))
    return name, None  # no such param: reported as unexpected


def assemble_params(
    c: ModelConfig,
    tensors: Iterable[tuple[str, str, tuple[int, ...], Any]],
    family: ModuleType,
    dtype: Any,
) -> dict:
    """Build the params pytree from `(hf_name, file, shape, read)` where `read()` returns the
    NumPy tensor. Shapes are checked before any read; errors name the tensor and its file."""
    np_dtype = resolve_dtype(dtype)
    top_shapes, layer_shapes = param_shapes(c)
    top: dict[str, np.ndarray] = {}
    layers = {k: np.empty((c.num_layers, *s), np_dtype) for k, s in layer_shapes.items()}
    seen: set[tuple[str, int | None]] = set()
    for name, file, shape, read in tensors:
        target = _target(name, family, c)
        if target is None:
            continue
        key, layer = target
        expected = layer_shapes.get(key) if layer is not None else top_shapes.get(key)
        if expected is None or (layer is not None and layer >= c.num_layers):
            raise ValueError(f"{file}: unexpected tensor {name!r} for a {c.architecture} model")
        hf_shape = expected[::-1] if key in LINEAR else expected
        if tuple(shape) != hf_shape:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {tuple(shape)}, expected {hf_shape}"
            )
        value = read()
        value = value.T if key in LINEAR else value
        if layer is None:
            top[key] = value.astype(np_dtype)
        else:
            layers[key][layer] = value  # casts on assignment, no temporary
        seen.add((key, layer))
    hf_top = {v: k for k, v in _GLOBAL.items()}
    hf_layer = {v: k for k, v in family.LAYER_TENSORS.items()}
    missing = [hf_top[k] for k in top_shapes if (k, None) not in seen] + [
        f"model.layers.{i}.{hf_layer[k]}"
        for i in range(c.num_layers) for k in layer_shapes if (k, i) not in seen
    ]  # fmt: skip
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:10])}{more}")
    params: dict[str, Any] = {k: jax.device_put(top.pop(k)) for k in list(top)}
    params["layers"] = {k: jax.device_put(layers.pop(k)) for k in list(layers)}
    return params


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    files = [os.path.join(path, n) for n in names]
    for file in files:
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}: listed in model.safetensors.index.json but missing")
    return files


def _read_safetensors(files: list[str]) -> Iterable[tuple[str, str, tuple[int, ...], Any]]:
    for file in tqdm(files, desc="loading shards", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shape = tuple(f.get_slice(name).get_shape())
                yield name, file, shape, lambda f=f, name=name: f.get_tensor(name)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _is_gguf(path: str) -> bool:
    """A .gguf file, or a directory holding one and no config.json."""
    if path.endswith(".gguf"):
        return True
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "config.json"))
        and any(n.endswith(".gguf") for n in os.listdir(path))
    )


def load_tokenizer(path: str) -> Any:
    # PreTrainedTokenizerFast reads tokenizer.json as is; AutoTokenizer would import torch.
    from transformers import PreTrainedTokenizerFast

    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(path)


def load(path: str | os.PathLike, dtype: str = "auto") -> LoadedModel:
    """Load a Hugging Face checkpoint directory, a `.gguf` file / a directory holding one, or a
    demo model by name (`models.demo.MODELS`, fetched once).

    Weights come out in `dtype` ("auto": bfloat16 on a GPU, float32 elsewhere) whatever the
    checkpoint stores or declares (`torch_dtype`, GGUF tensor types): it is the user's call.
    """
    path = os.fspath(demo.resolve(path)[0])
    dtype = concrete_dtype(dtype)
    resolve_dtype(dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if _is_gguf(path):
        from models.gguf import load_gguf  # the gguf package is only needed here

        return load_gguf(path, dtype)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path}: no config.json (and no .gguf file)")
    hf = _read_json(config_file)
    generation = _read_json(os.path.join(path, "generation_config.json"))
    family = family_for(hf, config_file)
    config: ModelConfig = family.model_config(hf)
    # generate() stops on generation_config's EOS ids, which may be a list.
    eos = llama.token_ids(generation.get("eos_token_id")) or config.eos_token_ids
    bos = generation.get("bos_token_id", config.bos_token_id)
    config = dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)
    params = assemble_params(config, _read_safetensors(_safetensors_files(path)), family, dtype)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=load_tokenizer(path),
        generation_config=generation,
        source=path,
    )
