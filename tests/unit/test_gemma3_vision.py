"""Gemma 3's vision half vs transformers, float32, on a tiny random
`Gemma3ForConditionalGeneration` written by its own `save_pretrained`: the image features
(tower + projector), image preprocessing, and a dense multimodal forward whose logits and
greedy tokens match transformers' for prompts with one and two images."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jpaged import models
from jpaged.models import gemma3_mm, loader
from jpaged.models import mmproj as mmproj_file
from jpaged.models.image import image_processing, preprocess

ATOL = 1e-4
dense = jax.jit(gemma3_mm.dense_logits)
BOI, EOI, IMAGE = 297, 298, 299
MM_TOKENS = 4


@pytest.fixture(scope="module")
def tiny(tiny_gemma3_vision: Any) -> Any:
    """`tests/conftest.py`'s tiny Gemma3ForConditionalGeneration (its image tokens BOI, EOI
    and IMAGE, MM_TOKENS an image)."""
    return tiny_gemma3_vision


def test_image_features_match_transformers(tiny: Any) -> None:
    import torch

    assert tiny.loaded.vision is not None
    pixels = np.random.default_rng(0).standard_normal((3, 3, 32, 32), np.float32)
    with torch.no_grad():
        ref = tiny.hf.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    features = jax.jit(lambda v, p: v(p))(tiny.loaded.vision, jnp.asarray(pixels))
    assert features.shape == (3, MM_TOKENS, 64)
    np.testing.assert_allclose(np.asarray(features), ref, atol=ATOL, rtol=0)


def test_checkpoint_layouts_and_errors(tiny: Any, tiny_gemma3_mm_dir: Path) -> None:
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


def test_preprocess_matches_transformers(tiny: Any) -> None:
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
def test_dense_forward_matches_transformers(tiny: Any, images: int) -> None:
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
    tiny: Any, tiny_gemma3_dir: Path, tmp_path: Path
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


# --------------------------------------------------------------------------- the engine

ENGINE = dict(dtype="float32", warmup=False, max_seq_len=64, max_batch_size=4, block_size=4)


def hf_prompt_logprobs(tiny: Any, tokens: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """transformers' logprob of each prompt token after the first."""
    import torch

    t_tokens = torch.tensor(tokens[None], dtype=torch.long)
    with torch.no_grad():
        logits = tiny.hf(
            input_ids=t_tokens,
            pixel_values=torch.tensor(pixels),
            token_type_ids=(t_tokens == IMAGE).long(),
        ).logits[0]
    lps = torch.log_softmax(logits, -1)[:-1].gather(1, t_tokens[0, 1:, None])[:, 0]
    return lps.numpy()


def hf_greedy(tiny: Any, tokens: np.ndarray, pixels: np.ndarray, n: int) -> list[int]:
    """transformers' greedy continuation of a prompt with images (bidirectional mask)."""
    import torch

    t_tokens = torch.tensor(tokens[None], dtype=torch.long)
    with torch.no_grad():
        out = tiny.hf.generate(
            input_ids=t_tokens,
            pixel_values=torch.tensor(pixels),
            token_type_ids=(t_tokens == IMAGE).long(),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(tokens) :].tolist()


def pixels_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def engine_llm(tiny: Any) -> Any:
    from jpaged import LLM

    return LLM(tiny.loaded, **ENGINE)


def _generate(
    llm: Any, prompts: list[tuple[np.ndarray, np.ndarray]], n: int = 6, logprobs: bool = False
) -> list:
    from jpaged import SamplingParams

    params = SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=0 if logprobs else None
    )
    batch = [{"prompt": t.tolist(), "images": list(p)} for t, p in prompts]
    out = llm.generate(batch, params)
    return [(c.token_ids, c.prompt_logprobs) if logprobs else c.token_ids for c in out]


def test_engine_greedy_matches_transformers(tiny: Any, engine_llm: Any) -> None:
    """Prompts with one and two images through the paged engine, together in one step (the
    encoder batched over three images): transformers' greedy tokens, and its logprob of
    every prompt token (greedy ids alone would not tell a causal mask among an image's
    tokens from the bidirectional one on this model; the logprobs do)."""
    prompts = [(prompt(1), pixels_of(1, 1)), (prompt(2), pixels_of(2, 2))]
    expected = [hf_greedy(tiny, t, p, 6) for t, p in prompts]
    got = _generate(engine_llm, prompts, logprobs=True)
    for (ids, lps), ref, (t, p) in zip(got, expected, prompts, strict=True):
        assert ids == ref
        assert lps[0] is None
        np.testing.assert_allclose(lps[1:], hf_prompt_logprobs(tiny, t, p), atol=1e-3, rtol=0)
    # the same image in another place of another prompt: the same continuation as alone
    assert _generate(engine_llm, prompts[::-1]) == expected[::-1]


