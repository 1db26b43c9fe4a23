"""Hugging Face checkpoint directory (or GGUF file) -> LoadedModel: checkpoint names -> the
module's state.

The module is created abstractly (`nnx.eval_shape`: shapes, dtypes and partition specs,
nothing allocated) and its state filled. Weights go from safetensors straight to NumPy
in the requested dtype (bfloat16 through ml_dtypes, no PyTorch), are transposed to
`[in, out]` and stacked per layer into preallocated arrays, then moved to the device
one weight at a time so peak host memory stays near one copy of the model.
`assemble` does that for GGUF files too (`models.gguf` reads them, dequantized; the
names are mapped here): one set of checks, one place that puts weights on the devices.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from tqdm import tqdm

from jpaged.config import ACTIVATIONS, QUANTIZATIONS
from jpaged.dtypes import concrete_dtype, resolve_dtype
from jpaged.models import (
    demo,
    fused,
    gemma3,
    gemma3_vision,
    hostcopy,
    llama,
    moe,
    quant,
    qwen3,
    qwen3_moe,
    sharding,
)
from jpaged.models.common import CausalLM
from jpaged.models.config import ModelConfig, TensorEntry
from jpaged.models.gemma3_vision import Gemma3Vision, Gemma3VisionConfig
from jpaged.models.gguf_blocks import Blocks, Encoded, requantize
from jpaged.models.image import image_processing
from jpaged.models.loaded import LoadedModel

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, gemma3, qwen3_moe)
SUPPORTED = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)
LAYERS = "layers."  # the state paths of the stacked per-layer weights
WEIGHT_ONLY = ("int8", "fp8")  # quantizations made while loading, from float values
MODELS: dict[str, type[CausalLM]] = {
    "llama": llama.Llama,
    "qwen3": qwen3.Qwen3,
    "gemma3": gemma3.Gemma3,
    "qwen3moe": qwen3_moe.Qwen3Moe,
}


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


def abstract(config: ModelConfig, dtype: Any) -> CausalLM:
    """The module of `config`, its weights `jax.ShapeDtypeStruct`s in `dtype` (with their
    partition specs): nothing allocated, nothing initialised."""
    build = MODELS[config.architecture]
    return nnx.eval_shape(lambda: build(config, dtype=dtype, rngs=nnx.Rngs(0)))


def logical(config: ModelConfig) -> dict[str, Any]:
    """The logical weights of `config` (q/k/v and gate/up apart, float32) by dotted path:
    abstract, as `abstract` gives them (a load asks three times; each took 0.045 s)."""
    return _logical(fused.unfused(config))


@functools.lru_cache(maxsize=4)
def _logical(unfused: ModelConfig) -> dict[str, Any]:
    return _flat(nnx.state(abstract(unfused, np.float32)))


def _flat(state: nnx.State) -> dict[str, Any]:
    """A state's weights by dotted path (`layers.attn.q.kernel`)."""
    return {".".join(map(str, path)): w for path, w in nnx.to_flat_state(state)}


@dataclasses.dataclass(frozen=True)
class Naming:
    """How a checkpoint format names the module's weights.

    `top` maps a global tensor name to its state path, `layer` the rest of a per-layer name
    (after `{layer_prefix}{i}.`) to its path under `layers` (the stacked layers' state
    path). `aliases` rewrite name prefixes first; tensors under an `ignored` prefix are not
    weights.
    """

    top: Mapping[str, str]
    layer: Mapping[str, str]
    layer_prefix: str
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    layers: str = LAYERS

    def target(self, name: str, c: ModelConfig) -> tuple[str, int | None] | None:
        """(state path, layer or None) for a tensor name; None when the tensor is ignored,
        the name itself (and no layer) when no weight has that name."""
        for alias, canonical in self.aliases.items():
            if name.startswith(alias):
                name = canonical + name[len(alias) :]
                break
        if name.startswith(self.ignored) or name.endswith("rotary_emb.inv_freq"):  # old rope
            return None
        if name in self.top:
            key = self.top[name]
            # some tied checkpoints store the copy anyway
            return None if key.startswith("lm_head.") and c.tie_word_embeddings else (key, None)
        m = re.fullmatch(rf"{re.escape(self.layer_prefix)}(\d+)\.(.+)", name)
        if m and m.group(2) in self.layer:
            return f"{self.layers}{self.layer[m.group(2)]}", int(m.group(1))
        return name, None  # no such weight: reported as unexpected

    def names(self, paths: Iterable[str], num_layers: int) -> dict[tuple[str, int | None], str]:
        """(state path, layer or None) -> tensor name, for every weight of `paths`."""
        top = {k: n for n, k in self.top.items()}
        layer = {f"{self.layers}{k}": n for n, k in self.layer.items()}
        return {
            (k, i): f"{self.layer_prefix}{i}.{layer[k]}"
            for k in paths
            if k in layer
            for i in range(num_layers)
        } | {(k, None): top[k] for k in paths if k in top}


def hf_naming(family: ModuleType) -> Naming:
    """Hugging Face tensor names of a model family (`models.llama`, ...)."""
    return Naming(
        top={
            "model.embed_tokens.weight": "embed.embedding",
            "model.norm.weight": "final_norm.scale",
            "lm_head.weight": "lm_head.kernel",
        },
        layer=family.LAYER_TENSORS,
        layer_prefix="model.layers.",
        aliases=getattr(family, "TENSOR_ALIASES", {}),
        ignored=getattr(family, "IGNORED_PREFIXES", ()),
    )


