"""The CPU quantized-matmul kernels (models/qdot.cc) alone at Llama-3.1-8B's shapes, one
token, packed 4-bit codes (Q4_0's form): ms a call and GB/s of weights read (codes and
float32 scales), float and int8 activations. One thread: run under `taskset -c 0`.

    python -m benchmarks.bench_qdot8b [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import qdot

SHAPES = {"qkvo 4096x4096": (4096, 4096), "gate/up 4096x14336": (4096, 14336),
          "down 14336x4096": (14336, 4096), "head 4096x128256": (4096, 128256)}  # fmt: skip


def parts(inp: int, out: int, rng: np.random.Generator) -> tuple[jax.Array, ...]:
    codes = rng.integers(0, 256, (inp // 2, out), dtype=np.uint8)
    scale = rng.uniform(0.002, 0.01, (inp // 32, out)).astype(np.float32)
    return jnp.asarray(codes), jnp.asarray(scale)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    assert qdot.available(), "no C++ compiler here"
    rng = np.random.default_rng(0)
    for name in args.shapes.split(","):
        inp, out = SHAPES[name]
        w = parts(inp, out, rng)
        nbytes = sum(p.size * p.dtype.itemsize for p in w)
        x = jnp.asarray(rng.standard_normal((1, inp)), jnp.float32)
        for int8 in (False, True):
            f = jax.jit(lambda x, w, int8=int8: qdot.dot(x, w, None, int8))
            f(x, w).block_until_ready()
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(args.reps):
                    y = f(x, w)
                y.block_until_ready()
                best = min(best, (time.perf_counter() - start) / args.reps)
            kind = "int8" if int8 else "float"
            print(f"{name:20s} {kind:5s} {best * 1e3:7.2f} ms {nbytes / best / 1e9:6.1f} GB/s",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
