"""Gemma 3's image encoder (SigLIP tower + projector, `models.gemma3_vision`): time per image.

    python -m benchmarks.bench_vision                          # the tiny test model's shape
    python -m benchmarks.bench_vision --shape 1152,4304,27,16 --image 896,14 --mm-tokens 256
    python -m benchmarks.bench_vision --model DIR      # + a prompt with images, served

Random weights (the time does not depend on them). Each row: one jitted call on a batch of
images, the minimum over `--repeats` after a compile; "preprocess" is `models.image`'s
Pillow + NumPy resize / rescale / normalize of one 640x480 RGB image to the tower's size.
With `--model` (a `Gemma3ForConditionalGeneration` checkpoint directory) also the engine's
side: a one-token request whose prompt holds `--images` images (pixel arrays, so no Pillow)
against the same number of text tokens, the minimum wall time of each over `--repeats`
(prefix caching off: each request prefills its whole prompt). Prints tables; writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from benchmarks.common import machine_info, machine_line, render_table
from jpaged.dtypes import concrete_dtype, resolve_dtype
from jpaged.models.gemma3_vision import Gemma3Vision, Gemma3VisionConfig, encode
from jpaged.models.image import ImageProcessing, preprocess
from jpaged.models.siglip import SiglipConfig


def encoder(
    hidden: int, inter: int, layers: int, heads: int, image: int, patch: int, mm_tokens: int
) -> Gemma3VisionConfig:
    tower = SiglipConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        image_size=image,
        patch_size=patch,
    )
    return Gemma3VisionConfig(tower, text_hidden_size=64, mm_tokens_per_image=mm_tokens)


def time_encoder(
    config: Gemma3VisionConfig, batches: list[int], repeats: int, dtype: str
) -> list[tuple[int, float]]:
    """(batch, seconds per call: the minimum over `repeats`) for each batch size."""
    module = Gemma3Vision(config, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(module)
    run = functools.partial(encode, graphdef)
    size = config.tower.image_size
    out = []
    for b in batches:
        pixels = jnp.asarray(np.random.default_rng(b).standard_normal((b, 3, size, size)))
        jax.block_until_ready(run(state, pixels))  # compile
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(state, pixels))
            best = min(best, time.perf_counter() - start)
        out.append((b, best))
    return out


def time_preprocess(size: int, repeats: int) -> float:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), np.uint8))
    p = ImageProcessing(height=size, width=size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        preprocess([image], p)
        best = min(best, time.perf_counter() - start)
    return best


def time_requests(path: str, images: int, repeats: int) -> tuple[int, float, float]:
    """(prompt tokens, s with images, s as text) of a one-token request through an LLM."""
    import jpaged
    from jpaged import models

    loaded = models.load(path)
    assert loaded.vision is not None, f"{path} has no vision tower"
    vc = loaded.vision.config
    run = [vc.boi_token_id, *[vc.image_token_id] * vc.mm_tokens_per_image, vc.eoi_token_id]
    ids = [2, 10, 11, 12] + (run + [13, 14]) * images  # bos, text, then each image
    text = [2] + [10 + i % 100 for i in range(len(ids) - 1)]
    size = vc.tower.image_size
    pixels = [np.random.default_rng(i).standard_normal((3, size, size)) for i in range(images)]
    llm = jpaged.LLM(loaded, warmup=False, enable_prefix_caching=False)
    params = jpaged.SamplingParams(max_tokens=1)
    prompts = {"images": {"prompt": ids, "images": pixels}, "text": text}
    best = dict.fromkeys(prompts, float("inf"))
    for _ in range(repeats + 1):  # the first of each compiles
        for name, prompt in prompts.items():
            start = time.perf_counter()
            llm.generate([prompt], params)
            best[name] = min(best[name], time.perf_counter() - start)
    return len(ids), best["images"], best["text"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--shape", default="32,64,2,2", help="hidden,intermediate,layers,heads")
    p.add_argument("--image", default="32,8", help="image size,patch size")
    p.add_argument("--mm-tokens", type=int, default=4, help="mm_tokens_per_image")
    p.add_argument("--batches", default="1,2,4,8", help="comma-separated images a call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, else float32")
    p.add_argument("--model", help="a Gemma3ForConditionalGeneration directory: + requests")
    p.add_argument("--images", type=int, default=2, help="images in --model's prompt")
    args = p.parse_args(argv)
    hidden, inter, layers, heads = (int(x) for x in args.shape.split(","))
    image, patch = (int(x) for x in args.image.split(","))
    config = encoder(hidden, inter, layers, heads, image, patch, args.mm_tokens)
    dtype = concrete_dtype(args.dtype)
    print(machine_line(machine_info()))
    print(
        f"encoder: hidden {hidden}, intermediate {inter}, {layers} layers, {heads} heads, "
        f"{image}px / patch {patch} ({config.tower.patches_per_side**2} patches) -> "
        f"{args.mm_tokens} tokens, {dtype}"
    )
    batches = [int(b) for b in args.batches.split(",")]
    rows = [
        [str(b), f"{s * 1e3:.3f}", f"{s * 1e3 / b:.3f}", f"{b / s:.0f}"]
        for b, s in time_encoder(config, batches, args.repeats, dtype)
    ]
    print(render_table(["images a call", "ms a call", "ms an image", "images/s"], rows))
    ms = time_preprocess(image, args.repeats) * 1e3
    print(f"preprocess (640x480 RGB -> {image}px): {ms:.3f} ms")
    if args.model:
        n, with_images, as_text = time_requests(args.model, args.images, args.repeats)
        rows = [
            [f"{args.images} images", str(n), f"{with_images * 1e3:.2f}"],
            ["text", str(n), f"{as_text * 1e3:.2f}"],
        ]
        print(f"{args.model}: a one-token request (its prefill), served")
        print(render_table(["prompt", "tokens", "ms (min)"], rows))


if __name__ == "__main__":
    main()
