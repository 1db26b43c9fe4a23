"""The engine thread's serial path, on any CPU: a tiny random Llama's steady greedy decode.

    python -m benchmarks.host_path                               # 1, 64 and 256 rows
    python -m benchmarks.host_path --old-tree /tmp/old --write   # old and new, alternating
    python -m benchmarks.host_path --num-scheduler-steps 1,4     # one step a call, and four

The model (`random_weights.TINY`: 2 layers, hidden 64, a 512-word vocabulary and a word
tokenizer) costs the device next to nothing, so a step's wall time is the host's: the
engine's scheduling, batch building, launching and reading, and its outputs (detokenizing,
stop checks, the request outputs). For each N, N requests are prefilled and `--steps`
greedy decode steps timed twice: in process (`decode_pass`: `Engine.step` in
a loop, everything in one thread; the engine's counters split it: scheduling, batch
building, launching and reading, the rest: taking the tokens and the outputs), and served
(through the async front, as the server runs it: N streams, from each one's 8th token on).
Each tree runs in a process of its own (`-P` and PYTHONPATH: the old checkout's `jpaged`,
driven by this file's code), the trees taking turns `--repeats` times; the table keeps each figure's
best pass. `--num-scheduler-steps K1,K2`: each tree once with each (`EngineConfig.
num_scheduler_steps`: K decode steps a call), taking turns; the figures are a token's (an
engine step of K tokens a row counts K). `--http N`: N streaming clients over HTTP to each
tree's `python -m server` (the tests' tiny Llama; the clients run in this process, on the
same cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table

# each user's prompt: 16 to 31 tokens, so that the rows start their pages at different
# steps (a serving mix; equal prompts would cross their blocks together)
LENGTHS = list(range(16, 32))
PARTS = ("schedule_s", "build_s", "device_s")


def decode_pass(
    engine: Any,
    users: int,
    steps: int,
    seed: int,
    loras: list[str],
    prompt_tokens: int | Sequence[int],
    around: Callable[[], AbstractContextManager[Any]] = nullcontext,
    per_step: int = 1,
) -> dict[str, float]:
    """Prefill `users` requests of `prompt_tokens` tokens (a sequence: user i's is entry i
    modulo its length), then time `steps` decode steps (inside `around()`: a profiler's
    trace): wall per step and the engine's counters' growth over them. `per_step`: the
    tokens a row an engine step samples (`num_scheduler_steps`): the figures are then a
    token's, over `steps` engine steps."""
    from jpaged.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=(steps + 8) * per_step, temperature=0, ignore_eos=True)
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    for i in range(users):
        prompt = rng.integers(10, vocab, lengths[i % len(lengths)]).tolist()
        args, kwargs = _asking(prompt, params, loras[i % len(loras)] if loras else None)
        engine.add(engine.prepare(*args, **kwargs))
    started: set[str] = set()
    while len(started) < users:  # until every request is decoding
        started |= {o.request_id for o in engine.step() if o.token_ids}
    engine.step()  # one more: the calls in flight are decode calls only
    with around():
        before = engine.stats()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        after = engine.stats()
    while engine.has_unfinished():
        engine.step()
    tokens = steps * per_step
    out = {k: (after[k] - before[k]) / tokens for k in (*PARTS, "wait_s", "step_s", "compilations")}
    return out | {"wall_s": wall / tokens}


def _asking(prompt: list[int], params: Any, lora: str | None = None) -> tuple[tuple, dict]:
    """`prepare`'s and `generate`'s arguments: one `PromptRequest`, or, in a checkout from
    before the engine's interface (2026-12-07), the prompt and its parameters."""
    try:
        from jpaged.engine.interface import PromptRequest
    except ImportError:
        return (prompt, params), {"lora": lora} if lora else {}
    return (PromptRequest(prompt, params, lora=lora),), {}