# Gemma 3's vision tower and projector (`models.gemma3_vision`), beside its text model
VISION_NAMING = Naming(
    top=gemma3_vision.VISION_TENSORS,
    layer=gemma3_vision.VISION_LAYER_TENSORS,
    layer_prefix=gemma3_vision.VISION_LAYER_PREFIX,
    aliases=gemma3_vision.VISION_ALIASES,
    ignored=gemma3_vision.VISION_IGNORED,
    layers="tower.layers.",
)

# llama.cpp's tensor names for the module's weights
GGUF_NAMING = Naming(
    top={"token_embd.weight": "embed.embedding", "output_norm.weight": "final_norm.scale",
         "output.weight": "lm_head.kernel"},
    layer={
        "attn_norm.weight": "attn_norm.scale",
        "attn_q.weight": "attn.q.kernel", "attn_k.weight": "attn.k.kernel",
        "attn_v.weight": "attn.v.kernel", "attn_output.weight": "attn.o.kernel",
        "attn_q.bias": "attn.q.bias", "attn_k.bias": "attn.k.bias", "attn_v.bias": "attn.v.bias",
        "attn_output.bias": "attn.o.bias",
        "attn_q_norm.weight": "attn.q_norm.scale", "attn_k_norm.weight": "attn.k_norm.scale",
        # llama/qwen3: post_attention_layernorm; gemma3: pre_feedforward_layernorm
        "ffn_norm.weight": "mlp_norm.scale",
        "post_attention_norm.weight": "post_attn_norm.scale",
        "post_ffw_norm.weight": "post_mlp_norm.scale",
        "ffn_gate.weight": "mlp.gate.kernel", "ffn_up.weight": "mlp.up.kernel",
        "ffn_down.weight": "mlp.down.kernel",
        # a mixture of experts (qwen3moe): the router, the experts' stacks [E, out, in]
        "ffn_gate_inp.weight": "moe.router", "ffn_gate_exps.weight": "moe.gate.kernel",
        "ffn_up_exps.weight": "moe.up.kernel", "ffn_down_exps.weight": "moe.down.kernel",
    },
    layer_prefix="blk.",
    ignored=("rope_freqs.",),  # Llama 3 rope scaling, read into the config
)  # fmt: skip


def assemble(
    c: ModelConfig,
    tensors: Iterable[TensorEntry],
    naming: Naming,
    dtype: Any,
    source: str,
    mesh: Mesh | None = None,
    layout: quant.Layout | None = None,
    int8_inputs: bool = False,
) -> CausalLM:
    """The module of checkpoint `source`, its state filled from `(name, file, shape, read)`,
    where `shape` and what `read()` returns are in PyTorch's orientation (`[out, in]`): a
    NumPy tensor, or `gguf_blocks.Blocks` (or `Encoded`: a GGUF's blocks as they lie, decoded
    straight into place) for a weight `layout` holds quantized (state path -> `quant.Form`:
    a `quant.QuantWeight` of codes and scales in its place).
    Shapes are checked before any read; errors name the tensor and its file.
    The one place the weights go to the device: each straight into its shards when there
    is a `mesh` (as the module's partition specs say), so no device ever holds the whole
    model. With `mesh`, the module runs with `sharding.sharded_config(c, mesh.size)`.
    `int8_inputs` (`activations="int8"`): the weights that `quant.int8_takes` go to the device
    with their codes in the int8 kernels' order (`qdot.tile`), marked as rounding their
    inputs (`quant.round_inputs`)."""
    into = _Assembly(c, resolve_dtype(dtype), mesh, layout or {}, int8_inputs)
    for name, file, shape, read in tensors:
        into.take(naming, name, file, shape, read)
    into.check_complete(naming, source)
    return into.finish(mesh)


