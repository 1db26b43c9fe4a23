"""llama.cpp's multimodal projector files (`--mmproj`): Gemma 3's vision half in a GGUF.

llama.cpp keeps a vision-language model's text model and its vision half in two files;
`convert_hf_to_gguf.py --mmproj` writes the second one (`general.architecture` "clip",
`clip.projector_type` "gemma3"): the SigLIP tower and projector under names of its own
(`v.blk.N.attn_q.weight`, `mm.input_projection.weight`, ...), the tower's geometry and the
image normalization as `clip.vision.*` metadata. This reads such a file as the loader's
checkpoint entries (transformers' names, llama.cpp's conversions undone) and the configs
`models.loader.assemble_vision` and `models.image.preprocess` take.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jpaged.models import gguf
from jpaged.models.config import ModelConfig, TensorEntry
from jpaged.models.gemma3_vision import Gemma3VisionConfig
from jpaged.models.image import ImageProcessing
from jpaged.models.siglip import SiglipConfig

# llama.cpp's names -> transformers' (`VISION_TENSORS`); a block's are `v.blk.N.<short>`
TOP = {
    "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_tower.post_layernorm.weight",
    "v.post_ln.bias": "vision_tower.post_layernorm.bias",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
}
LAYER = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
# The text side's tokens around and inside an image, named as Gemma 3's vocabulary does.
IMAGE_TOKENS = {
    "boi_token_id": "<start_of_image>",
    "eoi_token_id": "<end_of_image>",
    "image_token_id": "<image_soft_token>",
}


def checkpoint_name(name: str) -> str | None:
    """The transformers name of mmproj tensor `name` (None: not one Gemma 3 has)."""
    if name in TOP:
        return TOP[name]
    parts = name.split(".")  # v.blk.3.attn_q.weight
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in LAYER:
        return f"vision_tower.encoder.layers.{parts[2]}.{LAYER[parts[3]]}.{parts[4]}"
    return None


def _read(tensor: Any, name: str) -> np.ndarray:
    value = gguf._dequantize(tensor)
    # llama.cpp folds Gemma's (1 + w) into the projector's norm (the tower's are LayerNorms)
    return value - 1.0 if name == "mm.soft_emb_norm.weight" else value


def read(
    path: str | os.PathLike, text: ModelConfig, vocab: Mapping[str, int]
) -> tuple[Gemma3VisionConfig, list[TensorEntry], ImageProcessing]:
    """The mmproj file `path` for a Gemma 3 text model of config `text` whose tokenizer's
    vocabulary is `vocab`: the vision config, the tensors (read on demand) and the image
    preprocessing. ValueError naming the file when it is not a Gemma 3 mmproj or does
    not fit the text model."""
    file = os.fspath(path)
    try:
        reader = gguf.Reader(file)
    except Exception as e:  # bad magic, truncated file, missing file, ...
        raise ValueError(f"{file}: not a readable GGUF file ({e})") from e
    meta = functools.partial(gguf._meta, reader)
    kind = (meta("general.architecture"), meta("clip.projector_type"))
    if kind != ("clip", "gemma3") or not meta("clip.has_vision_encoder", False):
        raise ValueError(
            f"{file}: not a Gemma 3 mmproj file (architecture {kind[0]!r}, projector "
            f"{kind[1]!r}; llama.cpp's convert_hf_to_gguf.py --mmproj writes one)"
        )
    if text.architecture != "gemma3":
        raise ValueError(f"{file}: a Gemma 3 mmproj file needs a Gemma 3 text model")
    try:
        tower = SiglipConfig(
            hidden_size=int(gguf._require(reader, "clip.vision.embedding_length")),
            intermediate_size=int(gguf._require(reader, "clip.vision.feed_forward_length")),
            num_layers=int(gguf._require(reader, "clip.vision.block_count")),
            num_heads=int(gguf._require(reader, "clip.vision.attention.head_count")),
            image_size=int(gguf._require(reader, "clip.vision.image_size")),
            patch_size=int(gguf._require(reader, "clip.vision.patch_size")),
            layer_norm_eps=float(meta("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        )
    except KeyError as e:
        raise ValueError(f"{file}: {e.args[0]}") from e
    # the projector pools the patch grid by this factor a side (llama.cpp's default: 4)
    scale = int(meta("clip.vision.projector.scale_factor", 4))
    if scale < 1 or tower.patches_per_side % scale:
        raise ValueError(
            f"{file}: projector scale factor {scale} does not divide the "
            f"{tower.patches_per_side}x{tower.patches_per_side} patch grid"
        )
    side = tower.patches_per_side // scale
    tensors = {t.name: t for t in reader.tensors}
    projection = tensors.get("mm.input_projection.weight")
    if projection is None:
        raise ValueError(f"{file}: no tensor 'mm.input_projection.weight'")
    out = gguf._shape(projection)[-1]  # [vision hidden, text hidden], as transformers holds it
    if out != text.hidden_size:
        raise ValueError(
            f"{file}: projects images to {out} dimensions, the text model's hidden size "
            f"is {text.hidden_size}"
        )
    missing = [token for token in IMAGE_TOKENS.values() if token not in vocab]
    if missing:
        raise ValueError(f"{file}: the text model's vocabulary lacks {', '.join(missing)}")
    config = Gemma3VisionConfig(
        tower,
        text.hidden_size,
        mm_tokens_per_image=side * side,
        **{field: vocab[token] for field, token in IMAGE_TOKENS.items()},
    )
    entries: list[TensorEntry] = []
    for name, t in tensors.items():
        hf = checkpoint_name(name)
        if hf is None:
            raise ValueError(f"{file}: unexpected tensor {name!r} for a Gemma 3 mmproj")
        entries.append((hf, file, gguf._shape(t), functools.partial(_read, t, name)))
    d = ImageProcessing()
    processing = ImageProcessing(
        height=tower.image_size,
        width=tower.image_size,
        image_mean=tuple(meta("clip.vision.image_mean", d.image_mean)),
        image_std=tuple(meta("clip.vision.image_std", d.image_std)),
    )
    return config, entries, processing