def child(
    users: list[int], steps: int, per_call: int = 1, room: int = 1, process: bool = False
) -> dict[int, dict[str, float]]:
    """In this process's tree: each N's per-step seconds, stepped in process and served
    (`per_call`: num_scheduler_steps, set only where not 1: older trees lack it; `room`:
    the largest compared, which sizes max_seq_len, and with it the pool, alike; `process`:
    served by an engine core in a process of its own too, `served_process_s`)."""
    import dataclasses
    import functools

    from benchmarks.common import build_engine
    from benchmarks.random_weights import TINY, random_model
    from jpaged.config import EngineConfig
    from jpaged.engine import heap

    model = random_model(TINY, "float32")
    out = {}
    for n in users:
        config = EngineConfig(
            max_batch_size=n,
            max_seq_len=max(LENGTHS) + 3 * steps * room + 64,
            max_num_batched_tokens=max(n * max(LENGTHS), 64),
            dtype="float32",
        )
        if per_call != 1:
            config = dataclasses.replace(config, num_scheduler_steps=per_call)
        engine = build_engine(model, dataclasses.replace(config, warmup=False))
        # (compiles what the timed pass runs)
        decode_pass(engine, n, steps, 0, [], LENGTHS, per_step=per_call)
        with heap.settled():
            r = decode_pass(engine, n, steps, 1, [], LENGTHS, per_step=per_call)
            r["served_s"] = served(engine, n, steps)
        if process:  # (this tree's alone: an older one has none)
            from benchmarks.random_weights import tiny_model
            from jpaged.engine.core_client import CoreClient
            from jpaged.engine.core_process import Launch

            same = functools.partial(dataclasses.replace, config, warmup=False)
            client = CoreClient(Launch(tiny_model, same))
            try:
                served(client, n, steps)  # (compiles what the timed pass runs)
                r["served_process_s"] = served(client, n, steps)
            finally:
                client.close()
        out[n] = r
    return out


def served(engine: Any, users: int, steps: int) -> float:
    """Wall seconds a decode step through the async front (`AsyncEngine`, as the server
    runs it), as its streams see them: from every stream's 8th token to its (8 + steps)th."""
    import asyncio

    import numpy as np

    from jpaged.engine.async_engine import AsyncEngine
    from jpaged.engine.sampling import SamplingParams

    rng = np.random.default_rng(2)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    marks: dict[int, float] = {}
    received = [0]

    async def stream(aengine: AsyncEngine, prompt: list[int]) -> None:
        args, kwargs = _asking(prompt, params)
        async for o in aengine.generate(*args, **kwargs):
            received[0] += len(o.token_ids)
            for mark in (8 * users, (8 + steps) * users):
                if received[0] >= mark and mark not in marks:
                    marks[mark] = time.perf_counter()

    async def run() -> None:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            lengths = [LENGTHS[i % len(LENGTHS)] for i in range(users)]
            prompts = [rng.integers(10, vocab, n).tolist() for n in lengths]
            await asyncio.gather(*(stream(aengine, p) for p in prompts))
        finally:
            aengine.stop()

    asyncio.run(run())
    return (marks[(8 + steps) * users] - marks[8 * users]) / steps


