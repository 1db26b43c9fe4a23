"""Gemma 3's vision half vs transformers, float32, on a tiny random
`Gemma3ForConditionalGeneration` written by its own `save_pretrained`: the image features
(tower + projector), image preprocessing, and a dense multimodal forward whose logits and
greedy tokens match transformers' for prompts with one and two images."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import models
from models import gemma3_mm, loader
from models.image import image_processing, preprocess

ATOL = 1e-4
dense = jax.jit(gemma3_mm.dense_logits)
BOI, EOI, IMAGE = 297, 298, 299
MM_TOKENS = 4


@dataclasses.dataclass
class Tiny:
    path: Path
    hf: Any  # transformers' Gemma3ForConditionalGeneration, float32, eager attention
    loaded: models.LoadedModel


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory,
    randomize_weights: Callable[[Any, int, bool], None],
    write_tokenizer: Callable[[Path, str], None],
) -> Tiny:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

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
    write_tokenizer(path, "gemma3")
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    hf.set_attn_implementation("eager")
    return Tiny(path, hf, models.load(path, dtype="float32"))


def test_image_features_match_transformers(tiny: Tiny) -> None:
    import torch

    assert tiny.loaded.vision is not None
    pixels = np.random.default_rng(0).standard_normal((3, 3, 32, 32), np.float32)
    with torch.no_grad():
        ref = tiny.hf.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    features = jax.jit(lambda v, p: v(p))(tiny.loaded.vision, jnp.asarray(pixels))
    assert features.shape == (3, MM_TOKENS, 64)
    np.testing.assert_allclose(np.asarray(features), ref, atol=ATOL, rtol=0)


def test_checkpoint_layouts_and_errors(tiny: Tiny, tiny_gemma3_mm_dir: Path) -> None:
    # The released layout (`vision_tower.vision_model.`, sharded) loads the same way.
    released = models.load(tiny_gemma3_mm_dir, dtype="float32")
    assert released.vision is not None
    conv = next(
        read()
        for name, _, _, read in loader._read_safetensors(
            loader._safetensors_files(str(tiny_gemma3_mm_dir))
        )
        if name == "vision_tower.vision_model.embeddings.patch_embedding.weight"
    )  # [hidden, C, p, p]
    np.testing.assert_array_equal(released.vision.tower.patch.kernel[...], conv.reshape(32, -1).T)
    assert tiny.loaded.vision is not None
    vc, c = tiny.loaded.vision.config, tiny.loaded.config
    entries = loader._read_safetensors(loader._safetensors_files(str(tiny.path)))
    dropped = (e for e in entries if not e[0].endswith("layers.1.mlp.fc2.bias"))
    with pytest.raises(ValueError, match=r"missing vision tensors: .*layers\.1\.mlp\.fc2\.bias"):
        loader.assemble_vision(vc, c, dropped, "float32", "ckpt")


def test_preprocess_matches_transformers(tiny: Tiny) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (50, 41, 4), dtype=np.uint8), "RGBA"),
        Image.fromarray(rng.integers(0, 256, (17, 23), dtype=np.uint8), "L"),
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB"),
    ]
    reference = Gemma3ImageProcessorPil.from_pretrained(tiny.path)
    ref = reference(images, return_tensors="np")["pixel_values"]
    ours = preprocess(images, image_processing(tiny.path))
    assert ours.shape == (3, 3, 32, 32) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)


def prompt(images: int) -> np.ndarray:
    """bos, text, then per image: <start_of_image>, its image tokens, <end_of_image>, text."""
    rng = np.random.default_rng(images)
    parts = [[2], rng.integers(3, 290, 3).tolist()]
    for _ in range(images):
        parts += [[BOI], [IMAGE] * MM_TOKENS, [EOI], rng.integers(3, 290, 2).tolist()]
    return np.concatenate(parts).astype(np.int32)


def test_image_mask() -> None:
    tokens = jnp.asarray([2, BOI, IMAGE, IMAGE, EOI, IMAGE, IMAGE, 7])
    np.testing.assert_array_equal(
        gemma3_mm.image_blocks(tokens, IMAGE), [-1, -1, 0, 0, -1, 1, 1, -1]
    )
    full = np.asarray(gemma3_mm.attention_mask(tokens, IMAGE, None))
    assert full[2, 3] and not full[2, 5] and not full[4, 5] and full[7].all()
    sliding = np.asarray(gemma3_mm.attention_mask(tokens, IMAGE, 2))
    assert sliding[2, 3] and not sliding[7, 5] and sliding[7, 6]


@pytest.mark.parametrize("images", [1, 2])
def test_dense_forward_matches_transformers(tiny: Tiny, images: int) -> None:
    import torch

    vision = tiny.loaded.vision
    assert vision is not None
    tokens = prompt(images)
    pixels = np.random.default_rng(images).standard_normal((images, 3, 32, 32), np.float32)
    t_tokens = torch.tensor(tokens[None], dtype=torch.long)
    inputs = {
        "input_ids": t_tokens,
        "pixel_values": torch.tensor(pixels),
        "token_type_ids": (t_tokens == IMAGE).long(),
    }
    with torch.no_grad():
        ref = tiny.hf(**inputs).logits[0].numpy()
        # without token_type_ids transformers attends causally among image tokens: the
        # bidirectional mask moves the logits well past the tolerance, so parity checks it
        causal = tiny.hf(input_ids=t_tokens, pixel_values=inputs["pixel_values"]).logits
        assert np.abs(causal[0].numpy() - ref).max() > 100 * ATOL
        generated = tiny.hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0].numpy()
    model, image = tiny.loaded.model, jnp.asarray(pixels)
    # One length for the whole generation (one compile): pad tokens after the end
    ours = np.zeros(len(generated), np.int32)
    ours[: len(tokens)] = tokens
    logits = np.asarray(dense(model, vision, jnp.asarray(ours), image))
    np.testing.assert_allclose(logits[: len(tokens)], ref, atol=ATOL, rtol=0)
    for n in range(len(tokens), len(generated)):
        ours[n] = np.argmax(logits[n - 1])
        logits = np.asarray(dense(model, vision, jnp.asarray(ours), image))
    np.testing.assert_array_equal(ours, generated)
