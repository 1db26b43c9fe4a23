"""Hugging Face checkpoint directory (or GGUF file) -> LoadedModel.

Weights go from safetensors straight to NumPy in the requested dtype (bfloat16
through ml_dtypes, no PyTorch), are transposed to `[in, out]` and stacked per
layer into preallocated arrays, then moved to the device one param at a time
so peak host memory stays near one copy of the model. `assemble_params` does
that for GGUF files too (`models.gguf` feeds it dequantized tensors): one shape
table (`param_shapes`), one set of checks, one place that puts weights on the devices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm import tqdm

from jpaged.dtypes import concrete_dtype, resolve_dtype
from models import demo, gemma3, llama, qwen3, sharding
from models.config import LoadedModel, ModelConfig

# (tensor name, file, shape, read): a checkpoint tensor, read on demand (PyTorch's orientation)
TensorEntry = tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]
FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, gemma3)
SUPPORTED = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)
# Params stored transposed from PyTorch's [out, in].
LINEAR = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


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
        layer |= {
            "q_bias": (q_out,),
            "k_bias": (kv_out,),
            "v_bias": (kv_out,),
            "o_bias": (c.hidden_size,),
        }
    if c.mlp_bias:
        layer |= {
            "gate_bias": (c.intermediate_size,),
            "up_bias": (c.intermediate_size,),
            "down_bias": (c.hidden_size,),
        }
    if c.qk_norm:
        layer |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    if c.sandwich_norm:
        layer |= {"post_attn_norm": (c.hidden_size,), "post_mlp_norm": (c.hidden_size,)}
    return top, layer


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a checkpoint format names the params' tensors.

    `top` maps a global tensor name to its params key, `layer` the rest of a per-layer name
    (after `{layer_prefix}{i}.`) to its key. `aliases` rewrite name prefixes first;
    tensors under an `ignored` prefix are not params.
    """

    top: Mapping[str, str]
    layer: Mapping[str, str]
    layer_prefix: str
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    def target(self, name: str, c: ModelConfig) -> tuple[str, int | None] | None:
        """(params key, layer or None) for a tensor name; None when the tensor is ignored,
        the name itself (and no layer) when no param has that name."""
        for alias, canonical in self.aliases.items():
            if name.startswith(alias):
                name = canonical + name[len(alias) :]
                break
        if name.startswith(self.ignored) or name.endswith("rotary_emb.inv_freq"):  # old rope
            return None
        if name in self.top:
            key = self.top[name]
            # some tied checkpoints store the copy anyway
            return None if key == "lm_head" and c.tie_word_embeddings else (key, None)
        m = re.fullmatch(rf"{re.escape(self.layer_prefix)}(\d+)\.(.+)", name)
        if m and m.group(2) in self.layer:
            return self.layer[m.group(2)], int(m.group(1))
        return name, None  # no such param: reported as unexpected

    def names(self, c: ModelConfig) -> dict[tuple[str, int | None], str]:
        """(params key, layer or None) -> tensor name, for every param of `c`."""
        top_shapes, layer_shapes = param_shapes(c)
        top = {k: n for n, k in self.top.items()}
        layer = {k: n for n, k in self.layer.items()}
        return {(k, None): top[k] for k in top_shapes} | {
            (k, i): f"{self.layer_prefix}{i}.{layer[k]}"
            for i in range(c.num_layers)
            for k in layer_shapes
        }


def hf_naming(family: ModuleType) -> Naming:
    """Hugging Face tensor names of a model family (`models.llama`, ...)."""
    return Naming(
        top={
            "model.embed_tokens.weight": "embed",
            "model.norm.weight": "final_norm",
            "lm_head.weight": "lm_head",
        },
        layer=family.LAYER_TENSORS,
        layer_prefix="model.layers.",
        aliases=getattr(family, "TENSOR_ALIASES", {}),
        ignored=getattr(family, "IGNORED_PREFIXES", ()),
    )


