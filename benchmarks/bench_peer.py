"""jpaged's server against llama.cpp's (`llama-server`) on the same GGUF, at 1-48 users.

    python -m benchmarks.bench_peer --llama-server "$(../shared/peers/llama-server.sh)"
    python -m benchmarks.bench_peer --llama-server PATH --users 1,4 --write

The seed burst's requests (prompts 128-384 random token ids, 128-256 new tokens, greedy,
ignore EOS), served with at most N in flight: a client takes the next request as soon as
one of its N finishes, so the server always holds N (the last few aside). N = 1 and 4 serve
the burst's first 4N requests, larger N all 48. Output tok/s = completion tokens / wall.

Each server starts once and serves every N, warmed up by one request off the clock:
jpaged with its defaults but `--max-batch-size` = the largest N (its default is 16), for
each `--quantization` given (`gguf`, the default for a GGUF, keeps the file's blocks;
`none` is the float32 copy jpaged used to make); llama-server with `-t` = this machine's
cores, `-np` = the largest N, a context of 1024 tokens a slot, and its defaults otherwise
(CPU weight repacking on where its build has it). `--cpu-kernels on,off` serves each
quantization twice: with the CPU kernels (jpaged/models/qdot.cc's matmuls, jpaged/kernels/
attention.cc's attention) and with XLA's path alone (`JPAGED_CPU_KERNELS=0`);
`--activations float,int8` twice again: the matmuls' inputs as they are, and rounded to
int8 as llama.cpp rounds them (`--activations int8`); `--kv-cache-dtype auto,int8` twice
again: the KV cache in the model's dtype, and a byte a value (llama.cpp keeps its cache in
float16 unless told otherwise).
Servers run one at a time; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks import workloads
from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table
from benchmarks.serving.over_http import _free_port

SLOT_TOKENS = 1024  # llama-server's context a slot: the burst's longest request is 640


@contextlib.contextmanager
def serve(
    name: str, cmd: list[str], port: int, timeout: float = 1800, env: dict | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `cmd` (with `env` added to this process's environment), wait for its /health,
    yield its URL and process; SIGINT (then kill) at the end."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        environ = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
        try:
            start = time.monotonic()
            while True:
                if proc.poll() is not None or time.monotonic() - start > timeout:
                    log.seek(0)
                    raise RuntimeError(f"{name} did not come up:\n{log.read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.1)  # the load time to a tenth of a second
            print(f"{name}: ready in {time.monotonic() - start:.0f} s", flush=True)
            yield url, proc
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def run(url: str, requests: list[workloads.WorkloadRequest], users: int) -> tuple[int, float]:
    """Serve `requests` with at most `users` in flight; (completion tokens, wall seconds)."""
    import httpx

    todo = iter(requests)
    tokens = 0

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        for w in todo:  # one shared iterator: a free user takes the next request
            body = {
                "prompt": list(w.prompt_ids),
                "max_tokens": w.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != w.max_tokens:
                raise RuntimeError(f"asked for {w.max_tokens} tokens, got {got}")
            tokens += got

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=users)) as c:
        start = time.perf_counter()
        await asyncio.gather(*(user(c) for _ in range(users)))
        return tokens, time.perf_counter() - start


def sweep(url: str, burst: workloads.Workload, users: list[int]) -> dict[int, float]:
    asyncio.run(run(url, list(burst.requests[:1]), 1))  # warm-up, off the clock
    out = {}
    for n in users:
        tokens, wall = asyncio.run(run(url, list(burst.requests[: min(4 * n, 48)]), n))
        out[n] = tokens / wall
        print(f"  N = {n}: {tokens} tokens in {wall:.1f} s, {out[n]:.1f} tok/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file or a demo name")
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--users", default="1,4,16,48", help="requests in flight, comma-separated")
    parser.add_argument("--quantization", default="gguf,none", help="jpaged's, comma-separated")
    parser.add_argument(
        "--cpu-kernels", default="on", help="on, off or on,off: jpaged's CPU kernels "
        "(jpaged.kernels.cpu) or XLA's path alone (JPAGED_CPU_KERNELS=0), each a server of its own",
    )  # fmt: skip
    parser.add_argument(
        "--activations", default="float", help="float, int8 or float,int8: jpaged's "
        "--activations (int8: the CPU kernels round 4-bit matmuls' inputs, as llama.cpp does)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto, int8 or auto,int8: jpaged's "
        "--kv-cache-dtype (int8: K and V a byte a value, a scale per token and head)",
    )  # fmt: skip
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args(argv)
    from jpaged.models import demo

    path, _ = demo.resolve(args.model)
    users = [int(u) for u in args.users.split(",")]
    burst = workloads.paged_attention(48, vocab_size=16_000)
    threads = str(os.cpu_count())
    info = machine_info()
    print(machine_line(info), f"load {loadavg():.2f}", flush=True)

    results: dict[str, dict[int, float]] = {}
    kernels = args.cpu_kernels.split(",")
    for q, k, a, kv in itertools.product(
        args.quantization.split(","),
        kernels,
        args.activations.split(","),
        args.kv_cache_dtype.split(","),
    ):
        port = _free_port()
        cmd = [sys.executable, "-m", "server", "--model", str(path), "--port", str(port)]
        cmd += ["--quantization", q, "--activations", a, "--max-batch-size", str(max(users))]
        cmd += ["--kv-cache-dtype", kv, "--log-level", "warning"]
        name = (
            f"jpaged ({q}{', XLA only' if k == 'off' else ''}{', int8 inputs' * (a == 'int8')}"
            f"{f', {kv} KV' if kv != 'auto' else ''})"
        )
        env = {"JPAGED_CPU_KERNELS": "0" if k == "off" else "1"}
        with serve(name, cmd, port, env=env) as (url, _):
            results[name] = sweep(url, burst, users)
    port = _free_port()
    peer = [args.llama_server, "-m", str(path), "-t", threads, "-tb", threads, "--port", str(port)]
    peer += ["-np", str(max(users)), "-c", str(SLOT_TOKENS * max(users))]
    with serve("llama-server", peer, port) as (url, _):
        results["llama.cpp"] = sweep(url, burst, users)

    names = list(results)
    rows = [
        [str(n)]
        + [f"{results[k][n]:.1f}" for k in names]
        + [f"{results[k][n] / results['llama.cpp'][n]:.2f}x" for k in names[:-1]]
        for n in users
    ]
    header = ["users", *(f"{k} tok/s" for k in names), *(f"{k} / llama.cpp" for k in names[:-1])]
    table = render_table(header, rows)
    print(table)
    if args.write:
        run_text = (
            f"`python -m benchmarks.bench_peer --users {args.users} --quantization "
            f"{args.quantization} --cpu-kernels {args.cpu_kernels} --activations "
            f"{args.activations} --kv-cache-dtype {args.kv_cache_dtype}` on {Path(path).name}; "
            f"{machine_line(info)}; load at the end {loadavg():.2f}.\n\n{table}\n"
        )
        append_results("## One to 48 users: jpaged's server vs llama.cpp's", run_text)


if __name__ == "__main__":
    main()
