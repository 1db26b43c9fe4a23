"""Llama-shaped GGUFs of real geometry (random weights) on this machine: jpaged's and
llama.cpp's load time, peak memory, decode tok/s at a few users, time to the first token and
a long prompt's prefill tok/s.

    python -m benchmarks.bench_big --llama-server "$(../shared/peers/llama-server.sh)" \
        --models 1b-q4_0,3b-q4_0,8b-q4_0,8b-q4_k_m --write

Each file (written once into `--dir`, 0.8-4.9 GB) has a Llama's geometry (`SHAPES`:
Llama-3.2-1B, Llama-3.2-3B, both tied, and Llama-3.1-8B), float32 norms and a byte-level
BPE vocabulary of fillers; its matrices are `q4_0`: every one Q4_0 (the embedding and LM
head too), or `q4_k_m`: llama.cpp's Q4_K_M mix, Q4_K but for Q6_K in the LM head (the tied
embedding), and in V and the FFN's down projection of the first and last eighth of the
layers and every third between (llama.cpp's `use_more_bits`), or `q5_k_m`: the same with
Q5_K for Q4_K. Blocks hold random codes and
scales of a trained layer's size (the speed does not depend on the values). Each engine runs
as a server in its own process, started cold after the file was read once through the page
cache (a VM that reclaims it would have the first engine read the disk); load time is until
/health answers, peak memory the process's VmHWM (peak resident set: file pages it mapped
and touched count too) read from /proc at the end. At each of `--users` N, after a warm-up
of the same shape (jpaged starts with `--no-warmup`: the warm-up compiles the programs the
timed requests run), N users send fresh 32-token prompts together (no prefix either engine
has cached), for one token (time to the first token: its wall) and for `--tokens` tokens
(greedy, EOS ignored), the best of `PASSES` passes each (a single pass of four users moved
10x: the requests' arrival varies which steps their prompts share): decode tok/s is the N x
(tokens - 1) more tokens over the wall time they added, the prompts' work taken out as
llama.cpp's `tg` leaves it out. Prefill tok/s is a `--prefill`-token prompt's over the wall
time of a one-token completion (after a warm-up prompt of that length sharing no prefix with
it): llama.cpp's `pp512` when it is 512. `--settle S`: each server idles S seconds after
/health first (jpaged's on a CPU moves its weights into huge pages while idle:
`models.hugepages`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from benchmarks.bench_peer import _free_port, run, serve
from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table
from benchmarks.workloads import WorkloadRequest

PASSES = 3  # timed passes of each kind at each number of users: the best counts


class Shape(NamedTuple):
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    vocab: int = 128256
    experts: int = 0  # a mixture's (qwen3moe): its experts, those a token uses, their FFN
    used: int = 0
    expert_mlp: int = 0


SHAPES = {
    "1b": Shape(16, 2048, 8192, 32, 8, 64, tied=True),
    "3b": Shape(28, 3072, 8192, 24, 8, 128, tied=True),
    "8b": Shape(32, 4096, 14336, 32, 8, 128, tied=False),
    # Qwen3-30B-A3B's geometry with 12 of its 48 layers (both engines' peaks fit 24 GB)
    "30b-a3b": Shape(12, 2048, 6144, 32, 4, 128, False, 151936, 128, 8, 768),
}
# each kind's types: most matrices', and those llama.cpp's mixes give more bits
MIXES = {"q4_0": ("Q4_0", "Q4_0"), "q4_k_m": ("Q4_K", "Q6_K"), "q5_k_m": ("Q5_K", "Q6_K")}
KINDS = tuple(MIXES)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]
# a type's values and bytes a block, and where its float16 scales lie (the rest random)
BLOCKS = {
    "Q4_0": (32, 18, [0]), "Q4_K": (256, 144, [0, 2]), "Q5_K": (256, 176, [0, 2]),
    "Q6_K": (256, 210, [208]),
}  # fmt: skip


def _blocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator, centred: bool = False
) -> np.ndarray:
    """Random blocks of GGML type `kind`, `[rows, bytes a row]`: random codes (and 6-bit
    sub-block scales), float16 scales of a trained layer's size (~0.002-0.01 a weight).
    `centred`: Q4_K's and Q5_K's sub-block mins equal to their scales and the super-block
    min the codes' middle times the scale, so that each weight's mean is 0 as a trained
    layer's is (random mins give every weight a mean above its spread: every token's hidden
    state the same direction, which a router sends to the same few experts)."""
    values, nbytes, at = BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows * cols // values, nbytes), dtype=np.uint8)
    # K-quants' super-block scales multiply 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block ones
    low, high = (0.002, 0.01) if kind == "Q4_0" else (0.00005, 0.0002)
    for j in at:
        scales = rng.uniform(low, high, len(blocks)).astype(np.float16)
        blocks[:, j : j + 2] = scales.view(np.uint8).reshape(-1, 2)
    if centred and kind in ("Q4_K", "Q5_K"):
        # bytes 4-15: the 6-bit scales and mins (llama.cpp's get_scale_min_k4: sub-blocks
        # 0-3 in bytes 4-7 / 8-11, 4-7 in the nibbles of 12-15 and the top bits of 4-11)
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 15) * 17
        middle = 7.5 if kind == "Q4_K" else 15.5
        d = blocks[:, 0:2].copy().view(np.float16)
        blocks[:, 2:4] = (d.astype(np.float32) * middle).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose V and FFN down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _router(experts: int, hidden: int, rng: np.random.Generator) -> np.ndarray:
    """A float32 router `[experts, hidden]`, random: logits ~N(0, 1) of a normed state."""
    return (rng.standard_normal((experts, hidden)) / hidden**0.5).astype(np.float32)


def write(path: Path, shape: Shape, kind: str) -> None:
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    s = shape
    arch = "qwen3moe" if s.experts else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(s.layers)
    w.add_context_length(8192)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.mlp)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6 if s.experts else 1e-5)
    w.add_rope_freq_base(1e6 if s.experts else 500000.0)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.used)
        w.add_expert_feed_forward_length(s.expert_mlp)
    alphabet = list(bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("i", "n")]
    tokens = SPECIALS + alphabet + ["".join(m) for m in merges]
    tokens += [f"<filler{i}>" for i in range(s.vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (s.vocab - 2))
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    base, more = MIXES[kind]
    # name -> (experts, rows, cols, GGML type): the untied embedding in the mix's base type
    matrices = {"token_embd.weight": (0, s.vocab, s.hidden, more if s.tied else base)}
    if not s.tied:
        matrices["output.weight"] = (0, s.vocab, s.hidden, more)
    # name -> its float32 length: the norms (Qwen3's Q and K norms a head's), then routers
    norms = {"output_norm.weight": s.hidden}
    routers = []
    for i in range(s.layers):
        b = f"blk.{i}."
        norms |= {b + "attn_norm.weight": s.hidden, b + "ffn_norm.weight": s.hidden}
        if s.experts:
            norms |= {b + "attn_q_norm.weight": s.head_dim, b + "attn_k_norm.weight": s.head_dim}
            routers.append(b + "ffn_gate_inp.weight")
        matrices |= {b + name: m for name, m in matrices_of(s, i, kind).items()}
    for name, n in norms.items():
        w.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    for name in routers:  # GGUF's shape [hidden, experts]: numpy's [experts, hidden]
        w.add_tensor_info(
            name, (s.experts, s.hidden), np.dtype(np.float32), s.experts * s.hidden * 4
        )
    for name, (experts, rows, cols, t) in matrices.items():
        values, nbytes, _ = BLOCKS[t]
        row = cols // values * nbytes
        held = (experts, rows) if experts else (rows,)  # a mixture's experts: a 3-D stack
        size = int(np.prod(held)) * row
        qtype = gguf.GGMLQuantizationType[t]
        w.add_tensor_info(name, (*held, row), np.dtype(np.uint8), size, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for n in norms.values():
        w.write_tensor_data(np.ones(n, np.float32))
    for _ in routers:
        w.write_tensor_data(_router(s.experts, s.hidden, rng))
    for experts, rows, cols, t in matrices.values():
        # (a mixture's centred: its router's choices spread as a trained model's)
        w.write_tensor_data(_blocks(t, max(experts, 1) * rows, cols, rng, bool(s.experts)))
    w.close()


def matrices_of(s: Shape, i: int, kind: str) -> dict[str, tuple[int, int, int, str]]:
    """Layer `i`'s quantized matrices (`blk.i.` left off) as `kind`'s mix types them: name
    -> (experts, 0 for a plain matrix; rows; columns; GGML type). A mixture's experts have
    llama.cpp's rule of a dense FFN's (its `layer_info` reads a `_exps` stack's layer from
    the name): Q4_K_M's gate and up Q4_K, down Q6_K where `use_more_bits`, else Q4_K."""
    base, more = MIXES[kind]
    extra = more if _more_bits(i, s.layers) else base
    kv, q = s.kv_heads * s.head_dim, s.heads * s.head_dim
    out = {
        "attn_q.weight": (0, q, s.hidden, base),
        "attn_k.weight": (0, kv, s.hidden, base),
        "attn_v.weight": (0, kv, s.hidden, extra),
        "attn_output.weight": (0, s.hidden, q, base),
    }
    if s.experts:
        e, m = s.experts, s.expert_mlp
        return out | {
            "ffn_gate_exps.weight": (e, m, s.hidden, base),
            "ffn_up_exps.weight": (e, m, s.hidden, base),
            "ffn_down_exps.weight": (e, s.hidden, m, extra),
        }
    return out | {
        "ffn_gate.weight": (0, s.mlp, s.hidden, base),
        "ffn_up.weight": (0, s.mlp, s.hidden, base),
        "ffn_down.weight": (0, s.hidden, s.mlp, extra),
    }


