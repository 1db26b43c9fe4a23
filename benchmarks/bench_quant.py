"""Quantized-weight matmul forms inside a `lax.scan` of layers, at 1, 4 and 16 tokens.

    python -m benchmarks.bench_quant [--repeats N] [--tokens 1,4,16] [--forms a,b] [--decode]
                                     [--no-write]

A SmolLM2-135M-sized stack (30 layers; q/o 576x576, k/v 576x192, gate/up 576x1536,
down 1536x576) of weights held as int8 codes with a float32 scale and offset per
sub-block of 32 along the contraction axis (`models.quant`'s representation of a
Q4_1 file), run through each form the step could take:

- `float32`: the dequantized weights resident as float32 (today's path, 4 bytes/weight)
- `convert`: codes -> float32 * scale + offset, then one dot (what `models.quant` does)
- `chunked`: `convert` a slice of 64K weights at a time (a scan along the contraction axis,
  summing), so the converted slice stays in cache
- `blockdot`: a dot per sub-block `[T, nb, 32] x [nb, 32, out]`, then scaled and summed;
  the offset through the block sums of x
- `int8act`: x quantized per token to int8, int8 x int8 -> int32 dots per sub-block
- `nibbles`: two 4-bit codes per uint8, unpacked with shifts, then as `convert` (0.5
  byte/weight: only for the 4-bit types)
- `packed`: `models.quant.dot` on the nibbles (XLA's path, `chunked` with each slice's low
  nibbles dotted with their inputs, then the high ones)
- `qdot`, `qdot8`: `models.quant.dot` through the CPU kernels (`jpaged/models/qdot.cc`) on the
  nibbles and on int8 codes
- `qdot-int8`: `qdot` with the inputs rounded to int8 (`activations="int8"`), multiplied
  in integers

Each cell: milliseconds per call of the whole stack, the minimum over repeats with the
forms interleaved (the machine is shared: the load average is printed with the table).

`--decode`: the demo model SmolLM2-135M served end to end (`jpaged.LLM`, max_batch_size=16,
max_seq_len=512) with its GGUF weights dequantized to float32 (`quantization="none"`, the
old path) and kept quantized (the default), 64 greedy tokens at batch 1 and 4, the two
interleaved old, new, new, old; decode ms/step = (time of 64 tokens - time of 1) / 63,
best of the repeats.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.models import qdot, quant

LAYERS, HIDDEN, INTER, KV = 30, 576, 1536, 192
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
          "gate": (HIDDEN, INTER), "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}  # fmt: skip
BLOCK = 32
TOKENS = (1, 4, 16)
CHUNK_ELEMS = 1 << 16  # `chunked`: weights converted at a time (256 KiB as float32)
RESULTS = Path(__file__).with_name("RESULTS.md")


def _weights(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, (i, o) in SHAPES.items():
        codes = rng.integers(0, 16, (LAYERS, i, o)).astype(np.int8)
        scale = rng.uniform(1e-3, 2e-2, (LAYERS, i // BLOCK, o)).astype(np.float32)
        offset = rng.uniform(-0.1, 0.0, (LAYERS, i // BLOCK, o)).astype(np.float32)
        dense = codes.reshape(LAYERS, i // BLOCK, BLOCK, o) * scale[:, :, None] + offset[:, :, None]
        # two codes a byte: the low nibble the first half of each block, the high the second
        halves = codes.reshape(LAYERS, i // BLOCK, 2, BLOCK // 2, o).astype(np.uint8)
        nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(LAYERS, i // 2, o)
        out[name] = {"float": dense.reshape(LAYERS, i, o).astype(np.float32), "codes": codes,
                     "scale": scale, "offset": offset, "nibbles": nibbles}  # fmt: skip
    return out


def _float32(x: jax.Array, w: dict) -> jax.Array:
    return x @ w["float"]


def _dequant(codes: jax.Array, w: dict) -> jax.Array:
    i, o = codes.shape
    blocks = codes.reshape(i // BLOCK, BLOCK, o).astype(jnp.float32)
    return (blocks * w["scale"][:, None] + w["offset"][:, None]).reshape(i, o)


def _convert(x: jax.Array, w: dict) -> jax.Array:
    return x @ _dequant(w["codes"], w)


def _chunked(x: jax.Array, w: dict) -> jax.Array:
    i, o = w["codes"].shape
    nb = i // BLOCK  # chunks of whole sub-blocks, as many as fit CHUNK_ELEMS
    fits = [k for k in range(1, nb + 1) if nb % k == 0 and k * BLOCK * o <= CHUNK_ELEMS]
    rows = BLOCK * max(fits, default=1)
    n = i // rows
    chunks = (
        x.reshape(x.shape[0], n, rows).transpose(1, 0, 2),
        w["codes"].reshape(n, rows, o),
        w["scale"].reshape(n, rows // BLOCK, o),
        w["offset"].reshape(n, rows // BLOCK, o),
    )

    def one(acc: jax.Array, c: tuple) -> tuple[jax.Array, None]:
        xc, codes, scale, offset = c
        return acc + xc @ _dequant(codes, {"scale": scale, "offset": offset}), None

    return lax.scan(one, jnp.zeros((x.shape[0], o), jnp.float32), chunks)[0]


def _nibbles(x: jax.Array, w: dict) -> jax.Array:
    p = w["nibbles"]
    half, o = p.shape
    p = p.reshape(half * 2 // BLOCK, 1, BLOCK // 2, o)
    codes = jnp.concatenate([p & 15, p >> 4], axis=1).reshape(half * 2, o)
    return x @ _dequant(codes, w)


def _quant_dot(codes: str, kernels: bool, int8: bool = False) -> Callable:
    def dot(x: jax.Array, w: dict) -> jax.Array:
        with qdot.unsplit(kernels):
            return quant.dot(x, (w[codes], w["scale"], w["offset"]), jnp.float32, int8=int8)

    return dot


def _block_sums(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1, BLOCK).sum(-1)


def _blockdot(x: jax.Array, w: dict) -> jax.Array:
    i, o = w["codes"].shape
    xb = x.reshape(x.shape[0], i // BLOCK, BLOCK)
    codes = w["codes"].reshape(i // BLOCK, BLOCK, o).astype(jnp.float32)
    partial = jnp.einsum("tbs,bso->tbo", xb, codes)
    return jnp.einsum("tbo,bo->to", partial, w["scale"]) + _block_sums(x) @ w["offset"]


def _int8act(x: jax.Array, w: dict) -> jax.Array:
    i, o = w["codes"].shape
    sx = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0 + 1e-30
    xq = jnp.round(x / sx).astype(jnp.int8).reshape(x.shape[0], i // BLOCK, BLOCK)
    codes = w["codes"].reshape(i // BLOCK, BLOCK, o)
    partial = jnp.einsum("tbs,bso->tbo", xq, codes, preferred_element_type=jnp.int32)
    scaled = jnp.einsum("tbo,bo->to", partial.astype(jnp.float32), w["scale"])
    return scaled * sx + _block_sums(x) @ w["offset"]


FORMS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "float32": (_float32, ("float",)),
    "convert": (_convert, ("codes", "scale", "offset")),
    "chunked": (_chunked, ("codes", "scale", "offset")),
    "blockdot": (_blockdot, ("codes", "scale", "offset")),
    "int8act": (_int8act, ("codes", "scale", "offset")),
    "nibbles": (_nibbles, ("nibbles", "scale", "offset")),
    "packed": (_quant_dot("nibbles", False), ("nibbles", "scale", "offset")),
    "qdot": (_quant_dot("nibbles", True), ("nibbles", "scale", "offset")),
    "qdot8": (_quant_dot("codes", True), ("codes", "scale", "offset")),
    "qdot-int8": (_quant_dot("nibbles", True, int8=True), ("nibbles", "scale", "offset")),
}


def _stack(matmul: Callable) -> Callable:
    def layer(x: jax.Array, w: dict) -> tuple[jax.Array, None]:
        def mm(name: str, h: jax.Array) -> jax.Array:
            return matmul(h, w[name])

        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # stays finite
        x = x + mm("o", mm("q", x)) + 1e-3 * (mm("k", x) + mm("v", x)).sum(-1, keepdims=True)
        return x + mm("down", jax.nn.silu(mm("gate", x)) * mm("up", x)), None

    return jax.jit(lambda x, ws: lax.scan(layer, x, ws)[0])


def run(
    repeats: int, tokens: tuple[int, ...] = TOKENS, forms: tuple[str, ...] = tuple(FORMS)
) -> dict[tuple[str, int], float]:
    """ms per call of the stack, the best of `repeats`, for each form (float32, the
    reference, always) at each token count."""
    forms = ("float32", *(f for f in forms if f != "float32"))
    weights = _weights(np.random.default_rng(0))
    args = {
        form: {n: {k: jnp.asarray(w[k]) for k in FORMS[form][1]} for n, w in weights.items()}
        for form in forms
    }
    fns = {form: _stack(FORMS[form][0]) for form in forms}
    best: dict[tuple[str, int], float] = {}
    for t in tokens:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((t, HIDDEN)), jnp.float32)
        ref = np.asarray(fns["float32"](x, args["float32"]))
        for form in forms:  # compile, and check the form against float32
            out = np.asarray(fns[form](x, args[form]))
            err = np.abs(out - ref).max() / np.abs(ref).max()
            assert err < (5e-2 if "int8" in form else 1e-4), (form, t, err)
        for _ in range(repeats):
            for form in forms:  # interleaved: load spikes hit every form alike
                start = time.perf_counter()
                for _ in range(5):
                    fns[form](x, args[form]).block_until_ready()
                ms = (time.perf_counter() - start) / 5 * 1e3
                best[form, t] = min(best.get((form, t), float("inf")), ms)
    return best


def table(best: dict[tuple[str, int], float], load: tuple[float, float]) -> str:
    tokens = sorted({t for _, t in best})
    forms = list(dict.fromkeys(f for f, _ in best))
    nibbles = 0.5 + 8 / BLOCK
    bytes_per = {"float32": 4.0, "nibbles": nibbles, "packed": nibbles, "qdot": nibbles}
    bytes_per["qdot-int8"] = nibbles
    n = LAYERS * sum(i * o for i, o in SHAPES.values())
    lines = [
        f"{LAYERS} layers, {n / 1e6:.1f}M weights; ms per call of the stack, min over repeats "
        f"(forms interleaved); load average {load[0]:.2f} before, {load[1]:.2f} after, "
        f"{os.cpu_count()} cores, jax {jax.__version__}",
        "",
        "| form | MB read | " + " | ".join(f"T={t} ms" for t in tokens) + " | "
        + " | ".join(f"T={t} vs float32" for t in tokens) + " |",
        "|---|---|" + "---|" * (2 * len(tokens)),
    ]  # fmt: skip
    for form in forms:
        mb = n * bytes_per.get(form, 1 + 8 / BLOCK) / 1e6
        ms = [best[form, t] for t in tokens]
        ratio = [best["float32", t] / best[form, t] for t in tokens]
        lines.append(
            f"| {form} | {mb:.0f} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
            + " | ".join(f"{r:.2f}x" for r in ratio) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def decode(repeats: int) -> str:
    import jpaged

    before = os.getloadavg()[0]
    llms = {
        q: jpaged.LLM("smollm2-135m", max_batch_size=16, max_seq_len=512, quantization=q)
        for q in ("none", "auto")
    }
    prompts = [f"Question {i}: what is the capital of France? Answer:" for i in range(4)]
    best: dict[tuple[str, int, int], float] = {}
    for _ in range(repeats):
        for q in ("none", "auto", "auto", "none"):
            for batch in (1, 4):
                for tokens in (1, 64):
                    params = jpaged.SamplingParams(
                        max_tokens=tokens, temperature=0, ignore_eos=True
                    )
                    start = time.perf_counter()
                    llms[q].generate(prompts[:batch], params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    best[q, batch, tokens] = min(best.get((q, batch, tokens), 1e9), elapsed)
    lines = [
        f"SmolLM2-135M Q4_1 GGUF, jpaged.LLM max_batch_size=16 max_seq_len=512, 64 greedy tokens, "
        f"best of {repeats} (old, new, new, old); load average {before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, {os.cpu_count()} cores",
        "",
        "| weights | resident MB | batch 1 ms/step | batch 4 ms/step | batch 1 tok/s "
        "| batch 4 tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for q, name in (("none", "float32 (quantization=none)"), ("auto", "quantized (default)")):
        ms = [(best[q, b, 64] - best[q, b, 1]) / 63 * 1e3 for b in (1, 4)]
        mb = llms[q].stats()["weight_bytes"] / 1e6
        lines.append(
            f"| {name} | {mb:.0f} | {ms[0]:.1f} | {ms[1]:.1f} | "
            f"{1e3 / ms[0]:.1f} | {4e3 / ms[1]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode", action="store_true", help="the demo model end to end")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated (of FORMS)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    before = os.getloadavg()[0]
    if args.decode:
        text, what = decode(args.repeats), "SmolLM2 decode, float32 vs quantized weights"
    else:
        forms = tuple(args.forms.split(","))
        unknown = set(forms) - set(FORMS)
        if unknown:
            parser.error(f"--forms: unknown {sorted(unknown)}; known: {', '.join(FORMS)}")
        best = run(args.repeats, tuple(int(t) for t in args.tokens.split(",")), forms)
        text, what = table(best, (before, os.getloadavg()[0])), "quantized matmul forms"
    print(text)
    if not args.no_write:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        with RESULTS.open("a") as f:
            f.write(f"\n### {stamp}: {what} (issue 36)\n\n{text}\n")


if __name__ == "__main__":
    main()