def assemble_params(
    c: ModelConfig,
    tensors: Iterable[TensorEntry],
    naming: Naming,
    dtype: Any,
    source: str,
    mesh: Mesh | None = None,
) -> dict:
    """Build the params pytree of checkpoint `source` from `(name, file, shape, read)`, where
    `shape` and the NumPy tensor `read()` returns are in PyTorch's orientation (`[out, in]`).
    Shapes are checked before any read; errors name the tensor and its file. The one place
    the weights go to the device: each param straight into its shards when there is a
    `mesh` (`models.sharding`), so no device ever holds the whole model."""
    if mesh is not None:
        sharding.check(c, mesh.size)
    put = sharding.placer(c, mesh)
    np_dtype = resolve_dtype(dtype)
    top_shapes, layer_shapes = param_shapes(c)
    # With several processes each keeps only the box of each param its devices hold
    # (`sharding.local_box`), KV heads repeated: no process holds the whole model.
    n = 1 if mesh is None else mesh.size
    shapes = {
        (k, True): (c.num_layers, *sharding.global_shape(k, s, c, n))
        for k, s in layer_shapes.items()
    }
    shapes |= {(k, False): sharding.global_shape(k, s, c, n) for k, s in top_shapes.items()}
    boxes = {kl: sharding.local_box(*kl, shape, mesh) for kl, shape in shapes.items()}
    top: dict[str, np.ndarray] = {}
    layers = {
        k: np.empty(_held((c.num_layers, *s), boxes[k, True]), np_dtype)
        for k, s in layer_shapes.items()
    }
    seen: set[tuple[str, int | None]] = set()
    for name, file, shape, read in tensors:
        target = naming.target(name, c)
        if target is None:
            continue
        key, layer = target
        expected = layer_shapes.get(key) if layer is not None else top_shapes.get(key)
        if expected is None:
            raise ValueError(f"{file}: unexpected tensor {name!r} for a {c.architecture} model")
        if layer is not None and layer >= c.num_layers:
            raise ValueError(
                f"{file}: unexpected tensor {name!r}: the model has {c.num_layers} layers"
            )
        hf_shape = expected[::-1] if key in LINEAR else expected
        if tuple(shape) != hf_shape:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {tuple(shape)}, expected {hf_shape}"
            )
        value = read()
        value = value.T if key in LINEAR else value
        box = boxes[key, layer is not None]
        if box is not None:
            value = sharding.repeat_kv(key, value, c, n)[box[1:] if layer is not None else box]
        if layer is None:
            top[key] = value.astype(np_dtype)
        else:
            layers[key][layer] = value  # casts on assignment, no temporary
        seen.add((key, layer))
    missing = [name for target, name in naming.names(c).items() if target not in seen]
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(
            f"{source}: checkpoint is missing tensors: {', '.join(missing[:10])}{more}"
        )
    params: dict[str, Any] = {
        k: put(k, top.pop(k), False, boxes[k, False], shapes[k, False]) for k in list(top)
    }
    params["layers"] = {
        k: put(k, layers.pop(k), True, boxes[k, True], shapes[k, True]) for k in list(layers)
    }
    return params


def _held(shape: tuple[int, ...], box: tuple[slice, ...] | None) -> tuple[int, ...]:
    """What a process holds of a param of checkpoint `shape`: all of it, or its box."""
    return shape if box is None else tuple(b.stop - b.start for b in box)


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


def _read_safetensors(files: list[str]) -> Iterable[TensorEntry]:
    for file in tqdm(files, desc="loading shards", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shape = tuple(f.get_slice(name).get_shape())
                yield name, file, shape, functools.partial(f.get_tensor, name)


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


def load(path: str | os.PathLike, dtype: str = "auto", tensor_parallel: int = 1) -> LoadedModel:
    """Load a Hugging Face checkpoint directory, a `.gguf` file / a directory holding one, or a
    demo model by name (`models.demo.MODELS`, fetched once).

    Weights come out in `dtype` ("auto": bfloat16 on a GPU, float32 elsewhere) whatever the
    checkpoint stores or declares (`torch_dtype`, GGUF tensor types): it is the user's call.
    With `tensor_parallel` N > 1 they load split over the first N devices (`models.sharding`);
    the returned config is the one the split model runs with.
    """
    mesh = None if tensor_parallel == 1 else sharding.make_mesh(tensor_parallel)
    model = _load(os.fspath(demo.resolve(path)[0]), concrete_dtype(dtype), mesh)
    if mesh is None:
        return model
    return dataclasses.replace(model, config=sharding.sharded_config(model.config, mesh.size))


def _load(path: str, dtype: str, mesh: Mesh | None) -> LoadedModel:
    resolve_dtype(dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if _is_gguf(path):
        from models.gguf import load_gguf  # the gguf package is only needed here

        return load_gguf(path, dtype, mesh)
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
    tensors = _read_safetensors(_safetensors_files(path))
    params = assemble_params(config, tensors, hf_naming(family), dtype, path, mesh)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=load_tokenizer(path),
        generation_config=generation,
        source=path,
    )
