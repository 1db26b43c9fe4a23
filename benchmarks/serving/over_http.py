"""Driving a real `python -m server` subprocess over HTTP: concurrent httpx SSE clients,
`/metrics` polled for the timeline and read before and after each pass for the engine's
counters (the same names as `engine.stats()`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.common import loadavg, parse_metrics
from benchmarks.serving import BENCH_DIR
from benchmarks.serving.configs import BenchConfig, kv_block_bytes
from benchmarks.serving.measure import (
    TIMELINE_KEYS,
    PassResult,
    RequestRecord,
    new_timeline,
    pass_result,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m server` on 127.0.0.1 and a free port; stopped (by its own pid) on exit."""

    def __init__(self, model_path: Path, cfg: BenchConfig, *, warmup: bool) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="jpaged-bench-server-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *cfg.server_flags(),
        ]
        if not warmup:
            cmd.append("--no-warmup")
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(BENCH_DIR.parent)
        )

    def wait_ready(self, timeout: float) -> float:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


async def _drive(
    url: str,
    workload: workloads.Workload,
    temperature: float,
    *,
    progress: bool,
    label: str,
    poll_s: float = 0.05,
) -> tuple[list[RequestRecord], dict[str, list[float]], float]:
    import httpx
    from tqdm import tqdm

    records = [RequestRecord(arrival=0.0) for _ in workload.requests]
    timeline = new_timeline()
    bar = tqdm(total=len(records), desc=label, unit="req", disable=not progress)
    limits = httpx.Limits(max_connections=len(records) + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        finished = asyncio.Event()

        async def one(i: int, w: workloads.WorkloadRequest) -> None:
            await asyncio.sleep(max(0.0, w.arrival_s - (time.perf_counter() - start)))
            rec = records[i]
            rec.arrival = time.perf_counter() - start
            body = {
                "prompt": list(w.prompt_ids),
                "max_tokens": w.max_tokens,
                "temperature": temperature,
                "ignore_eos": True,
                "seed": i,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            rec.error = str(obj["error"])
                        elif obj.get("choices"):
                            # one chunk per engine step with tokens: one token while decoding
                            rec.token_times.append(time.perf_counter() - start)
                        elif obj.get("usage"):
                            rec.tokens = int(obj["usage"]["completion_tokens"])
                rec.finish = time.perf_counter() - start
            except httpx.HTTPError as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            finally:
                bar.update(1)

        async def poll() -> None:
            while not finished.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    m = parse_metrics((await client.get(url + "/metrics")).text)
                    timeline["t"].append(time.perf_counter() - start)
                    timeline["running"].append(m.get("running", 0.0))
                    timeline["waiting"].append(m.get("waiting", 0.0))
                    for k in TIMELINE_KEYS[2:]:
                        timeline[k].append(m.get(f"kv_{k}", 0.0))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(finished.wait(), poll_s)

        poller = asyncio.create_task(poll())
        await asyncio.gather(*(one(i, w) for i, w in enumerate(workload.requests)))
        wall = time.perf_counter() - start
        finished.set()
        await poller
    bar.close()
    return records, timeline, wall


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), nan elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class ServerTarget:
    """One configuration as a `python -m server` subprocess, driven over HTTP/SSE."""

    def __init__(
        self,
        model_path: Path,
        cfg: BenchConfig,
        *,
        warmup: str,
        temperature: float,
        progress: bool = True,
        ready_timeout: float = 1800,
    ) -> None:
        self.model_path, self.cfg, self.warmup = model_path, cfg, warmup
        self.temperature, self.progress, self.ready_timeout = temperature, progress, ready_timeout
        self.server: ServerProcess | None = None

    def warm_up(self, workload: workloads.Workload) -> None:
        cfg = self.cfg
        server = self.server = ServerProcess(self.model_path, cfg, warmup=self.warmup == "engine")
        start_s = server.wait_ready(self.ready_timeout)
        first = self.metrics()
        self.blocks_total = int(first.get("kv_blocks_total", 0))
        self.kv_bytes = (self.blocks_total + 1) * kv_block_bytes(self.model_path, cfg)
        print(
            f"{cfg.label} (server {server.url}): KV pool {self.kv_bytes:,} bytes "
            f"({self.kv_bytes / 2**20:.1f} MiB, {self.blocks_total + 1} blocks x "
            f"{cfg.block_size} tokens incl. the null block); ready after {start_s:.1f} s",
            flush=True,
        )
        warm_pass_s = 0.0
        if self.warmup != "engine":  # send the workload once
            t = time.perf_counter()
            hf = json.loads((self.model_path / "config.json").read_text())
            warm = workload.with_fresh_tokens(seed=1, vocab_size=hf.get("vocab_size", 32000))
            asyncio.run(
                _drive(
                    server.url,
                    warm,
                    self.temperature,
                    progress=self.progress,
                    label=f"{cfg.label} warm-up pass",
                )
            )
            warm_pass_s = time.perf_counter() - t
        self.warmup_s = start_s + warm_pass_s
        self.compilations_at_warmup = self.metrics().get("compilations", 0.0)

    def metrics(self) -> dict[str, float]:
        import httpx

        assert self.server is not None, "warm_up first"
        return parse_metrics(httpx.get(self.server.url + "/metrics").text)

    def measure(self, workload: workloads.Workload) -> dict[str, Any]:
        cfg, server = self.cfg, self.server
        assert server is not None, "warm_up first"
        load_before = loadavg()
        before = self.metrics()
        cpu0 = _proc_cpu_s(server.proc.pid)
        records, timeline, wall = asyncio.run(
            _drive(server.url, workload, self.temperature, progress=self.progress, label=cfg.label)
        )
        # the server process's CPU only (the clients run here)
        run = PassResult(records, timeline, wall, _proc_cpu_s(server.proc.pid) - cpu0)
        return pass_result(
            cfg,
            run,
            before,
            self.metrics(),
            mode="server",
            warmup="engine" if self.warmup == "engine" else "workload pass",
            warmup_s=self.warmup_s,
            kv_bytes=self.kv_bytes,
            blocks_total=self.blocks_total,
            compilations_at_warmup=self.compilations_at_warmup,
            load_before=load_before,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
