"""`python -m benchmarks.bench_serving --decode-profile`: the engine's decode step alone."""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import build_engine, loadavg, machine_info, machine_line, render_table
from benchmarks.serving.configs import matched_configs
from jpaged.dtypes import DTYPE_NAMES, concrete_dtype


def decode_profile(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.bench_serving --decode-profile [--model M]`: the engine's
    decode step alone (`Runner.run` over sequences held in a paged cache), by rows and
    context length (`N` tokens per row, or `LO-HI` drawn per row). Context 16 (one page)
    separates the per-row cost of the matmuls from that of attention."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving --decode-profile")
    p.add_argument("--model", default="bench")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    p.add_argument("--batches", default="8,24,32,48")
    p.add_argument("--contexts", default="16,450,640,128-640", help="tokens per row")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    args.dtype = concrete_dtype(args.dtype)
    from benchmarks import bench_model
    from jpaged import models
    from jpaged.engine.contract import Row

    model = models.load(bench_model.resolve(args.model), dtype=args.dtype)
    cfg = matched_configs("paged", paged_batches=(48,), dtype=args.dtype)[0]
    engine = build_engine(model, cfg.engine_config())
    runner, cache = engine.runner, engine.cache
    rng = np.random.default_rng(0)
    table = []
    print(machine_line(machine_info()))
    for b in (int(x) for x in args.batches.split(",")):
        for spec in args.contexts.split(","):
            lo, _, hi = spec.partition("-")
            seqs = []
            for n in rng.integers(int(lo), int(hi or lo) + 1, b).tolist():
                seqs.append(cache.allocate_seq(n))
                cache.append(seqs[-1], n)
            rows = [Row(s, [1]) for s in seqs]
            shape = runner.run(rows).shape  # compiles
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                runner.run(rows)
                times.append(time.perf_counter() - t)
            for s in seqs:
                cache.free_seq(s)
            ms = 1e3 * float(np.median(times))
            table.append([str(b), spec, f"{shape.tokens} tokens", f"{ms:.1f}", f"{ms / b:.2f}"])
            print(" | ".join(table[-1]), flush=True)
    print(render_table(["rows", "context", "bucket", "ms/step (median)", "ms/row"], table))
    print(f"load average after: {loadavg():.2f}")