def test_prefix_cache_keys_images_by_pixels(tiny: Any) -> None:
    """The same image in a shared prompt hits the cache through its blocks; another image
    hits only the text block before it; a hit that ends inside an image computes the
    image's rest in one step. Every answer is transformers'."""
    from jpaged import LLM

    llm = LLM(tiny.loaded, **ENGINE)
    tokens = prompt(1)  # bos, 3 text, boi, 4 image, eoi, 2 text: 13 tokens, blocks of 4
    image, other = pixels_of(1, 1), pixels_of(3, 1)

    def hits() -> int:
        return int(llm.stats()["kv_prefix_cache_hits"])

    first = _generate(llm, [(tokens, image)])
    assert first == [hf_greedy(tiny, tokens, image, 6)] and hits() == 0
    assert _generate(llm, [(tokens, image)]) == first
    a = hits()
    assert _generate(llm, [(tokens, other)]) == [hf_greedy(tiny, tokens, other, 6)]
    b = hits() - a
    # the same image, other text in the block of its last token: the hit ends inside it
    changed = tokens.copy()
    changed[-2:] = [7, 8]
    assert _generate(llm, [(changed, image)]) == [hf_greedy(tiny, changed, image, 6)]
    c = hits() - a - b
    # The same image: its blocks hit, up to where the window layers' blocks were freed
    # (window 5: the block of positions 8-11 is gone), so the hit ends inside the image
    # and its last token is computed with the prompt's rest. Another image: the text
    # block before it alone. The changed text: the same two blocks as the first.
    assert (a, b, c) == (8, 4, 8)


def test_chunked_prefill_never_splits_an_image(tiny: Any) -> None:
    """Prompt chunks of at most 6 tokens (images of 4): each chunk ends before an image it
    cannot finish, and the answers are transformers'."""
    from jpaged import LLM
    from jpaged.engine import images

    spans = images.spans(prompt(2).tolist(), IMAGE, list(pixels_of(2, 2)))
    assert [(s.start, s.end) for s in spans] == [(5, 9), (13, 17)]
    assert images.fit_chunk(spans, 0, 6) == 5  # cut before the first image
    assert images.fit_chunk(spans, 5, 6) == 6  # through it
    assert images.fit_chunk(spans, 11, 6) == 6  # through the second, to its end
    assert images.fit_chunk(spans, 11, 5) == 2  # cut before it
    assert images.fit_chunk(spans, 14, 2) == 0  # inside it, no room for its rest: wait
    with pytest.raises(ValueError, match="split the image"):
        images.row_images(spans, 0, 7)
    llm = LLM(tiny.loaded, max_num_batched_tokens=6, enable_prefix_caching=False, **ENGINE)
    prompts = [(prompt(2), pixels_of(2, 2)), (prompt(1), pixels_of(1, 1))]
    expected = [hf_greedy(tiny, t, p, 6) for t, p in prompts]
    assert _generate(llm, prompts) == expected


def test_text_prompt_placeholders_and_refusals(tiny: Any, engine_llm: Any) -> None:
    """A text prompt's `<start_of_image>` expands as transformers' processor expands it,
    and a PIL image is preprocessed as its image processor does: the same greedy tokens.
    A placeholder count other than the images', or images for embeddings, is refused."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from jpaged import SamplingParams
    from jpaged.engine.interface import PromptRequest
    from jpaged.engine.sampling import RequestError

    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (20, 25, 3), dtype=np.uint8), "RGB")
    text = "Look <start_of_image> here"
    tok = tiny.loaded.tokenizer
    run = "\n\n<start_of_image>" + "<image_soft_token>" * MM_TOKENS + "<end_of_image>\n\n"
    ids = np.asarray(tok.encode(text.replace("<start_of_image>", run)), np.int32)
    assert (ids == IMAGE).sum() == MM_TOKENS and ids[0] == 2  # bos
    pixels = Gemma3ImageProcessorPil.from_pretrained(tiny.path)([image], return_tensors="pt")
    want = hf_greedy(tiny, ids, pixels["pixel_values"].numpy(), 6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = engine_llm.generate({"prompt": text, "images": [image]}, params)[0]
    assert got.prompt_token_ids == ids.tolist() and got.token_ids == want
    with pytest.raises(RequestError, match="2 images' tokens for 1 images"):
        engine_llm.generate({"prompt": text + text, "images": [image]}, params)
    with pytest.raises(RequestError, match="embeddings take no images"):
        engine_llm.engine.prepare(PromptRequest(text, params, pooling="last", images=[image]))
    with pytest.raises(RequestError, match="must be \\[3, 32, 32\\]"):
        engine_llm.generate({"prompt": text, "images": [np.zeros((3, 8, 8), np.float32)]}, params)


def test_preempted_requests_recompute_their_images(tiny: Any) -> None:
    """A pool too small for three requests at once: some are preempted and recomputes its prompt,
    images included (encoded again), to the same tokens."""
    from jpaged import LLM

    llm = LLM(tiny.loaded, num_blocks=16, enable_prefix_caching=False, **ENGINE)
    prompts = [(prompt(2), pixels_of(s, 2)) for s in (2, 4, 5)]
    expected = [hf_greedy(tiny, t, p, 12) for t, p in prompts]
    assert _generate(llm, prompts, 12) == expected
    assert llm.stats()["preemptions"] > 0
