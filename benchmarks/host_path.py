"""The engine thread's serial path, on any CPU: a tiny random Llama's steady greedy decode.

    python -m benchmarks.host_path                               # 1, 64 and 256 rows
    python -m benchmarks.host_path --old-tree /tmp/old --write   # old and new, alternating

The model (`gpu_check.TINY`: 2 layers, hidden 64, a 512-word vocabulary and a word
tokenizer) costs the device next to nothing, so a step's wall time is the host's: the
engine's scheduling, batch building, launching and reading, and its outputs (detokenizing,
stop checks, the request outputs). For each N, N requests are prefilled and `--steps`
decode steps timed in process (`profile_step.decode_pass`), each tree in a process of its
own (`-P` and PYTHONPATH: the old checkout's `jpaged` and `benchmarks`), the trees taking
turns `--repeats` times; the table keeps each figure's best pass. Columns: wall time a
step and a row, the engine's host time a step (`step_s - device_s`) and its split.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table

PROMPT_TOKENS = 16
PARTS = ("schedule_s", "build_s", "device_s", "outputs_s")


def child(users: list[int], steps: int) -> dict[int, dict[str, float]]:
    """In this process's tree: each N's per-step seconds."""
    import dataclasses

    from benchmarks import gpu_check, profile_step
    from benchmarks.common import build_engine
    from jpaged.config import EngineConfig
    from jpaged.engine import heap

    model = gpu_check.random_model(gpu_check.TINY, "float32")
    out = {}
    for n in users:
        config = EngineConfig(
            max_batch_size=n,
            max_seq_len=PROMPT_TOKENS + 2 * steps + 64,
            max_num_batched_tokens=max(n * PROMPT_TOKENS, 64),
            dtype="float32",
        )
        engine = build_engine(model, dataclasses.replace(config, warmup=False))
        decode = profile_step.decode_pass
        decode(engine, n, steps, 0, [], PROMPT_TOKENS)  # compiles what the timed pass runs
        with heap.settled():
            r = decode(engine, n, steps, 1, [], PROMPT_TOKENS)
        r["outputs_s"] = r["step_s"] - r["schedule_s"] - r["build_s"] - r["device_s"]
        out[n] = r
    return out


def run_tree(root: str | None, users: list[int], steps: int) -> dict[int, dict[str, float]]:
    """`child` in a process of its own, on the checkout at `root` (None: this one)."""
    here = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root or os.path.dirname(here) + "/.."))
    # -P: the modules of PYTHONPATH's checkout, not of this file's folder
    cmd = [sys.executable, "-P", here, f"--child={','.join(map(str, users))}", f"--steps={steps}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    last = done.stdout.strip().splitlines()[-1]
    return {int(k): v for k, v in json.loads(last).items()}


def best(passes: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Each N's pass with the least wall time."""
    return {n: min((p[n] for p in passes), key=lambda r: r["wall_s"]) for n in passes[0]}


def rows_of(tree: str, results: dict[int, dict[str, float]]) -> list[list[str]]:
    rows = []
    for n, r in results.items():
        wall, host = r["wall_s"], r["step_s"] - r["device_s"]
        rows.append(
            [
                tree,
                str(n),
                f"{1e3 * wall:.3f}",
                f"{1e6 * wall / n:.1f}",
                f"{1e3 * host:.3f}",
                *(f"{1e3 * r[k]:.3f}" for k in PARTS),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--users", default="1,64,256", help="comma-separated N (rows a step)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed a pass")
    p.add_argument("--repeats", type=int, default=2, help="passes a tree (trees alternate)")
    p.add_argument("--old-tree", help="also run this checkout (an older commit's), first")
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child([int(n) for n in args.child.split(",")], args.steps)
        print(json.dumps(result))
        return []
    users = [int(n) for n in args.users.split(",")]
    info = machine_info()
    print(machine_line(info), f"load {loadavg():.2f}", flush=True)
    trees: list[tuple[str, str | None]] = [("old", args.old_tree)] if args.old_tree else []
    trees.append(("new" if args.old_tree else "this", None))
    passes: dict[str, list[dict[int, dict[str, float]]]] = {name: [] for name, _ in trees}
    for _ in range(args.repeats):
        for name, root in trees:
            passes[name].append(run_tree(root, users, args.steps))
            walls = {n: round(r["wall_s"] * 1e3, 3) for n, r in passes[name][-1].items()}
            print(name, "ms a step", json.dumps(walls), flush=True)
    rows = [row for name, _ in trees for row in rows_of(name, best(passes[name]))]
    head = ["tree", "rows", "wall ms/step", "wall us/row", "host ms/step", "schedule ms",
            "build ms", "launch + read ms", "outputs ms"]  # fmt: skip
    table = render_table(head, rows)
    title = (
        f"tiny random Llama (2 layers, hidden 64, float32), {PROMPT_TOKENS}-token prompts, "
        f"{args.steps} greedy decode steps a pass, best of {args.repeats} passes a tree "
        f"(trees alternating); load {loadavg():.2f} at the end"
    )
    print(f"\n{title}\n\n{table}")
    if args.write:
        command = f"`python -m benchmarks.host_path --users {args.users} --steps {args.steps}`"
        append_results(
            "## The engine thread's host path (issue 79)",
            f"{command}; {machine_line(info)}\n\n{title}\n\n{table}\n",
        )
    return rows


if __name__ == "__main__":
    main()
