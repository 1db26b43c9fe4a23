"""Soak test: N concurrent streaming clients against a real server for a bounded time.

    python -m benchmarks.soak --clients 500 --duration 600            # the tiny test model
    python -m benchmarks.soak --clients 64 --duration 120 --model smollm2-135m

Starts `python -m server` on 127.0.0.1 (the test suite's tiny random Llama unless
`--model` names one), then keeps `--clients` SSE clients busy, each sending one
streaming completion after another: most read their stream to the end, a share
(`--disconnect-share`) hang up after a few chunks and a share (`--slow-share`) read
slowly. Once `--duration` is over no new request starts; the run waits for the
running ones, for the server to go idle, then SIGTERMs it.

It reports requests served, latency percentiles, errors by kind, and the server
process's peak RSS, open file descriptors and threads (from /proc/<pid>), RSS
after `--warmup` seconds ("minute 1") and at the end of the load, KV blocks in use
and asyncio tasks at the end (from /metrics), and checks: no 5xx and no failed
stream, every block free, descriptors, threads and tasks back to where they were
before the load, RSS flat after warm-up, and a clean, audited exit. Exit status
1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import fetch_metrics, percentile, render_table

# Every shape compiled before the server listens (~30 programs, ~20 s for the tiny model on
# two cores): a program compiled mid-soak would stall requests and grow RSS by itself.
SERVER_ARGS = "--dtype float32 --block-size 16 --max-seq-len 256 --max-batch-size 16"
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
]


@dataclasses.dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mb: float
    fds: int
    threads: int


@dataclasses.dataclass
class Record:
    kind: str  # normal, slow, disconnect
    outcome: str = "error"  # done ([DONE] read), hung up (as planned), error
    latency_s: float = float("nan")
    ttft_s: float = float("nan")
    chunks: int = 0
    error: str | None = None


def proc_sample(pid: int, t: float) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Sample(
        t,
        int(fields["VmRSS"].split()[0]) / 1024,
        len(os.listdir(f"/proc/{pid}/fd")),
        int(fields["Threads"]),
    )


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tiny_model(root: Path) -> Path:
    """The test suite's tiny random Llama (needs the dev extras: torch, transformers)."""
    spec = importlib.util.spec_from_file_location(
        "jpaged_test_conftest", Path(__file__).parents[1] / "tests" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = conftest  # (its dataclasses look their module up there)
    spec.loader.exec_module(conftest)
    return conftest.build_tiny_checkpoint("llama", root / "tiny-llama")


@contextlib.contextmanager
def launch(
    model: str, args: Sequence[str], log: Path, root: str | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m server` on a free port of 127.0.0.1, once /health answers; killed on exit
    if still running. Its output goes to `log` (a pipe nobody drains would block it).
    `root`: the checkout whose server runs (another commit's), else this one's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        # (-P: the server of PYTHONPATH's checkout, not of the working directory)
        env = None if root is None else dict(os.environ, PYTHONPATH=os.path.abspath(root))
        proc = subprocess.Popen(
            [
                sys.executable,
                *(["-P"] if root else []),
                "-m",
                "server",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 10 minutes")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def client_loop(
    i: int, ac: httpx.AsyncClient, kind: str, stop_at: float, records: list[Record], seed: int
) -> None:
    """One client: streaming requests back to back until `stop_at` (time.monotonic())."""
    rng = random.Random(seed * 100_003 + i)
    while time.monotonic() < stop_at:
        body = {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 40))),
            "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0, 0.8]),
            "ignore_eos": rng.random() < 0.5,
            "stream": True,
        }
        hang_up_after = rng.randint(1, 4)
        record = Record(kind)
        start = time.perf_counter()
        try:
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    record.error = f"HTTP {r.status_code}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if record.chunks == 0:
                            record.ttft_s = time.perf_counter() - start
                        if line == "data: [DONE]":
                            record.outcome = "done"
                            break
                        if '"error"' in line and "error" in json.loads(line[6:]):
                            record.error = "error event"
                            break
                        record.chunks += 1
                        if kind == "slow":
                            await asyncio.sleep(rng.uniform(0.05, 0.3))
                        elif kind == "disconnect" and record.chunks == hang_up_after:
                            record.outcome = "hung up"  # leaving the block closes the connection
                            break
                    else:
                        record.error = record.error or "stream ended without [DONE]"
        except httpx.HTTPError as exc:
            record.error = type(exc).__name__
        record.latency_s = time.perf_counter() - start
        records.append(record)


async def sampler(pid: int, start: float, stop: asyncio.Event, samples: list[Sample]) -> None:
    while not stop.is_set():
        samples.append(proc_sample(pid, time.monotonic() - start))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def load(
    url: str,
    pid: int,
    clients: int,
    duration_s: float,
    kinds: list[str],
    seed: int,
    request_timeout_s: float,
) -> tuple[list[Record], list[Sample]]:
    records: list[Record] = []
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    start = time.monotonic()
    stop = asyncio.Event()
    watch = asyncio.create_task(sampler(pid, start, stop, samples))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=request_timeout_s) as ac:
        await asyncio.gather(
            *(
                client_loop(i, ac, kinds[i], start + duration_s, records, seed)
                for i in range(clients)
            )
        )
    samples.append(proc_sample(pid, time.monotonic() - start))  # the end of the load
    stop.set()
    await watch
    return records, samples


def wait_idle(client: httpx.Client, timeout_s: float) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a block (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = fetch_metrics(client)
        busy = (m["running"], m["waiting"], m["kv_blocks_used"], m["http_requests_in_flight"])
        if not any(busy) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def run(
    clients: int,
    duration_s: float,
    model: str | None = None,
    *,
    warmup_s: float = 60.0,
    disconnect_share: float = 0.2,
    slow_share: float = 0.2,
    server_args: str = SERVER_ARGS,
    seed: int = 0,
    fd_slack: int = 8,
    rss_tolerance: float = 0.1,
    rss_slack_mb: float = 32.0,
    log: Any = print,
) -> dict[str, Any]:
    """Run a soak and return its report (`report["failures"]` lists the failed checks)."""
    n_disconnect, n_slow = round(clients * disconnect_share), round(clients * slow_share)
    kinds = ["disconnect"] * n_disconnect + ["slow"] * n_slow
    kinds += ["normal"] * (clients - len(kinds))
    random.Random(seed).shuffle(kinds)  # so that every start mixes them
    with tempfile.TemporaryDirectory(prefix="jpaged-soak-") as tmp:
        path = model or str(tiny_model(Path(tmp)))
        # room for every client in the queue: a 503 would be a planned shed, not a failure
        args = [*shlex.split(server_args), "--max-waiting", str(max(1024, 2 * clients))]
        server_log = Path(tmp) / "server.log"
        log(
            f"soak: {clients} clients ({kinds.count('disconnect')} hang up mid-stream, "
            f"{kinds.count('slow')} read slowly) for {duration_s:g} s against {path}"
        )
        with launch(path, args, server_log) as (proc, url), httpx.Client(base_url=url) as mc:
            before, sample_before = fetch_metrics(mc), proc_sample(proc.pid, 0.0)
            records, samples = asyncio.run(
                load(url, proc.pid, clients, duration_s, kinds, seed, duration_s + 300)
            )
            idle = wait_idle(mc, 60)
            time.sleep(0.5)  # let the server see the last connections close
            sample_after, peak = proc_sample(proc.pid, samples[-1].t), peak_rss_mb(proc.pid)
            idle = fetch_metrics(mc)
            alive = mc.get("/health").status_code == 200
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                code = None
        out = server_log.read_text()

    served = [r for r in records if r.outcome == "done"]
    full_speed = [r for r in served if r.kind == "normal"]  # a slow reader's latency is its own
    errors = Counter(r.error for r in records if r.error)
    at_warmup = next((s for s in samples if s.t >= warmup_s), samples[-1])
    report: dict[str, Any] = {
        "clients": clients,
        "duration_s": duration_s,
        "model": path,
        "requests": len(records),
        "served": len(served),
        "hung_up": sum(r.outcome == "hung up" for r in records),
        "outcomes": {
            kind: dict(Counter(r.outcome for r in records if r.kind == kind))
            for kind in ("normal", "slow", "disconnect")
        },
        "errors": dict(errors),
        "latency_p50_s": percentile([r.latency_s for r in full_speed], 50),
        "latency_p99_s": percentile([r.latency_s for r in full_speed], 99),
        "ttft_p50_s": percentile([r.ttft_s for r in served], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in served], 99),
        "chunks": sum(r.chunks for r in records),
        "rss_before_mb": sample_before.rss_mb,
        "rss_at_warmup_mb": at_warmup.rss_mb,
        "warmup_s": at_warmup.t,
        "rss_end_mb": samples[-1].rss_mb,
        "rss_idle_end_mb": sample_after.rss_mb,
        "rss_peak_mb": peak,
        "fds_before": sample_before.fds,
        "fds_peak": max(s.fds for s in samples),
        "fds_end": sample_after.fds,
        "threads_before": sample_before.threads,
        "threads_end": sample_after.threads,
        "asyncio_tasks_before": before["asyncio_tasks"],
        "asyncio_tasks_end": idle["asyncio_tasks"],
        "python_threads_before": before["python_threads"],
        "python_threads_end": idle["python_threads"],
        "pool_threads_before": before["python_pool_threads"],
        "pool_threads_end": idle["python_pool_threads"],
        "kv_blocks_used_end": idle["kv_blocks_used"],
        "running_end": idle["running"],
        "warmed_up": "--no-warmup" not in args,
        "compilations_during_load": idle["compilations"] - before["compilations"],
        "tokens_generated": idle["tokens_generated"] - before["tokens_generated"],
        "health_ok": alive,
        "exit_code": code,
        "exit_audited": "every KV block free (audited)" in out,
        "samples": [dataclasses.asdict(s) for s in samples],
    }
    report["failures"] = checks(report, fd_slack, rss_tolerance, rss_slack_mb)
    if report["failures"]:
        report["server_log_tail"] = out[-3000:]
    return report


def unpooled(r: dict[str, Any], when: str) -> float:
    """Python threads outside anyio's worker pool, `before` or at the `end` of a soak."""
    return r[f"python_threads_{when}"] - r[f"pool_threads_{when}"]


def native(r: dict[str, Any], when: str) -> float:
    """The process's threads that are not Python's (XLA's pools and the like)."""
    return r[f"threads_{when}"] - r[f"python_threads_{when}"]


def checks(
    r: dict[str, Any], fd_slack: int, rss_tolerance: float, rss_slack_mb: float
) -> list[str]:
    """The soak's pass conditions, each failed one in words."""
    rss_limit = r["rss_at_warmup_mb"] * (1 + rss_tolerance) + rss_slack_mb
    conditions = [
        (r["served"] > 0, "no request was served"),
        (not r["errors"], f"errors: {r['errors']} (5xx, failed streams or client timeouts)"),
        (r["kv_blocks_used_end"] == 0, f"{r['kv_blocks_used_end']:g} KV blocks still in use"),
        (r["running_end"] == 0, f"{r['running_end']:g} requests still running"),
        (r["health_ok"], "/health was not 200 after the load"),
        (
            r["fds_end"] <= r["fds_before"] + fd_slack,
            f"open fds grew from {r['fds_before']} to {r['fds_end']}",
        ),
        (
            r["asyncio_tasks_end"] <= r["asyncio_tasks_before"],
            f"asyncio tasks grew from {r['asyncio_tasks_before']:g} to {r['asyncio_tasks_end']:g}",
        ),
        # anyio's pool (request parsing, /metrics) ends the load with as many workers as were
        # ever busy at once: bounded, not a leak; every other thread, Python's or native, is
        # counted apart from it (the engine's prepare thread starts with the first request)
        (
            r["pool_threads_end"] <= 40,
            f"anyio's pool holds {r['pool_threads_end']:g} threads, over its limit of 40",
        ),
        (
            unpooled(r, "end") <= unpooled(r, "before") + 1,
            f"Python threads outside anyio's pool grew from {unpooled(r, 'before'):g} to "
            f"{unpooled(r, 'end'):g}",
        ),
        (
            native(r, "end") <= native(r, "before") + 4,
            f"native threads grew from {native(r, 'before'):g} to {native(r, 'end'):g}",
        ),
        # a program compiled mid-load grows RSS by itself, and says nothing about leaks
        (
            not r["warmed_up"] or r["compilations_during_load"] == 0,
            f"{r['compilations_during_load']:g} programs compiled after the warm-up",
        ),
        (
            r["rss_end_mb"] <= rss_limit,
            f"RSS grew from {r['rss_at_warmup_mb']:.0f} MB at "
            f"{r['warmup_s']:.0f} s to {r['rss_end_mb']:.0f} MB (limit {rss_limit:.0f} MB)",
        ),
        (
            r["exit_code"] == 0 and r["exit_audited"],
            f"SIGTERM: exit code {r['exit_code']}, audited exit: {r['exit_audited']}",
        ),
    ]
    return [message for ok, message in conditions if not ok]


def table(r: dict[str, Any]) -> str:
    def ms(s: float) -> str:
        return f"{s * 1e3:.0f} ms"

    rows = [
        ("clients / duration", f"{r['clients']} / {r['duration_s']:g} s"),
        (
            "requests (served, hung up by the client)",
            f"{r['requests']} ({r['served']}, {r['hung_up']})",
        ),
        ("tokens generated", f"{r['tokens_generated']:g}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"),
        (
            "latency p50 / p99 (clients reading at full speed)",
            f"{ms(r['latency_p50_s'])} / {ms(r['latency_p99_s'])}",
        ),
        ("TTFT p50 / p99", f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}"),
        (
            "RSS before / at warm-up / end of load / peak",
            f"{r['rss_before_mb']:.0f} / {r['rss_at_warmup_mb']:.0f} (at {r['warmup_s']:.0f} s) / "
            f"{r['rss_end_mb']:.0f} / {r['rss_peak_mb']:.0f} MB",
        ),
        ("open fds before / peak / after", f"{r['fds_before']} / {r['fds_peak']} / {r['fds_end']}"),
        (
            "threads before / after (OS; Python; anyio's pool)",
            f"{r['threads_before']} / {r['threads_end']}; "
            f"{r['python_threads_before']:g} / {r['python_threads_end']:g}; "
            f"{r['pool_threads_before']:g} / {r['pool_threads_end']:g}",
        ),
        (
            "asyncio tasks before / after",
            f"{r['asyncio_tasks_before']:g} / {r['asyncio_tasks_end']:g}",
        ),
        ("KV blocks used at the end", f"{r['kv_blocks_used_end']:g}"),
        ("programs compiled during the load", f"{r['compilations_during_load']:g}"),
        ("SIGTERM exit", f"code {r['exit_code']}, audited: {r['exit_audited']}"),
    ]
    return render_table(["soak", "value"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.splitlines()[0]
    )
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument(
        "--model",
        help="a demo model's name, a checkpoint directory or a .gguf "
        "(default: the test suite's tiny random Llama)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="RSS must stay flat from this many seconds into the load",
    )
    p.add_argument(
        "--disconnect-share",
        type=float,
        default=0.2,
        help="share of clients that hang up after a few chunks",
    )
    p.add_argument(
        "--slow-share",
        type=float,
        default=0.2,
        help="share of clients that read their stream slowly",
    )
    p.add_argument(
        "--server-args",
        default=SERVER_ARGS,
        help="flags for `python -m server` (--max-waiting is added)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    args = p.parse_args(argv)
    report = run(
        args.clients,
        args.duration,
        args.model,
        warmup_s=args.warmup,
        disconnect_share=args.disconnect_share,
        slow_share=args.slow_share,
        server_args=args.server_args,
        seed=args.seed,
    )
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if report["failures"]:
        print("FAILED:\n  " + "\n  ".join(report["failures"]))
        print(report.get("server_log_tail", ""))
        sys.exit(1)
    print("passed: no 5xx, every block free, no leaked fds/threads/tasks, RSS flat, clean exit")


if __name__ == "__main__":
    main()