class _Assembly:
    """`assemble`'s work, by step: the module planned (`_plan`: its config, layout and
    which codes go narrow or tiled), host arrays made for the weights (`_allocate`), each
    checkpoint tensor written into them (`take`), then every weight placed on the devices
    (`finish`)."""

    def __init__(
        self,
        c: ModelConfig,
        np_dtype: Any,
        mesh: Mesh | None,
        layout: quant.Layout,
        int8_inputs: bool,
    ) -> None:
        self.n = n = 1 if mesh is None else mesh.size
        self.int8_inputs = int8_inputs
        module = self._plan(c, layout, np_dtype)
        c, layout = self.c, self.layout
        self.graphdef, self.state = nnx.split(module)
        self.weights = _flat(self.state)
        self.widths = fused.widths(module.config)
        # The checkpoint's own shapes (its KV heads not repeated), per layer for layer weights.
        self.shapes = {
            k: w.shape[1:] if k.startswith(LAYERS) else w.shape for k, w in logical(c).items()
        }
        self.parts = {k: _part_shapes(k, s, layout) for k, s in self.shapes.items()}
        # state path of each part's array in the module: itself, or its fused matrix's
        # (with the group and its index there)
        self.into = {
            p: fused.target(p) if c.fused_projections else None
            for k in self.parts
            for p in self.parts[k]
        }
        # With several processes each keeps only the box of each weight its devices hold
        # (`sharding.local_box`), KV heads repeated: no process holds the whole model.
        self.boxes = {k: sharding.local_box(w, mesh) for k, w in self.weights.items()}
        self._allocate()
        # With one device, a GGUF's blocks are decoded straight into the arrays the module
        # takes, transposed and tiled (`hostcopy.blocks_into`): no buffer, no copy or tiling
        # pass after.
        self.direct = n == 1 and all(b is None for b in self.boxes.values())
        self.tiled_now: set[str] = set()  # codes written tiled
        self.tile_later: set[str] = set()  # arrays written otherwise: tiled whole at the end
        self.seen: set[tuple[str, int | None]] = set()

    def _plan(self, c: ModelConfig, layout: quant.Layout, np_dtype: Any) -> CausalLM:
        """The abstract module, quantized as `layout` says; `c` and `layout` as it holds
        them (`self.c`, `self.layout`); which codes the kernels read tiled or narrow."""
        n = self.n
        # q/k/v and gate/up held as one matrix each unless their forms differ
        # (`models.fused`); `layout` and the checkpoint speak of the parts (the logical
        # weights)
        c = dataclasses.replace(c, fused_projections=c.fused_projections and fused.agree(layout))
        # a tied head whose codes are to be narrow (Q6_K's): the table held as its kernel
        table = layout.get("embed.embedding")
        tied = n == 1 and c.tie_word_embeddings
        if tied and isinstance(table, quant.Form) and quant.table_as_kernel(table, c.vocab_size):
            layout = {**layout, "embed.embedding": table._replace(transposed=True)}
        self.c, self.layout = c, layout
        module = abstract(sharding.sharded_config(c, n), np_dtype)
        quant.quantize(module, fused.layout(layout, c), n)
        kernels = {
            ".".join(map(str, (*path, "codes"))): w
            for path, w in nnx.iter_modules(module)
            if n == 1
            and isinstance(w, quant.QuantWeight)
            and w.axis == -2
            # (a mixture's experts are gathered and dequantized by XLA: codes as they lie)
            and not w.codes.get_metadata().get("whole")
        }
        rounded = {k: w for k, w in kernels.items() if self.int8_inputs and quant.int8_takes(w)}
        # Q6_K's and Q5_*'s codes, where the kernels read them (`quant.narrow_takes`), go to
        # the device at their own bits: decoded and tiled as every int8 code is, then packed
        # (`hostcopy.narrow`); packed codes tiled whatever the inputs (`quant.tiled_takes`)
        self.narrow = {k: w for k, w in kernels.items() if quant.narrow_takes(w)}
        self.tiled = set(rounded) | {k for k, w in kernels.items() if quant.tiled_takes(w)}
        return module

    def _allocate(self) -> None:
        """The host arrays the weights are written into (`host`), and the narrow stacks'
        bookkeeping."""
        c, layout, weights, boxes, into = self.c, self.layout, self.weights, self.boxes, self.into
        # a MixedWeight's stacks: as deep as their form's layers, each layer at its slot there
        depth = {
            f"{k}.stacks.{i}.{a}": mixed.count(i)
            for k, mixed in layout.items()
            if isinstance(mixed, quant.Mixed)
            for i in range(len(mixed.forms))
            for a in quant.ARRAYS
        }
        host: dict[str, np.ndarray] = {
            p: hostcopy.empty(_held((depth.get(p, c.num_layers), *s), boxes[p]), weights[p].dtype)
            for k in self.shapes
            if k.startswith(LAYERS)
            for p, s in self.parts[k].items()
            if into[p] is None
        }
        for k, mixed in layout.items():
            if isinstance(mixed, quant.Mixed):
                host[f"{k}.which"] = np.asarray(mixed.of_layer, np.int32)
                host[f"{k}.slot"] = np.asarray(mixed.slots(), np.int32)
        # a fused matrix is written whole as the module holds it (KV heads repeated)
        host |= {
            k: hostcopy.empty(_held(w.shape, boxes[k]), w.dtype)
            for k, w in weights.items()
            if fused.group_of(k) is not None
        }
        # a mixture's weights a layer has not (`moe.absent`): zeros, never read
        for k, a in host.items():
            for i in range(a.shape[0] if k.startswith(LAYERS) and ".stacks." not in k else 0):
                if moe.absent(c, k, i):
                    a[i] = 0
        # A stack of narrow codes is held narrow from the start: each layer's codes go to an
        # int8 array of their own, packed into the layer's slot once all its parts are
        # written (`written`), so the stack is never whole at 8 bits a code (an 8B Q5_K_M
        # peaked at 1.55x its file). A lone matrix (an LM head) is packed whole at the end.
        self.layered = {k: w for k, w in self.narrow.items() if k in host and boxes[k] is None}
        for k, q in self.layered.items():
            *lead, rows, out = host[k].shape
            host[k] = hostcopy.empty((*lead, rows * q.bits // 8, out), np.uint8)
        self.host = host
        # the codes parts each stack's layer is written in (a fused matrix's parts: several)
        self.writers = {
            k: sum(p.endswith(".codes") and (into[p] or (p,))[0] == k for p in into)
            for k in self.layered
        }
        # (stack, layer) -> [its int8 codes, parts to come]
        self.pending: dict[tuple[str, int], list] = {}
        # int8 layers packed already, for the next of their shape (a fresh one's pages would
        # each fault in once more)
        self.spare: dict[tuple[int, ...], list[np.ndarray]] = collections.defaultdict(list)

    def slot(self, key: str, layer: int | None) -> np.ndarray:
        """Where `key`'s layer `layer` is written."""
        assert layer is not None
        if key not in self.layered:
            return self.host[key][layer]
        if (key, layer) not in self.pending:
            shape = self.weights[key].shape[1:]
            spare = self.spare[shape]
            codes = spare.pop() if spare else hostcopy.empty(shape, np.int8)
            self.pending[key, layer] = [codes, self.writers[key]]
        return self.pending[key, layer][0]

    def written(self, key: str, layer: int | None) -> None:
        """One part of `key`'s layer `layer` written: the layer packed if it was the last."""
        if key not in self.layered or layer is None:
            return
        entry = self.pending[key, layer]
        entry[1] -= 1
        if entry[1]:
            return
        del self.pending[key, layer]
        if key in self.tile_later:
            hostcopy.tile(entry[0])
        q = self.layered[key]
        hostcopy.narrow(entry[0], q.bits, q.offset is not None, self.host[key][layer])
        self.spare[entry[0].shape].append(entry[0])

    def decode(
        self, value: Encoded, key: str, layer: int | None, row: int | None, linear: bool
    ) -> bool:
        """`value` decoded into its arrays in `host` (True), if its form is held as is."""
        form, prefix = _form_of(key, self.layout, layer)
        if not self.direct or form is None or form._replace(transposed=False) != value.form:
            return False
        into = self.into
        names = [f"{prefix}.{a}" for a in quant.ARRAYS]
        hit = into[names[0]]
        codes_key = names[0] if hit is None else hit[0]
        col0 = 0 if hit is None else sum(self.widths[hit[1]][: hit[2]])
        order = 1 if linear else 0
        if codes_key in self.tiled and col0 % 8 == 0 and value.shape[0] % 8 == 0:
            order = 2
        arrays: list[np.ndarray | None] = []
        for p in names:
            if p not in into:  # an array this form has not
                arrays.append(None)
            elif (hit := into[p]) is not None:
                arrays.append(self.slot(hit[0], layer))
            elif layer is None:
                self.host[p] = hostcopy.empty(self.weights[p].shape, self.weights[p].dtype)
                arrays.append(self.host[p])
            else:
                arrays.append(self.slot(p, row))
        if not value.into(hostcopy.Into(tuple(arrays), order, col0)):
            return False
        (self.tiled_now if order == 2 else self.tile_later).add(codes_key)
        self.written(codes_key, layer if hit is not None else row)
        return True

    def take(self, naming: Naming, name: str, file: str, shape: Any, read: Any) -> None:
        """One checkpoint tensor, its shape checked, written where the module holds it."""
        c = self.c
        target = naming.target(name, c)
        if target is None:
            return
        key, layer = target
        expected = self.shapes.get(key)
        if expected is None:
            raise ValueError(f"{file}: unexpected tensor {name!r} for a {c.architecture} model")
        if layer is not None and layer >= c.num_layers:
            raise ValueError(
                f"{file}: unexpected tensor {name!r}: the model has {c.num_layers} layers"
            )
        kernel, form = key.endswith(".kernel"), self.layout.get(key)
        # PyTorch's [out, in] (a stack of experts': [E, out, in])
        hf_shape = (*expected[:-2], *expected[:-3:-1]) if kernel else expected
        # stored transposed from PyTorch's [out, in]: kernels, and a table held as one
        linear = kernel or (isinstance(form, quant.Form) and form.transposed)
        if tuple(shape) != hf_shape:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {tuple(shape)}, expected {hf_shape}"
            )
        row = layer
        if isinstance(form, quant.Mixed) and layer is not None:
            row = form.slots()[layer]
        read_value = read()
        if isinstance(read_value, Encoded) and self.decode(read_value, key, layer, row, linear):
            self.seen.add((key, layer))
            return
        for part, value in _split(key, read_value, self.layout, layer).items():
            self._write(part, value.swapaxes(-1, -2) if linear else value, layer, row)
        self.seen.add((key, layer))

    def _write(self, part: str, value: np.ndarray, layer: int | None, row: int | None) -> None:
        """A part's array (in the module's orientation) written into its host array."""
        c, n, weights = self.c, self.n, self.weights
        if (hit := self.into[part]) is not None:
            dest, group, index = hit
            self.tile_later.add(dest)
            if fused.GROUPS[group][index] in fused.KV_PARTS:
                value = sharding.repeat_heads(value, c, n)
            box = self.boxes[dest]
            first = 0
            if box is not None:  # the process's devices' shares, whole along the rest
                value = value[box[1:-1]]
                first = box[-1].start * n // weights[dest].shape[-1]
            fused.write(self.slot(dest, layer), value, self.widths[group], index, n, first)
            if part.endswith(".codes"):
                self.written(dest, layer)
            return
        self.tile_later.add(part)
        box = self.boxes[part]
        if box is not None:
            value = sharding.repeat_kv(weights[part], value, c, n)[
                box[1:] if layer is not None else box
            ]
        if layer is None:
            self.host[part] = hostcopy.aligned(value, weights[part].dtype)
        else:
            hostcopy.assign(self.slot(part, row), value)  # casts on assignment, no temporary
            self.written(part, row)

    def check_complete(self, naming: Naming, source: str) -> None:
        """A ValueError naming the tensors the checkpoint lacks (the first ten)."""
        missing = [
            name
            for target, name in naming.names(self.shapes, self.c.num_layers).items()
            if target not in self.seen and not moe.absent(self.c, *target)
        ]
        if missing:
            more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
            raise ValueError(
                f"{source}: checkpoint is missing tensors: {', '.join(missing[:10])}{more}"
            )

    def finish(self, mesh: Mesh | None) -> CausalLM:
        """Every weight on the devices (tiled, packed narrow, as planned), the module."""
        assert not self.tiled_now & self.tile_later, "codes written both tiled and not"
        host, narrow, tiled = self.host, self.narrow, self.tiled
        for key in list(host):
            w, value, box = self.weights[key], host.pop(key), self.boxes[key]
            if box is None:
                value = sharding.repeat_kv(w, value, self.c, self.n)
            if key in tiled and key not in self.tiled_now and key not in self.layered:
                hostcopy.tile(value)
            if key in narrow and key not in self.layered:
                value = hostcopy.narrow(value, narrow[key].bits, narrow[key].offset is not None)
            # A transfer in flight keeps its host array alive: unwaited, every weight would be
            # held twice until the first step ran them all (an 8B GGUF peaked at 2x the file).
            w.set_value(jax.block_until_ready(sharding.place(w, value, mesh, box)))
            del value  # the host copy goes before the next weight's arrives
        module = nnx.merge(self.graphdef, self.state)
        for path, w in nnx.iter_modules(module):
            if isinstance(w, quant.QuantWeight):
                key = ".".join(map(str, (*path, "codes")))
                w.narrow, w.tiled = key in narrow, key in tiled
        if self.int8_inputs:
            quant.round_inputs(module)
        return module


def assemble_vision(
    vc: Gemma3VisionConfig,
    c: ModelConfig,
    tensors: Iterable[TensorEntry],
    dtype: Any,
    source: str,
) -> Gemma3Vision:
    """The vision module of checkpoint `source` (whole on the default device: a few hundred
    MB, never split or quantized), its state filled from the checkpoint's vision tensors
    (`VISION_NAMING`; the text model's are skipped). `c`: the text model's config."""
    np_dtype = resolve_dtype(dtype)
    module = nnx.eval_shape(lambda: Gemma3Vision(vc, dtype=np_dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    weights = _flat(state)
    layers, stacked = VISION_NAMING.layers, vc.tower.num_layers
    host = {k: np.empty(w.shape, w.dtype) for k, w in weights.items() if k.startswith(layers)}
    seen: set[tuple[str, int | None]] = set()
    for name, file, _, read in tensors:
        target = VISION_NAMING.target(name, c)
        if target is None:
            continue
        key, layer = target
        if key not in weights or (layer is not None and layer >= stacked):
            raise ValueError(f"{file}: unexpected tensor {name!r} for a Gemma 3 vision tower")
        value = gemma3_vision.from_checkpoint(key, read())
        expected = weights[key].shape[1:] if layer is not None else weights[key].shape
        if value.shape != expected:
            raise ValueError(
                f"{file}: tensor {name!r} is {value.shape} in the module's layout, "
                f"expected {expected}"
            )
        if layer is None:
            host[key] = value.astype(weights[key].dtype)
        else:
            host[key][layer] = value
        seen.add((key, layer))
    missing = [n for t, n in VISION_NAMING.names(weights, stacked).items() if t not in seen]
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(
            f"{source}: checkpoint is missing vision tensors: {', '.join(missing[:10])}{more}"
        )
    for key, w in weights.items():
        w.set_value(jax.device_put(host.pop(key)))
    return nnx.merge(graphdef, state)


def _part_shapes(key: str, shape: tuple[int, ...], layout: quant.Layout) -> dict[str, tuple]:
    """The state's arrays of weight `key` of (module-oriented) `shape`: itself, or a quantized
    weight's codes, scale (and offset), their sub-blocks along the contraction axis."""
    if key not in layout:
        return {key: shape}
    form = layout[key]
    if isinstance(form, quant.Mixed):  # a stack a form
        return {
            f"{key}.stacks.{i}.{a.rsplit('.', 1)[1]}": s
            for i, f in enumerate(form.forms)
            for a, s in _part_shapes(key, shape, {key: f}).items()
        }
    axis = -2 if key.endswith(".kernel") else -1
    small, codes = list(shape), list(shape)
    small[axis] //= form.block
    codes[axis] //= 2 if form.packed else 1
    out = {f"{key}.codes": tuple(codes), f"{key}.scale": tuple(small)}
    out |= {f"{key}.offset": tuple(small)} if form.affine else {}
    if form.group:  # a float16 each `group` sub-blocks
        small[axis] //= form.group
        out[f"{key}.scale_super"] = tuple(small)
        out |= {f"{key}.offset_super": tuple(small)} if form.affine else {}
    return out


def _form_of(key: str, layout: quant.Layout, layer: int | None) -> tuple[quant.Form | None, str]:
    """How weight `key` (of `layer`) is held, None: as float; and its arrays' state path
    prefix (a mixed weight's: its form's stack)."""
    form = layout.get(key)
    if not isinstance(form, quant.Mixed):
        return form, key
    assert layer is not None
    i = form.of_layer[layer]
    return form.forms[i], f"{key}.stacks.{i}"


def _split(key: str, value: Any, layout: quant.Layout, layer: int | None) -> dict[str, np.ndarray]:
    """What `read()` gave for weight `key` (of `layer`) as the state's arrays
    (`_part_shapes`), in the checkpoint's orientation."""
    if isinstance(value, Encoded):
        value = value.blocks()
    form, prefix = _form_of(key, layout, layer)
    if form is None:
        return {key: value.dense() if isinstance(value, Blocks) else value}
    b = value.regrouped(form)
    supers = b.supers or (None, None)
    arrays = (b.codes, b.scale, b.offset, *supers)
    return {f"{prefix}.{k}": a for k, a in zip(quant.ARRAYS, arrays, strict=True) if a is not None}


def _held(shape: tuple[int, ...], box: tuple[slice, ...] | None) -> tuple[int, ...]:
    """What a process holds of a weight of checkpoint `shape`: all of it, or its box."""
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


# a checkpoint's expert tensor: `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def stack_experts(tensors: Iterable[TensorEntry], num_experts: int) -> Iterable[TensorEntry]:
    """A mixture's per-expert tensors (`...mlp.experts.{j}.gate_proj.weight`, as the hub's
    checkpoints and `save_pretrained` write them) as one stack a projection and layer
    (`...mlp.experts.gate_proj.weight` `[E, out, in]`), yielded once its last expert has
    come (one layer's stack read at a time); transformers 5's fused `experts.gate_up_proj`
    `[E, 2I, in]` as gate's and up's, `experts.down_proj` as down's."""
    waiting: dict[str, dict[int, TensorEntry]] = {}
    for entry in tensors:
        name, file, shape, read = entry
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            stem, what = name.rsplit(".", 1)
            if what == "down_proj":
                yield f"{stem}.down_proj.weight", file, tuple(shape), read
                continue
            e, two, din = shape
            for i, part in enumerate(("gate_proj", "up_proj")):
                half = functools.partial(
                    lambda r, i, h: r()[:, i * h : (i + 1) * h], read, i, two // 2
                )
                yield f"{stem}.{part}.weight", file, (e, two // 2, din), half
            continue
        m = _EXPERT.fullmatch(name)
        if m is None:
            yield entry
            continue
        key = f"{m.group(1)}.{m.group(3)}.weight"
        group = waiting.setdefault(key, {})
        group[int(m.group(2))] = entry
        if len(group) == num_experts:
            del waiting[key]
            yield key, file, (num_experts, *shape), _stacked([group[j] for j in range(num_experts)])
    for key, group in waiting.items():
        raise ValueError(
            f"{key}: the checkpoint holds {len(group)} of its {num_experts} experts' tensors"
        )


def _stacked(entries: list[TensorEntry]) -> Any:
    def read() -> np.ndarray:
        first = entries[0][3]()
        out = np.empty((len(entries), *first.shape), first.dtype)
        out[0] = first
        for j, entry in enumerate(entries[1:], 1):
            out[j] = entry[3]()
        return out

    return read


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


def load(
    path: str | os.PathLike,
    dtype: str = "auto",
    tensor_parallel: int = 1,
    quantization: str = "auto",
    activations: str = "float",
    mmproj: str | os.PathLike | None = None,
    expert_parallel: bool = False,
) -> LoadedModel:
    """Load a Hugging Face checkpoint directory, a `.gguf` file / a directory holding one, or a
    demo model by name (`models.demo.MODELS`, fetched once).

    `mmproj`: a Gemma 3 text model's vision half, as llama.cpp keeps it beside a GGUF
    (`models.mmproj`); a `Gemma3ForConditionalGeneration` directory holds its own.

    Weights come out in `dtype` ("auto": bfloat16 on a GPU, float32 elsewhere) whatever the
    checkpoint stores or declares (`torch_dtype`, GGUF tensor types): it is the user's call.
    With `tensor_parallel` N > 1 they load split over the first N devices (`models.sharding`);
    the returned config is the one the split model runs with.

    `quantization` (`QUANTIZATIONS`): "auto" keeps a GGUF's quantized matrices quantized on
    the device ("gguf", `models.quant`) and a safetensors checkpoint float ("none");
    "none" dequantizes a GGUF to `dtype` as it loads; "int8" quantizes every matrix of
    either (weight-only, symmetric, a scale per output channel) as it loads, "fp8" likewise
    to float8_e4m3 codes (for GPUs that convert fp8 natively; elsewhere it runs, slower
    than int8).

    `activations` (`ACTIVATIONS`): "int8" lets the CPU kernels round the inputs of matmuls
    with quantized weights (packed 4-bit or int8 codes, `quant.int8_takes`) to int8, a scale
    per 32 values, and multiply them in integers (as
    llama.cpp does: ~1.5-2x faster prompts and batches, logits no longer float-exact); a
    model whole on one CPU only.

    `expert_parallel`: a mixture of experts' (`models.moe`) experts whole over the
    `tensor_parallel` devices, E / N a device, rather than each expert split.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if activations == "int8" and (tensor_parallel > 1 or jax.default_backend() != "cpu"):
        raise ValueError(
            "activations='int8' is for the CPU kernels: a model whole on one CPU device "
            f"(here {jax.default_backend()}, tensor_parallel={tensor_parallel})"
        )
    mesh = None if tensor_parallel == 1 else sharding.make_mesh(tensor_parallel)
    dtype = concrete_dtype(dtype)
    loaded = _load(
        os.fspath(demo.resolve(path)[0]),
        dtype,
        mesh,
        quantization,
        activations == "int8",
        expert_parallel,
    )
    if mmproj is not None:
        from jpaged.models import (
            mmproj as mmproj_file,  # the gguf package, as `load_gguf` imports it
        )

        if loaded.vision is not None:
            raise ValueError(f"{loaded.source} has a vision tower of its own: no mmproj needed")
        vc, tensors, processing = mmproj_file.read(
            mmproj, loaded.config, loaded.tokenizer.get_vocab()
        )
        vision = assemble_vision(vc, loaded.config, tensors, dtype, os.fspath(mmproj))
        loaded = dataclasses.replace(loaded, vision=vision, image_processing=processing)
    return loaded


def _load(
    path: str,
    dtype: str,
    mesh: Mesh | None,
    quantization: str = "auto",
    int8_inputs: bool = False,
    expert_parallel: bool = False,
) -> LoadedModel:
    resolve_dtype(dtype)
    check_quantization(quantization)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if _is_gguf(path):
        return load_gguf(path, dtype, mesh, quantization, int8_inputs, expert_parallel)
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a GGUF file; {path} is not one")
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
    config = with_experts(config, expert_parallel, path)
    files = _safetensors_files(path)
    tensors = _read_safetensors(files)
    if config.moe is not None:
        tensors = stack_experts(tensors, config.moe.num_experts)
    naming, layout = hf_naming(family), None
    if quantization in WEIGHT_ONLY:
        _no_weight_only(config, quantization, path)
        layout = _weight_only_layout(config, 1 if mesh is None else mesh.size, quantization)
        tensors = _requantized(tensors, naming, config, layout)
    model = assemble(config, tensors, naming, dtype, path, mesh, layout, int8_inputs)
    # A second pass over the files' indices: the tensors are read lazily, each once.
    vision = (
        assemble_vision(
            gemma3_vision.vision_config(hf), config, _read_safetensors(files), dtype, path
        )
        if family is gemma3 and "Gemma3ForConditionalGeneration" in hf.get("architectures", [])
        else None
    )
    return LoadedModel(
        model=model,
        tokenizer=load_tokenizer(path),
        generation_config=generation,
        source=path,
        vision=vision,
        image_processing=None if vision is None else image_processing(path),
        mesh=mesh,
    )


def _layout(
    c: ModelConfig, layouts: Mapping[str, quant.Form], naming: Naming, mixed: bool
) -> quant.Layout:
    """The weights to hold quantized: each matrix (kernels, the embedding) whose every
    layer's tensor is quantized. A stack of layers whose types want different forms is
    `quant.Mixed` (a stack a form) when `mixed`, else one form that holds them all: the
    smallest sub-block, an offset if any has one, codes packed and scales float16 if all
    are. Two-level scales (`quant.Form.group`) where the CPU kernels read them, when `mixed`
    (a CPU, one device): kernels, the embedding (a tied Q6_K head: 8.56 bits a weight,
    10 with a float32 scale a 16); elsewhere their products."""
    names: dict[str, dict[int | None, str]] = {}
    paths = logical(c)
    for (key, layer), name in naming.names(paths, c.num_layers).items():
        if not moe.absent(c, key, layer):
            names.setdefault(key, {})[layer] = name
    out: dict[str, quant.Form | quant.Mixed] = {}
    for key, by_layer in names.items():
        if not (key.endswith(".kernel") or key == "embed.embedding"):
            continue
        if not all(n in layouts for n in by_layer.values()):
            continue
        forms = [layouts[by_layer[layer]] for layer in sorted(by_layer, key=lambda n: n or 0)]
        if not mixed:
            forms = [f.one_level() for f in forms]
        distinct = list(dict.fromkeys(forms))
        if len(distinct) == 1:
            out[key] = distinct[0]
        elif mixed:
            out[key] = quant.Mixed(tuple(distinct), tuple(distinct.index(f) for f in forms))
        else:
            out[key] = quant.Form(
                min(f.block for f in forms),
                any(f.affine for f in forms),
                all(f.packed for f in forms),
                half=all(f.half for f in forms),
            )
    return out


def _weight_only_layout(c: ModelConfig, devices: int, quantization: str) -> dict[str, quant.Form]:
    """`quantization="int8"` / `"fp8"`: every kernel and the embedding, symmetric int8
    (float8_e4m3) codes with one scale per output channel (per vocabulary row), i.e. one
    sub-block along the whole contraction axis, or per device's part of it where tensor
    parallelism splits that axis (a row-parallel layer: each device scales its own rows)."""
    out = {}
    for key, w in logical(c).items():
        if not (key.endswith(".kernel") or key == "embed.embedding"):
            continue
        axis = -2 if key.endswith(".kernel") else -1
        split = w.get_metadata().get("out_sharding") or ()
        parts = devices if len(split) == len(w.shape) and split[axis] == sharding.AXIS else 1
        out[key] = quant.Form(w.shape[axis] // parts, False, fp8=quantization == "fp8")
    return out


def _requantized(
    tensors: Iterable[TensorEntry], naming: Naming, c: ModelConfig, layout: dict[str, quant.Form]
) -> Iterable[TensorEntry]:
    """The tensors `layout` quantizes, each read as int8 (fp8) `Blocks` (one float tensor in
    memory at a time: the float model is never whole on the host)."""

    def quantized(read: Any, form: quant.Form) -> Blocks:
        value = read()
        dense = value.dense() if isinstance(value, Blocks) else value
        return requantize(dense, form.block, form.fp8)

    for name, file, shape, read in tensors:
        target = naming.target(name, c)
        if target is not None and target[0] in layout:
            read = functools.partial(quantized, read, layout[target[0]])
        yield name, file, shape, read


def with_experts(c: ModelConfig, expert_parallel: bool, source: str) -> ModelConfig:
    """`c` with its experts whole a device (`expert_parallel`), refused for a model without;
    a mixture refuses what it does not combine with (`quantization="int8"`/`"fp8"`)."""
    if not expert_parallel:
        return c
    if c.moe is None:
        raise ValueError(f"{source}: expert_parallel is for a mixture of experts; this is not")
    return dataclasses.replace(c, moe=dataclasses.replace(c.moe, expert_parallel=True))


def _no_weight_only(c: ModelConfig, quantization: str, source: str) -> None:
    if c.moe is not None:
        raise ValueError(
            f"{source}: quantization={quantization!r} does not quantize a mixture of experts' "
            "stacked experts yet: load it float (quantization='none') or from a quantized GGUF"
        )


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")


def load_gguf(
    path: str | Path,
    dtype: str = "auto",
    mesh: Mesh | None = None,
    quantization: str = "auto",
    int8_inputs: bool = False,
    expert_parallel: bool = False,
) -> LoadedModel:
    """A GGUF file (or the directory holding one): its module, tokenizer and generation
    config. Its float tensors (and, with `quantization="none"`, its quantized ones,
    dequantized) load in `dtype` whatever the file's types ("auto": bfloat16 on a GPU,
    float32 elsewhere); by default its quantized matrices stay quantized (`models.quant`)."""
    from jpaged.models import gguf  # the gguf package is only needed here

    dtype = concrete_dtype(dtype)
    resolve_dtype(dtype)
    check_quantization(quantization)
    f = gguf.read(path, quantized=quantization not in ("none", *WEIGHT_ONLY))
    f.config = with_experts(f.config, expert_parallel, f.source)
    tensors: Iterable[TensorEntry] = f.tensors
    # a mixed weight's switch a layer is a conditional in the step: cheap on a CPU, a host
    # round trip on a GPU (and tensor parallelism splits one form a weight)
    mixed = (mesh is None or mesh.size == 1) and jax.default_backend() == "cpu"
    layout = _layout(f.config, f.layouts, GGUF_NAMING, mixed)
    if quantization in WEIGHT_ONLY:
        _no_weight_only(f.config, quantization, f.source)
        layout = _weight_only_layout(f.config, 1 if mesh is None else mesh.size, quantization)
        tensors = _requantized(tensors, GGUF_NAMING, f.config, layout)
    model = assemble(f.config, tensors, GGUF_NAMING, dtype, f.source, mesh, layout, int8_inputs)
    return LoadedModel(
        model=model,
        tokenizer=f.tokenizer.result(),
        generation_config=f.generation_config,
        source=f.source,
        mesh=mesh,
    )


def shard_model(model: LoadedModel, mesh: Mesh) -> LoadedModel:
    """`model` laid out over `mesh`: as it is when `models.load(..., tensor_parallel=)` put
    it there already, else resharded from where it lies (whole, or over another mesh)."""
    module = model.model
    # codes in the CPU kernels' order (`qdot.tile`: int8 inputs', narrow and packed codes' (a
    # table held as its kernel's too)), which no split keeps
    held = [w for _, w in nnx.iter_modules(module) if isinstance(w, quant.QuantWeight) and w.tiled]
    rounded = any(w.int8_inputs for w in held)
    if held and mesh.size > 1:
        if rounded:
            raise ValueError(
                "a model loaded with activations='int8' runs whole on one CPU device: load "
                "it without activations='int8' to split it over devices"
            )
        raise ValueError(
            "a model loaded whole on one CPU device holds its quantized codes in the CPU "
            "kernels' order, which runs whole: load it with models.load(..., "
            "tensor_parallel=N) to split it over devices"
        )
    config = sharding.sharded_config(module.config, mesh.size)  # fails before any transfer
    weights = nnx.to_flat_state(nnx.state(module))
    if all(
        isinstance(getattr(w[...], "sharding", None), NamedSharding)
        and w[...].sharding.mesh == mesh
        and w[...].sharding.spec == sharding.spec_of(w)
        for _, w in weights
    ):
        return dataclasses.replace(model, mesh=mesh)
    dtype = module.embed.embedding.dtype
    build = type(module)
    abstract = nnx.eval_shape(lambda: build(config, dtype=dtype, rngs=nnx.Rngs(0)))
    quant.quantize(abstract, quant.layout_of(module), mesh.size)
    graphdef, state = nnx.split(abstract)
    old = dict(weights)
    for path, w in nnx.to_flat_state(state):
        value, group = old[path][...], fused.group_of(".".join(map(str, path)))
        if group is None:
            value = sharding.repeat_kv(w, value, module.config, mesh.size)
        else:  # the parts back apart, KV heads repeated, each device's shares in turn
            parts = fused.split(value, fused.widths(module.config)[group], fused.ways(value))
            kv = [p in fused.KV_PARTS for p in fused.GROUPS[group]]
            repeated = [
                sharding.repeat_heads(a, module.config, mesh.size) if k else a
                for a, k in zip(parts, kv, strict=True)
            ]
            value = fused.fuse(repeated, mesh.size)
        w.set_value(sharding.place(w, value, mesh))
    placed = nnx.merge(graphdef, state)
    if rounded:  # on one device (a data-parallel replica's): read as they lie, as before
        quant.round_inputs(placed)
    return dataclasses.replace(model, model=placed, mesh=mesh)


def engine_mesh(
    model: LoadedModel, tensor_parallel: int, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """The mesh an engine of `tensor_parallel` devices runs `model` on: the one
    `models.load(tensor_parallel=)` loaded it onto when that is it, else the first
    `tensor_parallel` of `devices` (default: `jax.devices()`)."""
    if devices is None and model.mesh is not None and model.mesh.size == tensor_parallel:
        return model.mesh
    return sharding.make_mesh(tensor_parallel, devices)