def over_http(
    root: str | None, model: str, users: int, steps: int, flags: Sequence[str] = ()
) -> float:
    """Wall seconds a decode step over HTTP: `python -m server` of the checkout at `root`
    (None: this one) on `model`, `users` streaming completions from this process (httpx,
    one asyncio loop: on a small machine the clients share its cores), timed as `served`
    (a first pass compiles)."""
    import asyncio
    import tempfile
    from pathlib import Path

    import httpx

    from benchmarks.soak import launch

    context = max(LENGTHS) + 3 * steps + 64
    args = ["--max-batch-size", str(users), "--max-seq-len", str(context), "--no-warmup"]
    args += ["--max-num-batched-tokens", str(max(users * max(LENGTHS), 64)), *flags]
    body = {"max_tokens": steps + 16, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one_pass(url: str, seed: int) -> float:
        marks: dict[int, float] = {}
        received = [0]
        limits = httpx.Limits(max_connections=users + 8, max_keepalive_connections=users + 8)

        async def stream(ac: httpx.AsyncClient, i: int) -> None:
            n = LENGTHS[i % len(LENGTHS)]
            prompt = [10 + (seed * 7919 + i * 131 + k * 17) % 290 for k in range(n)]
            async with ac.stream("POST", "/v1/completions", json=body | {"prompt": prompt}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        received[0] += 1
                        for mark in (8 * users, (8 + steps) * users):
                            if received[0] >= mark and mark not in marks:
                                marks[mark] = time.perf_counter()

        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as ac:
            await asyncio.gather(*(stream(ac, i) for i in range(users)))
        return (marks[(8 + steps) * users] - marks[8 * users]) / steps

    with (
        tempfile.TemporaryDirectory() as tmp,
        launch(model, args, Path(tmp) / "log", root) as (
            _,
            url,
        ),
    ):
        asyncio.run(one_pass(url, 0))  # compiles what the timed pass runs
        return asyncio.run(one_pass(url, 1))


def run_tree(
    root: str | None,
    users: list[int],
    steps: int,
    per_call: int = 1,
    room: int = 1,
    process: bool = False,
) -> dict[int, dict[str, float]]:
    """`child` in a process of its own, on the checkout at `root` (None: this one)."""
    here = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root or os.path.dirname(here) + "/.."))
    # -P: the modules of PYTHONPATH's checkout, not of this file's folder
    cmd = [sys.executable, "-P", here, f"--child={','.join(map(str, users))}", f"--steps={steps}"]
    cmd += [f"--num-scheduler-steps={per_call}", f"--room={room}"]
    cmd += ["--engine-process"] if process else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    last = done.stdout.strip().splitlines()[-1]
    return {int(k): v for k, v in json.loads(last).items()}