def model_file(directory: Path, model: str) -> Path:
    """`--models`' `8b-q4_k_m` as a file in `directory`, written the first time."""
    shape, kind = model.rsplit("-", 1)
    if shape not in SHAPES or kind not in KINDS:
        raise SystemExit(f"--models: {model!r} is not one of {list(SHAPES)} x {list(KINDS)}")
    arch = "qwen3moe" if SHAPES[shape].experts else "llama"
    path = directory / f"jpaged-{arch}-{model}.gguf"
    if not path.exists():
        start = time.monotonic()
        write(path.with_suffix(".partial"), SHAPES[shape], kind)
        path.with_suffix(".partial").rename(path)
        print(f"wrote {path} in {time.monotonic() - start:.0f} s", flush=True)
    return path


def proc_gb(pid: int, file: str, field: str) -> float:
    """A process's `field` (kB) in /proc/PID/`file`, in GB: `status`' VmHWM (its peak
    resident set), `smaps_rollup`'s AnonHugePages (its memory in huge pages now)."""
    with open(f"/proc/{pid}/{file}") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


def warm(path: Path) -> None:
    """`path` read once, so that it lies in the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass


def measure(
    name: str,
    path: Path,
    cmd: list[str],
    port: int,
    tokens: int,
    users: list[int],
    prefill: int,
    env: dict | None = None,
    settle: float = 0.0,
) -> dict[str, float]:
    fresh = itertools.count(300, 32)  # each prompt's first token: no prefix is ever cached

    def together(n: int, new: int) -> float:
        """n users' fresh 32-token prompts, `new` tokens each, together: the wall time."""
        prompts = [tuple(range(first, first + 32)) for first in itertools.islice(fresh, n)]
        return asyncio.run(run(url, [WorkloadRequest(q, new, 0.0) for q in prompts], n))[1]

    warm(path)
    start = time.monotonic()
    with serve(name, cmd, port, env=env) as (url, proc):
        loaded = time.monotonic() - start
        out = {"load_s": loaded}
        time.sleep(settle)  # a server up a while (jpaged's idle one moves to huge pages)
        for n in users:
            together(n, tokens)  # warm-up: compiles the programs the timed requests run
            first = min(together(n, 1) for _ in range(PASSES))
            out[f"ttft_s_{n}"] = first
            full = min(together(n, tokens) for _ in range(PASSES))
            out[f"tok_s_{n}"] = n * (tokens - 1) / (full - first)
            print(f"{name}: N = {n}: {out[f'tok_s_{n}']:.2f} tok/s", flush=True)
        if prefill:
            # one token after a `prefill`-token prompt; the warm-up prompt shares no prefix
            # with the timed one (both engines would reuse its cache)
            for first in (1 << 16, (1 << 16) + prefill):
                prompt = tuple(range(first, first + prefill))
                _, wall = asyncio.run(run(url, [WorkloadRequest(prompt, 1, 0.0)], 1))
            out["prefill_tok_s"] = prefill / wall
        out["peak_gb"] = proc_gb(proc.pid, "status", "VmHWM")
        out["huge_gb"] = proc_gb(proc.pid, "smaps_rollup", "AnonHugePages")
    print(f"{name}: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--llama-server", help="llama.cpp's llama-server binary (none: jpaged only)"
    )
    parser.add_argument("--dir", default="/tmp", help="where the synthetic GGUFs are kept")
    parser.add_argument(
        "--models", default="8b-q4_0", help=f"comma-separated {'|'.join(SHAPES)}-{'|'.join(KINDS)}"
    )
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
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds each server idles after /health before the first request",
    )
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    users = [int(n) for n in args.users.split(",")]
    # each user's context: room for the run's longest request (at least 512), no more: the
    # KV pool is reserved for --max-batch-size x this (float32 on a CPU, 0.26 MB a token at
    # 8B) and counts in the peak (at twice this: 0.12x the 8B file more, never used)
    context = str(max(512, args.prefill + args.tokens))
    paths = [model_file(Path(args.dir), m) for m in args.models.split(",")]
    info = machine_info()
    start_load = loadavg()
    print(machine_line(info), f"load {start_load:.2f}", flush=True)
    threads = str(os.cpu_count())
    rows = []
    trees = [("old ", args.old_tree)] if args.old_tree else []
    for model, path in zip(args.models.split(","), paths, strict=True):
        size = path.stat().st_size / 1e9
        runs = {}
        for (tree, root), activations in itertools.product(
            [*trees, ("", None)], args.activations.split(",")
        ):
            port = _free_port()
            # (-P: the old checkout's `server`, not the one in this directory)
            jp = [sys.executable, *(["-P"] if root else []), "-m", "server", "--model", str(path)]
            jp += ["--port", str(port), "--max-seq-len", context]
            jp += ["--max-batch-size", str(max(users)), "--log-level", "warning"]
            # not every bucket: the warm-up requests compile what the timed ones run
            jp += ["--no-warmup", "--activations", activations]
            name = f"{tree}jpaged ({activations} inputs)"
            env = None if root is None else {"PYTHONPATH": root}
            timed = (port, args.tokens, users, args.prefill, env, args.settle)
            runs[name] = measure(name, path, jp, *timed)
        if args.llama_server:
            port = _free_port()
            # a slot a user, each with the context a jpaged sequence gets
            slots = ["-np", str(max(users)), "-c", str(int(context) * max(users))]
            peer = [args.llama_server, "-m", str(path), "-t", threads, *slots]
            peer += ["--port", str(port)]
            timed = (port, args.tokens, users, args.prefill, None, args.settle)
            runs["llama.cpp"] = measure("llama.cpp", path, peer, *timed)
        rows += [
            [
                f"{model} ({size:.2f} GB)",
                k,
                f"{r['load_s']:.1f}",
                f"{r['peak_gb'] / size:.2f}x",
                f"{r['huge_gb']:.2f}",
                f"{r['ttft_s_1']:.2f}" if 1 in users else "",
                *(f"{r[f'tok_s_{n}']:.2f}" for n in users),
                *([f"{r['prefill_tok_s']:.1f}"] if args.prefill else []),
            ]
            for k, r in runs.items()
        ]
    columns = ["file", "engine", "load s", "peak RSS / file", "huge pages GB"]
    columns += ["first token s (N = 1)"]
    columns += [f"decode tok/s (N = {n})" for n in users]
    columns += [f"prefill {args.prefill} tok/s"] if args.prefill else []
    table = render_table(columns, rows)
    print(table)
    if args.write:
        mixture = any(SHAPES[m.rsplit("-", 1)[0]].experts for m in args.models.split(","))
        heading = (
            "## A Qwen3-30B-A3B-shaped GGUF on this machine (issue 80)"
            if mixture
            else "## Llama-shaped GGUFs on this machine (issue 51)"
        )
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        append_results(
            heading,
            f"### {when} UTC\n\n"
            f"`python -m benchmarks.bench_big --models {args.models} --tokens {args.tokens} "
            f"--users {args.users} --prefill {args.prefill} --activations {args.activations}"
            f"{f' --settle {args.settle:g}' if args.settle else ''}"
            f"{' --old-tree ' + args.old_tree if args.old_tree else ''}`; "
            f"{machine_line(info)}; load at the start {start_load:.2f}, at the end "
            f"{loadavg():.2f}.\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
