"""Model load time / peak host memory and jitted decode-step time, per family.

    python -m benchmarks.bench_models [--out results.md]

Uses the tiny random checkpoints of the test suite (built with transformers, so the
dev extra must be installed). Each load runs in a fresh subprocess so its peak RSS is
the loader's, not the checkpoint builder's. Decode steps are timed after a warm-up
(compilation excluded), blocking on each step's logits as an engine loop would. The
last column repeats batch 8 over a 16x larger pool: it stays flat only when the pool is
updated in place (on CPU, XLA turns each bfloat16 pool write into a float32 round trip
of the whole pool, so bfloat16 grows with the pool and float32 does not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FAMILIES = ("llama", "qwen3", "gemma3")
BATCHES = (1, 8, 32)
DTYPES = ("bfloat16", "float32")
CONTEXT, BLOCK = 128, 16  # tokens per sequence, block size
WARMUP, ITERS = 3, 30


def _status_mb(field: str) -> float:
    # Not ru_maxrss: that survives exec, so a child would report its parent's peak.
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def measure_load(path: str) -> dict:
    """Runs in the child: time the first load (incl. importing transformers' tokenizer
    and starting the JAX backend), then a second one, and report peak RSS."""
    from jpaged import models

    before = _status_mb("VmRSS")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model = models.load(path, dtype="bfloat16")
        jax.block_until_ready(nnx.state(model.model))
        times.append(time.perf_counter() - start)
    peak = _status_mb("VmHWM")
    return {"first_s": times[0], "again_s": times[1], "peak_rss_mb": peak, "rss_before_mb": before}


def decode_step_ms(path: str, dtype: str, batch: int, pool_factor: int = 1) -> float:
    from jpaged import models
    from jpaged.cache import kv_pool
    from jpaged.kernels import ragged_plan

    model = models.load(path, dtype=dtype)
    c = model.config
    pages = CONTEXT // BLOCK
    num_blocks = (batch * pages + 1) * pool_factor
    kv = kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        num_blocks=num_blocks,
        dtype=dtype,
    )
    tables = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    meta = ragged_plan.plan(
        np.ones(batch, np.int32),
        np.full(batch, CONTEXT),
        tables,
        num_tokens=batch,
        num_seqs=batch,
        width=pages,
        block_size=BLOCK,
        impl="xla",
    )
    meta = jax.device_put(meta)
    tokens = jnp.ones(batch, jnp.int32)
    last = jnp.arange(batch, dtype=jnp.int32)
    step = jax.jit(models.forward, static_argnames=("attention_impl",), donate_argnums=2)
    graphdef, state = nnx.split(model.model)
    for _ in range(WARMUP):
        logits, kv = step(graphdef, state, kv, tokens, meta, last)
        logits.block_until_ready()
    start = time.perf_counter()
    for _ in range(ITERS):
        logits, kv = step(graphdef, state, kv, tokens, meta, last)
        logits.block_until_ready()
    return (time.perf_counter() - start) / ITERS * 1e3


def build_checkpoints(root: Path) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location(
        "jpaged_test_conftest", Path(__file__).parents[1] / "tests" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return {f: conftest.build_tiny_checkpoint(f, root / f) for f in FAMILIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--load-only", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.load_only:
        print(json.dumps(measure_load(args.load_only)))
        return

    loads, decodes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_checkpoints(Path(tmp))
        for family, path in paths.items():
            child = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_models", "--load-only", str(path)],
                capture_output=True,
                text=True,
                check=True,
            )
            load = json.loads(child.stdout.strip().splitlines()[-1])
            loads.append((family, load))
            for dtype in DTYPES:
                steps = [decode_step_ms(str(path), dtype, b) for b in BATCHES]
                steps.append(decode_step_ms(str(path), dtype, 8, pool_factor=16))
                decodes.append((family, dtype, steps))
                print(family, dtype, load, steps, file=sys.stderr)

    lines = [
        "| family | first load (s) | load again (s) | peak RSS (MB) | RSS before load (MB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family, load in loads:
        lines.append(
            f"| {family} | {load['first_s']:.3f} | {load['again_s']:.3f} | "
            f"{load['peak_rss_mb']:.0f} | {load['rss_before_mb']:.0f} |"
        )
    lines += [
        "",
        "| family | dtype | "
        + " | ".join(f"ms/step B={b}" for b in BATCHES)
        + " | ms/step B=8, 16x pool |",
        "| --- | --- |" + " --- |" * (len(BATCHES) + 1),
    ]
    for family, dtype, steps in decodes:
        lines.append(f"| {family} | {dtype} | " + " | ".join(f"{s:.2f}" for s in steps) + " |")
    device = jax.devices()[0]
    lines.append(
        f"\n{device.platform} ({device.device_kind}); decode: context {CONTEXT} tokens per "
        f"row, block size {BLOCK}, {ITERS} timed steps after {WARMUP} warm-up steps."
    )
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
