"""The CPU quantized-matmul kernels (models/qdot.cc) alone at Llama-3.1-8B's shapes, one
token, packed 4-bit codes (Q4_0's form): ms a call and GB/s of weights read (codes and
float32 scales), float and int8 activations, and their sum over a decode step's
matrices. One thread: run under `taskset -c 0`; on a shared machine `--cpu` (CPU time:
threads waiting on others count, so one thread).

    python -m benchmarks.bench_qdot8b [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import qdot

# the decode step's matrices (models/fused.py: q, k, v as one, gate and up as one), and how
# many a step reads: 32 layers, the head once
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096), "head": (4096, 128256)}  # fmt: skip
COUNT = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}


def parts(inp: int, out: int, rng: np.random.Generator) -> tuple[jax.Array, ...]:
    codes = rng.integers(0, 256, (inp // 2, out), dtype=np.uint8)
    scale = rng.uniform(0.002, 0.01, (inp // 32, out)).astype(np.float32)
    return jnp.asarray(codes), jnp.asarray(scale)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--cpu", action="store_true", help="the process's CPU time, not wall (a shared machine)"
    )
    args = ap.parse_args(argv)
    clock = time.process_time if args.cpu else time.perf_counter
    assert qdot.available(), "no C++ compiler here"
    rng = np.random.default_rng(0)
    step = {False: 0.0, True: 0.0}
    for name in args.shapes.split(","):
        inp, out = SHAPES[name]
        w = parts(inp, out, rng)
        nbytes = sum(p.size * p.dtype.itemsize for p in w)
        x = jnp.asarray(rng.standard_normal((1, inp)), jnp.float32)
        for int8 in (False, True):
            f = jax.jit(lambda x, w, int8=int8: qdot.dot(x, w, None, int8))
            if int8:  # the codes as `quant.round_inputs` lays them
                w = (qdot.tile(w[0]), *w[1:])
            f(x, w).block_until_ready()
            best = float("inf")
            for _ in range(3):
                start = clock()
                for _ in range(args.reps):
                    y = f(x, w)
                y.block_until_ready()
                best = min(best, (clock() - start) / args.reps)
            step[int8] += COUNT[name] * best
            kind = "int8" if int8 else "float"
            print(f"{name:8s} {inp}x{out:<7d} {kind:5s} {best * 1e3:7.2f} ms "
                  f"{nbytes / best / 1e9:5.1f} GB/s", flush=True)  # fmt: skip
    if args.shapes == ",".join(SHAPES):
        for int8, total in step.items():
            print(f"a step's matmuls ({'int8' if int8 else 'float'}): {total * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
