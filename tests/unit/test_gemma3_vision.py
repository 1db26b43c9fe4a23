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
from models import mmproj as mmproj_file
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


def write_mmproj(hf: Any, path: Path, mean: tuple[float, ...] = (0.5, 0.5, 0.5)) -> None:
    """Gemma 3's vision half as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes it: names
    from the gguf package's own map, the projector's norm + 1, the projection float16."""
    import gguf

    vc = hf.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vc.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("gemma3")
    w.add_vision_image_size(vc.image_size)
    w.add_vision_patch_size(vc.patch_size)
    w.add_vision_embedding_length(vc.hidden_size)
    w.add_vision_feed_forward_length(vc.intermediate_size)
    w.add_vision_block_count(vc.num_hidden_layers)
    w.add_vision_head_count(vc.num_attention_heads)
    w.add_vision_image_mean(list(mean))
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_attention_layernorm_eps(vc.layer_norm_eps)
    w.add_vision_use_gelu(True)
    w.add_vision_projector_scale_factor(vc.image_size // vc.patch_size // 2)  # 4 tokens
    for name, t in hf.state_dict().items():
        name = name.removeprefix("model.").replace("_weight", ".weight")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        base, kind = name.rsplit(".", 1)
        new = names.get_name(base.replace("vision_tower.", "vision_tower.vision_model.", 1))
        value = t.numpy()
        if "soft_emb_norm" in name:
            value = value + 1
        dtype = np.float16 if "projection" in name else np.float32
        w.add_tensor(f"{new}.{kind}", value.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_mmproj_file_is_the_same_vision_half(
    tiny: Tiny, tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """A Gemma 3 text model plus llama.cpp's mmproj file of the tiny model's vision half loads
    that half as its checkpoint directory does (the projection rounded to float16)."""
    from flax import nnx
    from transformers import PreTrainedTokenizerFast

    mmproj = tmp_path / "mmproj.gguf"
    write_mmproj(tiny.hf, mmproj, mean=(0.25, 0.5, 0.75))
    text = tmp_path / "text"  # the tiny text model, its vocabulary holding the image tokens
    text.mkdir()
    for f in tiny_gemma3_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (text / f.name).symlink_to(f)
    tokens = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_gemma3_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.save_pretrained(text)
    loaded = models.load(text, dtype="float32", mmproj=mmproj)
    assert loaded.vision is not None and tiny.loaded.vision is not None
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert loaded.vision.config == dataclasses.replace(
        tiny.loaded.vision.config, boi_token_id=ids[0], eoi_token_id=ids[1], image_token_id=ids[2]
    )
    ours = nnx.to_flat_state(nnx.state(loaded.vision))
    expected = dict(nnx.to_flat_state(nnx.state(tiny.loaded.vision)))
    for path, value in ours:
        want = np.asarray(expected[path][...])
        if path[-2:] == ("proj", "kernel"):
            want = want.astype(np.float16).astype(np.float32)
        if path == ("projector", "norm"):  # the file holds 1 + w in float32
            want = (want + np.float32(1)) - np.float32(1)
        np.testing.assert_array_equal(np.asarray(value[...]), want, err_msg=str(path))
    assert loaded.image_processing is not None
    assert loaded.image_processing.image_mean == (0.25, 0.5, 0.75)
    assert (loaded.image_processing.height, loaded.image_processing.width) == (32, 32)
    # and what does not fit is named
    with pytest.raises(ValueError, match=r"vocabulary lacks <start_of_image>"):
        models.load(tiny_gemma3_dir, dtype="float32", mmproj=mmproj)
    with pytest.raises(ValueError, match=r"has a vision tower of its own"):
        models.load(tiny.path, dtype="float32", mmproj=mmproj)
    small = dataclasses.replace(loaded.config, hidden_size=32)
    with pytest.raises(ValueError, match=r"projects images to 64 dimensions.* is 32"):
        mmproj_file.read(mmproj, small, tokenizer.get_vocab())
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable GGUF file"):
        mmproj_file.read(text / "model.safetensors", loaded.config, tokenizer.get_vocab())
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"not a Gemma 3 mmproj file \(architecture 'llama'"):
        mmproj_file.read(tmp_path / "llama.gguf", loaded.config, tokenizer.get_vocab())
