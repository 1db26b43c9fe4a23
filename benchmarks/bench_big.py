"""A Llama-3.1-8B-shaped GGUF (random Q4_0 weights) on this machine: jpaged and llama.cpp's
load time, peak memory, decode tok/s at a few users and a long prompt's prefill tok/s.

    python -m benchmarks.bench_big --llama-server "$(../shared/peers/llama-server.sh)" --write

The file (~4.7 GB, written once into `--dir`) has Llama-3.1-8B's geometry: 32 layers,
hidden 4096, MLP 14336, 32 query and 8 KV heads of 128, a 128256-token vocabulary, every
matrix Q4_0 (the embedding and LM head too) and float32 norms; a byte-level BPE vocabulary
of fillers. Each engine runs as a server in its own process, started cold; load time is
until /health answers, peak memory is the process's VmHWM (peak resident set: file pages
it mapped and touched count too) read from /proc at the end, tok/s is `--users` users'
greedy completions of `--tokens` tokens each (ignore EOS), together, after a short warm-up
of the same shape (jpaged starts with `--no-warmup`: the warm-up compiles the programs the
timed requests run); prefill tok/s is a `--prefill`-token prompt's over the wall time of a
one-token completion (after a warm-up prompt of that length sharing no prefix with it):
llama.cpp's `pp512` when it is 512.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_peer import _free_port, run, serve
from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table
from benchmarks.workloads import WorkloadRequest

LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def _q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks `[rows, cols // 32 * 18]`: a float16 scale of a trained layer's
    size (~0.002-0.01) and 16 bytes of random nibbles each."""
    blocks = rng.integers(0, 256, (rows * cols // 32, 18), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.01, rows * cols // 32).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write(path: Path) -> None:
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    alphabet = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("i", "n")]
    tokens = SPECIALS + alphabet + ["".join(m) for m in merges]
    tokens += [f"<filler{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    q4 = gguf.GGMLQuantizationType.Q4_0
    kv = KV_HEADS * HEAD_DIM
    matrices = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    norms = ["output_norm.weight"]
    for i in range(LAYERS):
        b = f"blk.{i}."
        norms += [b + "attn_norm.weight", b + "ffn_norm.weight"]
        matrices |= {
            b + "attn_q.weight": (HIDDEN, HIDDEN),
            b + "attn_k.weight": (kv, HIDDEN),
            b + "attn_v.weight": (kv, HIDDEN),
            b + "attn_output.weight": (HIDDEN, HIDDEN),
            b + "ffn_gate.weight": (MLP, HIDDEN),
            b + "ffn_up.weight": (MLP, HIDDEN),
            b + "ffn_down.weight": (HIDDEN, MLP),
        }
    for name in norms:
        w.add_tensor_info(name, (HIDDEN,), np.dtype(np.float32), HIDDEN * 4)
    for name, (rows, cols) in matrices.items():
        w.add_tensor_info(
            name, (rows, cols // 32 * 18), np.dtype(np.uint8), rows * cols // 32 * 18, q4
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _ in norms:
        w.write_tensor_data(np.ones(HIDDEN, np.float32))
    for rows, cols in matrices.values():
        w.write_tensor_data(_q4_0(rows, cols, rng))
    w.close()


def peak_rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


def measure(
    name: str,
    cmd: list[str],
    port: int,
    tokens: int,
    users: list[int],
    prefill: int,
    env: dict | None = None,
) -> dict[str, float]:
    start = time.monotonic()
    with serve(name, cmd, port, env=env) as (url, proc):
        loaded = time.monotonic() - start
        out = {"load_s": loaded}
        for n in users:
            # each user its own prompt (no shared prefix), a short warm-up of the same shape
            # first: it compiles the programs the timed requests run
            prompts = [tuple(range(300 + 40 * u, 332 + 40 * u)) for u in range(n)]
            asyncio.run(run(url, [WorkloadRequest(q, 4, 0.0) for q in prompts], n))
            got, wall = asyncio.run(run(url, [WorkloadRequest(q, tokens, 0.0) for q in prompts], n))
            out[f"tok_s_{n}"] = got / wall
        if prefill:
            # one token after a `prefill`-token prompt; the warm-up prompt shares no prefix
            # with the timed one (both engines would reuse its cache)
            for first in (1000, 1000 + prefill):
                prompt = tuple(range(first, first + prefill))
                _, wall = asyncio.run(run(url, [WorkloadRequest(prompt, 1, 0.0)], 1))
            out["prefill_tok_s"] = prefill / wall
        out["peak_gb"] = peak_rss_gb(proc.pid)
    print(f"{name}: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--dir", default="/tmp", help="where the synthetic GGUF is kept")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens timed, each user")
    parser.add_argument("--users", default="1", help="decode tok/s at each number of users")
    parser.add_argument(
        "--prefill", type=int, default=0, help="also a prompt of this many tokens' tok/s (0: not)"
    )
    parser.add_argument(
        "--activations", default="float,int8", help="jpaged's --activations, each a run"
    )
    parser.add_argument(
        "--old-tree", help="also run jpaged from this checkout (an older commit's), first"
    )
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    users = [int(n) for n in args.users.split(",")]
    context = str(max(512, 2 * (args.prefill + args.tokens)))
    path = Path(args.dir) / "jpaged-llama-8b-q4_0.gguf"
    if not path.exists():
        start = time.monotonic()
        write(path.with_suffix(".partial"))
        path.with_suffix(".partial").rename(path)
        print(f"wrote {path} in {time.monotonic() - start:.0f} s", flush=True)
    size = path.stat().st_size / 1e9
    info = machine_info()
    print(machine_line(info), f"file {size:.2f} GB, load {loadavg():.2f}", flush=True)
    threads = str(os.cpu_count())
    results = {}
    trees = [("old ", args.old_tree)] if args.old_tree else []
    for (tree, root), activations in itertools.product(
        [*trees, ("", None)], args.activations.split(",")
    ):
        port = _free_port()
        # (-P: the old checkout's `server`, not the one in this directory)
        jp = [sys.executable, *(["-P"] if root else []), "-m", "server"]
        jp += [
            "--model",
            str(path),
            "--port",
            str(port),
            "--max-seq-len",
            context,
            "--max-batch-size",
            str(max(users)),
            "--log-level",
            "warning",
        ]
        # not every bucket of an 8B model: the warm-up request compiles what the timed one runs
        jp += ["--no-warmup", "--activations", activations]
        name = f"{tree}jpaged ({activations} inputs)"
        env = None if root is None else {"PYTHONPATH": root}
        results[name] = measure(name, jp, port, args.tokens, users, args.prefill, env)
    port = _free_port()
    # a slot a user, each with the context a jpaged sequence gets
    slots = ["-np", str(max(users)), "-c", str(int(context) * max(users))]
    peer = [args.llama_server, "-m", str(path), "-t", threads, *slots, "--port", str(port)]
    results["llama.cpp"] = measure("llama.cpp", peer, port, args.tokens, users, args.prefill)

    rows = [
        [
            k,
            f"{r['load_s']:.0f}",
            f"{r['peak_gb']:.2f}",
            f"{r['peak_gb'] / size:.2f}x",
            *(f"{r[f'tok_s_{n}']:.2f}" for n in users),
            *([f"{r['prefill_tok_s']:.1f}"] if args.prefill else []),
        ]
        for k, r in results.items()
    ]
    columns = ["engine", "load s", "peak RSS GB", "/ file"]
    columns += [f"tok/s (N = {n})" for n in users]
    columns += [f"prefill {args.prefill} tok/s"] if args.prefill else []
    table = render_table(columns, rows)
    print(table)
    if args.write:
        append_results(
            "## A Llama-3.1-8B-shaped Q4_0 GGUF on this machine (issue 36 item 4)",
            f"`python -m benchmarks.bench_big --tokens {args.tokens} --users {args.users} "
            f"--prefill {args.prefill} --activations {args.activations}"
            f"{' --old-tree ' + args.old_tree if args.old_tree else ''}`: "
            f"{path.name}, "
            f"{size:.2f} GB; {machine_line(info)}; load at the end {loadavg():.2f}.\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
