"""The CPU quantized-matmul kernels (jpaged/models/qdot.cc) alone at Llama-3.1-8B's shapes, a few
tokens, each in a form a GGUF's weights are held in (`--forms`: Q4_0's packed codes and
float16 scales, Q4_K's with int8 sub-scales and sub-offsets under float16 super-scales,
Q6_K's int8 codes with int8 sub-scales of 16, Q5_K's of 0..31 with Q4_K's scales, Q5_0's
of -16..15 with Q4_0's; six and five bits a code, all in the kernels' order, as the loader
holds them): ms a call and GB/s of weights read, float and int8 activations, and their sum
over a decode step's matrices. One thread: run under `taskset -c 0`; on a shared machine
`--cpu` (CPU time: threads waiting on others count, so one thread). `--cached`: a 2048 x
2048 matrix read again and again from the caches, the kernels' instruction rate rather than
the memory's.

    python -m benchmarks.bench_qdot8b [--reps 20] [--forms q4_0,q4_k,q6_k,q5_k,q5_0]
        [--tokens 1,4]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import render_table
from jpaged.models import qdot

# the decode step's matrices (jpaged/models/fused.py: q, k, v as one, gate and up as one), and how
# many a step reads: 32 layers, the head once
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096), "head": (4096, 128256)}  # fmt: skip
COUNT = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}
FORMS = ("q4_0", "q4_k", "q6_k", "q5_k", "q5_0")
NARROW = {"q6_k": (6, False), "q5_k": (5, True), "q5_0": (5, False)}  # bits, affine


def parts(form: str, inp: int, out: int, rng: np.random.Generator) -> tuple[jax.Array, ...]:
    """Random codes and scales `[in, out]` held as `models.quant.held` holds `form`'s."""

    def scales(block: int, dtype: type = np.float16) -> np.ndarray:
        if dtype == np.int8:
            return rng.integers(-64, 64, (inp // block, out), dtype=np.int8)
        return rng.uniform(0.002, 0.01, (inp // block, out)).astype(dtype)

    held: tuple[np.ndarray, ...]
    if form == "q4_0":
        held = (rng.integers(0, 256, (inp // 2, out), dtype=np.uint8), scales(32))
    elif form == "q4_k":
        sub = (scales(32, np.int8), scales(32, np.int8), scales(256), scales(256))
        held = (rng.integers(0, 256, (inp // 2, out), dtype=np.uint8), *sub)
    elif form == "q6_k":
        held = (rng.integers(-32, 32, (inp, out), dtype=np.int8), scales(16, np.int8), scales(256))
    elif form == "q5_k":
        sub = (scales(32, np.int8), scales(32, np.int8), scales(256), scales(256))
        held = (rng.integers(0, 32, (inp, out), dtype=np.int8), *sub)
    elif form == "q5_0":
        held = (rng.integers(-16, 16, (inp, out), dtype=np.int8), scales(32))
    else:
        raise ValueError(f"--forms: {form!r} is not one of {FORMS}")
    return tuple(jnp.asarray(p) for p in held)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--forms", default="q4_0", help=f"comma-separated: {', '.join(FORMS)}")
    ap.add_argument("--tokens", default="1", help="comma-separated tokens a call")
    ap.add_argument("--cached", action="store_true", help="a 2048 x 2048 matrix, from cache")
    ap.add_argument(
        "--cpu", action="store_true", help="the process's CPU time, not wall (a shared machine)"
    )
    args = ap.parse_args(argv)
    clock = time.process_time if args.cpu else time.perf_counter
    assert qdot.available(), "no C++ compiler here"
    rng = np.random.default_rng(0)
    shapes = {"cached": (2048, 2048)} if args.cached else SHAPES
    names = list(shapes) if args.cached else args.shapes.split(",")
    rows, steps = [], []
    for form, name in itertools.product(args.forms.split(","), names):
        inp, out = shapes[name]
        w = parts(form, inp, out, rng)
        for int8, tokens in itertools.product((False, True), map(int, args.tokens.split(","))):
            x = jnp.asarray(rng.standard_normal((tokens, inp)), jnp.float32)
            f = jax.jit(lambda x, w, int8=int8: qdot.dot(x, w, None, int8, tiled=True))
            # as the loader lays them: in the kernels' order whatever the inputs (packed codes
            # `quant.tiled_takes`, narrow ones `quant.narrow_takes`)
            held = (qdot.tile(w[0]), *w[1:])
            if form in NARROW:
                held = (qdot.narrow(held[0], *NARROW[form]), *held[1:])
            nbytes = sum(p.size * p.dtype.itemsize for p in held)
            f(x, held).block_until_ready()
            best = float("inf")
            for _ in range(3):
                start = clock()
                for _ in range(args.reps):
                    y = f(x, held)
                y.block_until_ready()
                best = min(best, (clock() - start) / args.reps)
            kind = "int8" if int8 else "float"
            rows.append([form, f"{name} {inp}x{out}", str(tokens), kind,
                         f"{best * 1e3:.3f}", f"{nbytes / best / 1e9:.1f}"])  # fmt: skip
            print(" ".join(rows[-1]), flush=True)
            steps.append((form, tokens, kind, COUNT.get(name, 1) * best))
    print(render_table(["form", "matrix", "tokens", "inputs", "ms", "GB/s"], rows))
    if not args.cached and args.shapes == ",".join(SHAPES):
        for key in dict.fromkeys(step[:3] for step in steps):
            total = sum(step[3] for step in steps if step[:3] == key)
            print(f"a step's matmuls, {key[0]}, {key[1]} tokens, {key[2]}: {total * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
