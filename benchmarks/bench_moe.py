"""A mixture-of-experts block's ways of computing its experts (`models.moe.experts`), at 1 to
64 tokens.

    python -m benchmarks.bench_moe [--experts 64] [--top-k 8] [--hidden 512]
                                   [--intermediate 256] [--layers 4] [--tokens 1,4,16,64]
                                   [--dtype float32] [--repeats 20]

A stack of `--layers` MoE blocks (router, E SwiGLU experts, the weights held whole and
read at the layer's index, as the step's scan reads them), random weights and inputs, run
through each way:

- `dense`: every expert on every token, the outputs weighted (reads every expert)
- `gather`: each token's k experts' weights gathered by id, then dotted a pair (the routed ones)
- `grouped`: the (token, expert) pairs sorted by expert into tiles of `moe.TILE` rows, a
  tile one expert's weights (reads each used expert once a tile)

Each cell: milliseconds per call of the whole stack, the minimum over repeats, the ways
interleaved (the machine is shared: the load average is printed with the table).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.models import moe
from jpaged.models.config import MoEConfig

WAYS = ("dense", "gather", "grouped")


def build(args: argparse.Namespace) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    e, h, i, n = args.experts, args.hidden, args.intermediate, args.layers
    dtype = jnp.dtype(args.dtype)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / shape[-2] ** 0.5, dtype)

    return normal(n, e, h), normal(n, e, h, i), normal(n, e, h, i), normal(n, e, i, h)


def stack(x: jax.Array, weights: tuple[jax.Array, ...], m: MoEConfig, way: str) -> jax.Array:
    router, gate, up, down = weights

    def body(x: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
        w, ids = moe.route(x, router[layer], m)
        read = functools.partial(moe.take, layer=layer, dtype=x.dtype)
        act = functools.partial(moe.activation, "silu")
        y = moe.experts(x, w, ids, (gate, up, down), read, act, m.num_experts, way)
        return x + y, None

    out, _ = lax.scan(body, x, jnp.arange(router.shape[0]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    m = MoEConfig(args.experts, args.top_k, args.intermediate, norm_topk_prob=True)
    weights = build(args)
    nbytes = sum(w.nbytes for w in weights[1:])
    per = nbytes / args.experts
    print(
        f"{args.layers} layers x {args.experts} experts (top-{args.top_k}), hidden "
        f"{args.hidden}, intermediate {args.intermediate}, {args.dtype}: experts "
        f"{nbytes / 1e6:.0f} MB, a token's routed {per * args.top_k / 1e6:.1f} MB; "
        f"{jax.default_backend()}, load {os.getloadavg()[0]:.2f}"
    )
    print(
        "| tokens | "
        + " | ".join(f"{w} ms" for w in WAYS)
        + " | dense / gather | dense / grouped |"
    )
    print("| ---: | " + " | ".join("---:" for _ in WAYS) + " | ---: | ---: |")
    for t in (int(v) for v in args.tokens.split(",")):
        x = jnp.asarray(np.random.default_rng(t).normal(size=(t, args.hidden)), args.dtype)
        fns = {w: jax.jit(functools.partial(stack, m=m, way=w)) for w in WAYS}
        outs = {w: np.asarray(f(x, weights), np.float32) for w, f in fns.items()}
        for w in WAYS[1:]:
            np.testing.assert_allclose(outs[w], outs["dense"], rtol=2e-3, atol=2e-3)
        best = dict.fromkeys(WAYS, float("inf"))
        for _ in range(args.repeats):
            for w, f in fns.items():
                start = time.perf_counter()
                f(x, weights).block_until_ready()
                best[w] = min(best[w], time.perf_counter() - start)
        ms = {w: 1e3 * s for w, s in best.items()}
        cells = " | ".join(f"{ms[w]:.2f}" for w in WAYS)
        ratio = f"{ms['dense'] / ms['gather']:.1f}x | {ms['dense'] / ms['grouped']:.1f}x"
        print(f"| {t} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
