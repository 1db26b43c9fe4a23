"""The step's matmuls on weights held float, int8 or fp8 (one scale per output channel,
`quantization="int8"` / `"fp8"`), through `models.quant.dot` inside a scan over layers.

    python -m benchmarks.bench_weights                      # Llama-3.2-1B's shape, 16 layers
    python -m benchmarks.bench_weights --layers 2 --tokens 1,4 --no-write

Each cell: milliseconds per call of the whole stack (q, k, v, o, gate, up, down of every
layer), the minimum over `--repeats`, and the weight bytes read per second at that time.
"converted apart" says whether XLA's optimized program holds a whole matrix converted to
the compute dtype (the convert left outside the dot: as many bytes again written and read)
rather than converting inside the dot's fusion; "max error vs float": the first layer's
output's largest difference from the float weights' relative to its largest value (the
codes' rounding; a stack of random layers amplifies it, a real model's norms do not).
On a GPU this is where int8 / fp8 weights pay or not: a decode step at few users reads
every weight once.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import append_results, machine_info, machine_line, render_table
from jpaged.models import quant
from jpaged.models.gguf_blocks import requantize

FORMS = ("float", "int8", "fp8")


def shapes(hidden: int, inter: int, kv: int) -> dict[str, tuple[int, int]]:
    """[in, out] of each matrix of a layer."""
    return {"q": (hidden, hidden), "k": (hidden, kv), "v": (hidden, kv), "o": (hidden, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}  # fmt: skip


def _stack(
    form: str, sizes: dict[str, tuple[int, int]], layers: int, dtype: Any, seed: int
) -> dict[str, tuple]:
    """Each matrix of `layers` layers as `quant.arrays` gives it: the float weight, or codes
    `[layers, in, out]` and a scale `[layers, 1, out]` (the same values for every form)."""
    rng = np.random.default_rng(seed)
    out: dict[str, tuple] = {}
    for name, (i, o) in sizes.items():
        w = (rng.standard_normal((i, o), np.float32) * 0.02).astype(np.float32)
        if form == "float":
            out[name] = (jnp.asarray(np.broadcast_to(w, (layers, i, o)), dtype),)
            continue
        b = requantize(w.T, i, fp8=form == "fp8")  # blocks along `in`, as the loader's
        b = b._replace(codes=b.codes.T, scale=b.scale.T)
        out[name] = tuple(jnp.asarray(np.broadcast_to(a, (layers, *a.shape))) for a in b[:2])
    return out


def _run(x: jax.Array, stack: dict[str, tuple], dtype: Any) -> jax.Array:
    def layer(h: jax.Array, w: dict[str, tuple]) -> tuple[jax.Array, None]:
        def mm(v: jax.Array, name: str) -> jax.Array:
            return quant.dot(v, w[name], dtype)

        h = h * lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)  # as a norm would
        kv = mm(h, "k") + mm(h, "v")
        a = mm(h, "q") + jnp.tile(kv, h.shape[-1] // kv.shape[-1])
        h = h + mm(a, "o")
        return h + mm(jax.nn.silu(mm(h, "gate")) * mm(h, "up"), "down"), None

    return lax.scan(layer, x, stack)[0]


def _converted_apart(hlo: str, sizes: dict[str, tuple[int, int]], dtype: Any) -> bool:
    """Whether an optimized program's instruction outputs a whole matrix in `dtype`."""
    name = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[jnp.dtype(dtype)]
    whole = {f"{name}[{i},{o}]" for i, o in sizes.values()}
    return any(re.search(rf"= {re.escape(s)}\{{", hlo) for s in whole)


def measure(
    sizes: dict[str, tuple[int, int]],
    layers: int,
    tokens: list[int],
    repeats: int,
    dtype: Any,
    hlo_dir: Path | None = None,
) -> list[list[str]]:
    """One row per form and token count: ms per stack, weight GB/s, converted apart, and
    the largest difference from the float weights' output relative to its largest value;
    each form's optimized program at the first token count written to `hlo_dir` if given."""
    rows: list[list[str]] = []
    ref: dict[int, np.ndarray] = {}
    hidden = sizes["q"][0]
    for form in FORMS:
        stack = _stack(form, sizes, layers, dtype, seed=0)
        nbytes = sum(a.nbytes for parts in stack.values() for a in parts)
        run = jax.jit(_run, static_argnums=2)
        for t in tokens:
            x = jnp.asarray(np.random.default_rng(t).standard_normal((t, hidden)), dtype)
            hlo = run.lower(x, stack, dtype).compile().as_text() or ""
            if hlo_dir is not None and t == tokens[0]:
                (hlo_dir / f"bench_weights_{form}_{t}.txt").write_text(hlo)
            # one layer's output: a stack of random layers amplifies any difference
            first = jax.tree.map(lambda a: a[:1], stack)
            y = np.asarray(run(x, first, dtype).astype(jnp.float32))
            ref.setdefault(t, y)
            err = np.abs(y - ref[t]).max() / max(np.abs(ref[t]).max(), 1e-30)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                run(x, stack, dtype).block_until_ready()
                best = min(best, time.perf_counter() - start)
            apart = "n/a" if form == "float" else str(_converted_apart(hlo, sizes, dtype))
            rows.append([
                form, str(t), f"{nbytes / 1e6:.0f}", f"{1e3 * best:.3f}",
                f"{nbytes / best / 1e9:.0f}", apart.lower(), f"{err:.1e}",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--shape", default="2048,8192,512", help="hidden,intermediate,kv width")
    p.add_argument("--tokens", default="1,4,64,256", help="comma-separated tokens a call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on a GPU)")
    p.add_argument("--hlo", type=Path, help="write each form's program (first token count) here")
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md untouched")
    args = p.parse_args(argv)
    from jpaged.dtypes import concrete_dtype, resolve_dtype

    dtype = resolve_dtype(concrete_dtype(args.dtype))
    info = machine_info()
    print(machine_line(info))
    tokens = [int(t) for t in args.tokens.split(",")]
    hidden, inter, kv = (int(v) for v in args.shape.split(","))
    rows = measure(shapes(hidden, inter, kv), args.layers, tokens, args.repeats, dtype, args.hlo)
    head = ["weights", "tokens", "weight MB", "ms / stack", "weight GB/s", "converted apart",
            "max error vs float"]  # fmt: skip
    title = (
        f"a stack of {args.layers} layers (hidden, intermediate, KV width {args.shape}; "
        f"Llama-3.2-1B's by default), compute dtype {dtype.name}, "
        f"device {jax.devices()[0].device_kind}; best of {args.repeats}"
    )
    table = render_table(head, rows)
    print(f"\n{title}\n\n{table}")
    if not args.no_write:
        append_results(
            "## Weights held int8 / fp8 on the step's matmuls (issue 36)",
            f"{machine_line(info)}\n\n{title}\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