def best(passes: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Each N's pass with the least wall time in process, and the least served (each way)."""
    served = [k for k in ("served_s", "served_process_s") if k in passes[0][next(iter(passes[0]))]]
    return {
        n: min((p[n] for p in passes), key=lambda r: r["wall_s"])
        | {k: min(p[n][k] for p in passes) for k in served}
        for n in passes[0]
    }


def rows_of(tree: str, results: dict[int, dict[str, float]]) -> list[list[str]]:
    rows = []
    for n, r in results.items():
        wall, parts = r["wall_s"], [r[k] for k in PARTS]
        rows.append(
            [
                tree,
                str(n),
                f"{1e3 * wall:.3f}",
                f"{1e6 * wall / n:.1f}",
                *(f"{1e3 * p:.3f}" for p in parts),
                f"{1e3 * (wall - sum(parts)):.3f}",
                f"{1e3 * r['served_s']:.3f}",
                f"{1e6 * r['served_s'] / n:.1f}",
                *(
                    [f"{1e3 * r['served_process_s']:.3f}", f"{1e6 * r['served_process_s'] / n:.1f}"]
                    if "served_process_s" in r
                    else []
                ),
            ]
        )
    return rows


def http_table(
    trees: list[tuple[str, str | None, tuple[str, ...]]], users: int, steps: int, repeats: int
) -> str:
    """Each tree's best of `repeats` passes over HTTP (the trees taking turns), each with
    its server flags."""
    import tempfile
    from pathlib import Path

    from benchmarks.soak import tiny_model

    walls: dict[str, list[float]] = {name: [] for name, _, _ in trees}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp)))
        for _ in range(repeats):
            for name, root, flags in trees:
                walls[name].append(over_http(root, model, users, steps, flags))
                print(name, "over HTTP ms a step", round(1e3 * walls[name][-1], 3), flush=True)
    rows = [
        [name, str(users), f"{1e3 * min(w):.3f}", f"{users / min(w):,.0f}"]
        for name, w in walls.items()
    ]
    head = ["tree", "streams over HTTP", "ms/step", "output tok/s"]
    return render_table(head, rows)


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--users", default="1,64,256", help="comma-separated N (rows a step)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed a pass")
    p.add_argument("--repeats", type=int, default=2, help="passes a tree (trees alternate)")
    p.add_argument("--old-tree", help="also run this checkout (an older commit's), first")
    p.add_argument(
        "--http", type=int, default=0, help="also N streams over HTTP (the tests' tiny Llama)"
    )
    p.add_argument(
        "--num-scheduler-steps",
        default="1",
        help="comma-separated K: each tree with each (EngineConfig.num_scheduler_steps)",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="this tree served by an engine core in a process of its own too (and over HTTP)",
    )
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--room", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child(
            [int(n) for n in args.child.split(",")],
            args.steps,
            int(args.num_scheduler_steps),
            args.room,
            args.engine_process,
        )
        print(json.dumps(result))
        return []
    users = [int(n) for n in args.users.split(",")]
    info = machine_info()
    print(machine_line(info), f"load {loadavg():.2f}", flush=True)
    trees: list[tuple[str, str | None]] = [("old", args.old_tree)] if args.old_tree else []
    trees.append(("new" if args.old_tree else "this", None))
    per_call = [int(k) for k in args.num_scheduler_steps.split(",")]
    runs = [  # (an old checkout runs the first K alone: the others may be newer than it)
        (name if per_call == [1] else f"{name} k={k}", root, k)
        for name, root in trees
        for k in (per_call if root is None else per_call[:1])
    ]
    passes: dict[str, list[dict[int, dict[str, float]]]] = {name: [] for name, _, _ in runs}
    for _ in range(args.repeats):
        for name, root, k in runs:
            process = args.engine_process and root is None
            passes[name].append(run_tree(root, users, args.steps, k, max(per_call), process))
            walls = {n: round(r["wall_s"] * 1e3, 3) for n, r in passes[name][-1].items()}
            print(name, "ms a step", json.dumps(walls), flush=True)
    rows = [row for name, _, _ in runs for row in rows_of(name, best(passes[name]))]
    head = ["tree", "rows", "in process ms/step", "us/row", "schedule ms", "build ms",
            "launch + read ms", "the rest ms", "served ms/step", "served us/row"]  # fmt: skip
    if args.engine_process:  # (an old tree has no engine process: its cells stay empty)
        head += ["engine process: served ms/step", "us/row"]
        rows = [row + [""] * (len(head) - len(row)) for row in rows]
    table = render_table(head, rows)
    title = (
        f"tiny random Llama (2 layers, hidden 64, float32), "
        f"{min(LENGTHS)}-{max(LENGTHS)}-token prompts, "
        f"{args.steps} greedy decode steps a pass, best of {args.repeats} passes a tree "
        f"(trees alternating); load {loadavg():.2f} at the end"
    )
    print(f"\n{title}\n\n{table}")
    served_by: list[tuple[str, str | None, tuple[str, ...]]] = [(n, r, ()) for n, r in trees]
    if args.engine_process:
        served_by.append((f"{trees[-1][0]}, engine process", None, ("--engine-process",)))
    http = http_table(served_by, args.http, args.steps, args.repeats) if args.http else ""
    if http:
        print(f"\n{http}")
    if args.write:
        command = (
            f"`python -m benchmarks.host_path --users {args.users} --steps {args.steps} "
            f"--repeats {args.repeats}{' --old-tree ' + args.old_tree if args.old_tree else ''}"
            f"{f' --num-scheduler-steps {args.num_scheduler_steps}' if per_call != [1] else ''}"
            f"{f' --http {args.http}' if args.http else ''}"
            f"{' --engine-process' if args.engine_process else ''}`"
        )
        text = f"{command}; {machine_line(info)}\n\n{title}\n\n{table}\n"
        if http:
            text += f"\nOver HTTP (the tests' tiny Llama, its 320-token vocabulary):\n\n{http}\n"
        append_results("## The engine thread's host path (issue 79)", text)
    return rows


if __name__ == "__main__":
    main()
