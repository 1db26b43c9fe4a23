"""Serving benchmark: paged vs contiguous KV cache at the same KV memory.

    python -m benchmarks.bench_serving --model bench --backend both
    python -m benchmarks.bench_serving --model bench --backend both --workload poisson --rate 2
    python -m benchmarks.bench_serving --model bench --backend both --through-server
    python -m benchmarks.bench_serving --replot benchmarks/results/serving_paged_attention.json
    python -m benchmarks.bench_serving --decode-profile     # the decode step alone
    python -m benchmarks.bench_serving --model PATH --pool-scan 1024,16384   # step time vs pool

The matched-memory protocol (issue 5): the contiguous backend reserves
`--contiguous-batch-size` (8) slots of `--max-seq-len` (4096) tokens; each paged
configuration gets exactly the same KV bytes (`num_blocks = 8*4096/block_size`)
and a larger `max_batch_size` (`--paged-batch-sizes`, default 24 and 48). Every
configuration prints the KV bytes it allocated.

In process (default), each configuration gets a fresh Engine that is warmed up
before the clock starts, then serves the workload `--repeat` times (default 1),
measured, the configurations taking turns so that a shared machine's load drifts
hit them alike (later rounds use fresh prompt ids; the median-throughput pass is
reported). Requests are added at their arrival times and the engine is stepped
until all finish; after
every step `engine.stats()` is sampled (running sequences, KV blocks,
utilization), and that sampling cost is measured and reported. With
`--through-server`, each configuration is a real `python -m server` subprocess
on 127.0.0.1 driven by concurrent httpx SSE clients, and `/metrics` is polled
for the timeline.

Warm-up (`--warmup`), always off the clock:
- `workload` (default): one unmeasured pass of the same workload with fresh
  prompt ids (so the paged prefix cache has nothing to reuse), which compiles the
  shape buckets it uses; the measured pass must compile nothing (checked, reported
  as "compilations after warm-up"; over HTTP or with Poisson arrivals, timing can
  form a batch the warm-up pass did not, and it shows there).
- `engine`: `EngineConfig.warmup`, which compiles and runs every token bucket the
  runner lists (12 step programs at the default 512-token budget, plus the sampler
  variants). Each XLA:CPU step program holds ~140 memory mappings, and Linux's
  vm.max_map_count (65530) caps a process's; `build_engine` refuses up front what
  would not fit. Natural with `--through-server` (a process each).

Prints one markdown table, writes the raw numbers as JSON and a PNG plot
(running sequences and KV blocks used over time, throughput bars). The table and
JSON carry the engine's own split of a step over the measured pass: ms per step in
all, on the device (dispatch, compute, results back) and on the host (the rest).

On a GPU: `--model` takes a Hugging Face checkpoint directory (or, in process, a
`.gguf`) and `--dtype` defaults to auto (bfloat16 there, float32 on a CPU). With
`--backend paged` the contiguous batch size only sizes the pool; 256 rows on the seed
burst as issue 10 measured them (a 256 x 1024-token pool, one workload warm-up pass):
    python -m benchmarks.bench_serving --model PATH --dtype bfloat16 --backend paged \
        --paged-batch-sizes 256 --contiguous-batch-size 256 --max-seq-len 1024 \
        --num-requests 256 --max-num-batched-tokens 2048
The vm.max_map_count guard of `--warmup engine` applies to XLA:CPU only.

`--pool-scan 1024,16384` instead times the same requests (`--scan-requests` 32 prompts
of `--scan-prompt-len` 100 random ids, `--scan-max-tokens` 64 new tokens each, greedy,
EOS ignored, prefix caching off, all decoding together) on a paged pool of each size: a
warm pass, then a timed pass whose ms/step (every step of it, the few prefill steps
included) is printed per size with the ratio largest / smallest; a pool that is copied
each step instead of updated in place makes the step time grow with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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

import numpy as np

from benchmarks import workloads
from benchmarks.common import (
    WARMUP_MODES,
    CompileCounter,
    build_engine,
    fmt,
    loadavg,
    machine_info,
    machine_line,
    percentile,
    render_table,
)
from jpaged.dtypes import DTYPE_NAMES, concrete_dtype

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"

# -------------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    label: str
    backend: str
    max_batch_size: int
    max_seq_len: int
    block_size: int
    num_blocks: int | None  # paged only: usable blocks, matched to the contiguous bytes
    dtype: str
    max_num_batched_tokens: int

    def engine_config(self) -> Any:
        from jpaged.config import EngineConfig

        return EngineConfig(
            backend=self.backend,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            max_num_batched_tokens=self.max_num_batched_tokens,
            # a burst must queue whole: the queue limit is not what is measured
            max_waiting_requests=1 << 16,
        )

    def server_flags(self) -> list[str]:
        flags = [
            "--backend", self.backend,
            "--max-batch-size", str(self.max_batch_size),
            "--max-seq-len", str(self.max_seq_len),
            "--block-size", str(self.block_size),
            "--dtype", self.dtype,
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-waiting", str(1 << 16),
        ]  # fmt: skip
        if self.num_blocks is not None:
            flags += ["--num-blocks", str(self.num_blocks)]
        return flags


def matched_configs(
    backend: str,
    *,
    contiguous_batch: int = 8,
    paged_batches: tuple[int, ...] = (24, 48),
    max_seq_len: int = 4096,
    block_size: int = 16,
    dtype: str = "auto",
    max_num_batched_tokens: int = 512,
) -> list[BenchConfig]:
    """Contiguous `contiguous_batch x max_seq_len` and paged pools of the same bytes."""
    dtype = concrete_dtype(dtype)  # the configs, their JSON and server flags name it
    if (contiguous_batch * max_seq_len) % block_size:
        raise ValueError("contiguous_batch * max_seq_len must be a multiple of block_size")
    blocks_per_seq = -(-max_seq_len // block_size)
    num_blocks = contiguous_batch * blocks_per_seq  # the contiguous pool, null block aside
    common: dict[str, Any] = dict(max_seq_len=max_seq_len, block_size=block_size, dtype=dtype,
                  max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    configs = []
    if backend in ("contiguous", "both"):
        configs.append(BenchConfig(f"contiguous b{contiguous_batch}", "contiguous",
                                   contiguous_batch, num_blocks=None, **common))  # fmt: skip
    if backend in ("paged", "both"):
        for b in paged_batches:
            configs.append(BenchConfig(f"paged b{b}", "paged", b, num_blocks=num_blocks,
                                       **common))  # fmt: skip
    return configs


# -------------------------------------------------------------------------------- results


@dataclasses.dataclass
class RequestRecord:
    arrival: float  # when it was added / sent, seconds from the run's start
    token_times: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    finish: float | None = None
    error: str | None = None


def summarize(
    records: list[RequestRecord],
    timeline: dict[str, list[float]],
    wall_s: float,
    final: dict[str, float],
    *,
    blocks_total: int,
) -> dict[str, Any]:
    """The issue's metrics from per-request token times and the sampled timeline."""
    done = [r for r in records if r.finish is not None and r.error is None]
    ttft = [(r.token_times[0] - r.arrival) * 1e3 for r in done if r.token_times]
    itl = [
        (b - a) * 1e3 for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)
    ]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1)
        for r in done
        if len(r.token_times) > 1
    ]
    e2e = [(r.finish - r.arrival) * 1e3 for r in done if r.finish is not None]
    tokens = sum(r.tokens for r in done)
    running = timeline.get("running", [])
    blocks = timeline.get("blocks_used", [])
    peak_i = int(np.argmax(blocks)) if blocks else None
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "request_throughput": len(done) / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "tpot_mean_ms": float(np.mean(tpot)) if tpot else float("nan"),
        "e2e_p50_ms": percentile(e2e, 50),
        "peak_running": int(max(running)) if running else 0,
        "peak_blocks_used": int(blocks[peak_i]) if peak_i is not None else 0,
        "blocks_total": blocks_total,
        "utilization_at_peak": timeline["utilization"][peak_i] if peak_i is not None else 0.0,
        "fragmentation_at_peak": timeline["fragmentation"][peak_i] if peak_i is not None else 0.0,
        "tokens_stored_at_peak": int(timeline["tokens_stored"][peak_i])
        if peak_i is not None
        else 0,
        "preemptions": int(final.get("preemptions", 0)),
        "compilations_after_warmup": int(final.get("compilations_after_warmup", 0)),
    }


def per_step_ms(steps: float, step_s: float, device_s: float, host_s: float) -> dict[str, float]:
    """The engine's step time over a pass (deltas of `engine.stats()`), in ms per step."""
    n = max(steps, 1)
    return {"step_ms_mean": 1e3 * step_s / n, "device_ms_per_step": 1e3 * device_s / n,
            "host_ms_per_step": 1e3 * host_s / n}  # fmt: skip


# -------------------------------------------------------------------------------- in process


class StepProfiler:
    """Splits each engine step into scheduling, host batch building, device, and the rest
    (sampling bookkeeping, detokenizing, outputs) by wrapping the engine's scheduler and
    runner *instances* — the engine's code is untouched."""

    def __init__(self, engine: Any) -> None:
        import time as _time

        self.engine = engine
        self.totals = {"schedule_s": 0.0, "build_s": 0.0, "device_s": 0.0, "calls": 0.0,
                       "decode_calls": 0.0, "decode_rows": 0.0, "decode_s": 0.0,
                       "decode_build_s": 0.0, "prefill_calls": 0.0, "prefill_s": 0.0,
                       # padding of the token buckets: real vs computed
                       "decode_rows_padded": 0.0, "prefill_tokens": 0.0,
                       "prefill_tokens_padded": 0.0}  # fmt: skip
        self.buckets: dict[str, int] = {}  # decode-only step's token bucket -> calls
        kinds: dict[int, str] = {}  # a pending call -> "decode" (only) or "prefill" (some)
        sched, runner = engine.scheduler, engine.runner
        orig_schedule = sched.schedule
        orig_dispatch, orig_collect = runner.dispatch, runner.collect
        clock = _time.perf_counter

        def schedule(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return orig_schedule(*a, **k)
            finally:
                self.totals["schedule_s"] += clock() - t

        def dispatch(rows: Any) -> Any:
            d0, t = runner.device_s, clock()
            pending = orig_dispatch(rows)
            total, device = clock() - t, runner.device_s - d0
            self.totals["build_s"] += total - device
            self.totals["device_s"] += device
            self.totals["calls"] += 1
            shape = pending.shape  # the bucket the runner padded this call to
            tokens = sum(len(r.token_ids) for r in rows)
            kind = kinds[id(pending)] = "decode" if tokens == len(rows) else "prefill"
            self.totals[f"{kind}_calls"] += 1
            self.totals[f"{kind}_s"] += total
            if kind == "decode":
                self.totals["decode_rows"] += len(rows)
                self.totals["decode_build_s"] += total - device
                self.totals["decode_rows_padded"] += shape.tokens
                key = f"{shape.tokens}t"
                self.buckets[key] = self.buckets.get(key, 0) + 1
            else:  # prompt chunks, and decodes beside them
                self.totals["prefill_tokens"] += tokens
                self.totals["prefill_tokens_padded"] += shape.tokens
            return pending

        def collect(pending: Any) -> Any:
            t = clock()
            result = orig_collect(pending)
            wait = clock() - t  # the host waiting for the device
            self.totals["device_s"] += wait
            self.totals[f"{kinds.pop(id(pending))}_s"] += wait
            return result

        sched.schedule = schedule
        runner.dispatch, runner.collect = dispatch, collect

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0
        self.buckets.clear()


@dataclasses.dataclass
class PassResult:
    records: list[RequestRecord]
    timeline: dict[str, list[float]]
    wall_s: float
    monitor_s: float  # engine.stats() sampling between steps
    cpu_s: float  # this process's user + system CPU time during the pass


TIMELINE_KEYS = ("running", "waiting", "blocks_used", "utilization", "fragmentation",
                 "tokens_stored")  # fmt: skip


def serve_pass(
    engine: Any, workload: workloads.Workload, *, temperature: float, label: str = "",
    progress: bool = True,
) -> PassResult:  # fmt: skip
    """Add each request at its arrival time and step the engine until all finish, sampling
    `engine.stats()` after every step."""
    from tqdm import tqdm

    from jpaged.engine.sampling import SamplingParams

    reqs = [
        engine.prepare(list(w.prompt_ids), SamplingParams(
            max_tokens=w.max_tokens, temperature=temperature, ignore_eos=True, seed=i))
        for i, w in enumerate(workload.requests)
    ]  # fmt: skip
    order = sorted(range(len(reqs)), key=lambda i: workload.requests[i].arrival_s)
    records = [RequestRecord(arrival=0.0) for _ in reqs]
    index = {r.id: i for i, r in enumerate(reqs)}
    timeline: dict[str, list[float]] = {"t": [], **{k: [] for k in TIMELINE_KEYS}}

    def sample(now: float) -> None:
        s = engine.stats()
        timeline["t"].append(now)
        timeline["running"].append(s["running"])
        timeline["waiting"].append(s["waiting"])
        for k in TIMELINE_KEYS[2:]:
            timeline[k].append(s[f"kv_{k}"])

    monitor_s = 0.0
    cpu0 = os.times()
    bar = tqdm(total=len(reqs), desc=label, unit="req", disable=not progress)
    start = time.perf_counter()
    sample(0.0)
    nxt = done = 0
    while done < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(order) and workload.requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            records[i].arrival = now
            engine.add(reqs[i])
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.requests[order[nxt]].arrival_s - now))
            continue
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            rec = records[index[out.request_id]]
            rec.token_times += [now] * len(out.token_ids)
            rec.tokens += len(out.token_ids)
            if out.finished:
                rec.finish = now
                rec.error = out.error if out.finish_reason == "error" else None
                done += 1
                bar.update(1)
        m0 = time.perf_counter()
        sample(now)
        monitor_s += time.perf_counter() - m0
    wall_s = time.perf_counter() - start
    cpu1 = os.times()
    bar.close()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return PassResult(records, timeline, wall_s, monitor_s, cpu_s)


class InProcessTarget:
    """One configuration in this process: a fresh engine, warmed up off the clock
    (`warm_up`), then any number of measured passes (`measure`).

    `warmup='workload'` serves the workload once unmeasured (with fresh prompt ids, so
    a prefix cache has nothing to reuse) instead of compiling every bucket; only the
    shapes it uses get compiled, and a measured pass must compile none.
    """

    def __init__(
        self, model: Any, cfg: BenchConfig, *, warmup: str, temperature: float,
        progress: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.cfg, self.warmup = model, cfg, warmup
        self.temperature, self.progress = temperature, progress
        self.counter = CompileCounter()
        self.engine: Any = None
        self.warmup_s = 0.0

    def warm_up(self, workload: workloads.Workload) -> None:
        cfg, warmup = self.cfg, self.warmup
        t = time.perf_counter()
        mode = "engine" if warmup == "engine" else "none"
        engine = self.engine = build_engine(self.model, cfg.engine_config(), mode)
        if warmup == "workload":
            warm = workload.with_fresh_tokens(seed=1, vocab_size=self.model.config.vocab_size)
            serve_pass(engine, warm, temperature=self.temperature,
                       label=f"{cfg.label} warm-up pass", progress=self.progress)  # fmt: skip
            engine.warmup_compilations = engine.runner.compilations
        self.warmup_s = time.perf_counter() - t
        self.kv_bytes = int(engine.runner.kv.nbytes)
        self.blocks_total = int(engine.cache.num_blocks - 1)
        print(f"{cfg.label}: KV pool {self.kv_bytes:,} bytes ({self.kv_bytes / 2**20:.1f} MiB, "
              f"{engine.cache.num_blocks} blocks x {cfg.block_size} tokens incl. the null "
              f"block); warm-up ({warmup}) {self.warmup_s:.1f} s", flush=True)  # fmt: skip
        self.profiler = StepProfiler(engine)

    def measure(self, workload: workloads.Workload) -> dict[str, Any]:
        engine, cfg, profiler = self.engine, self.cfg, self.profiler
        load_before = loadavg()
        profiler.reset()
        stats0 = engine.stats()
        compiles0 = self.counter.count
        run = serve_pass(engine, workload, temperature=self.temperature, label=cfg.label,
                         progress=self.progress)  # fmt: skip
        final = engine.stats()
        stats = {
            "preemptions": final["preemptions"] - stats0["preemptions"],
            "compilations_after_warmup": final["compilations_after_warmup"],
        }
        result = summarize(run.records, run.timeline, run.wall_s, stats,
                           blocks_total=self.blocks_total)  # fmt: skip
        steps = final["steps"] - stats0["steps"]
        step_s = final["step_s"] - stats0["step_s"]
        device_s = final["device_s"] - stats0["device_s"]
        host_s = final["host_s"] - stats0["host_s"]
        p = profiler.totals
        result |= {
            "label": cfg.label,
            "backend": cfg.backend,
            "config": dataclasses.asdict(cfg),
            "mode": "in-process",
            "warmup": self.warmup,
            "warmup_s": self.warmup_s,
            "kv_bytes": self.kv_bytes,
            "compilations_in_run": self.counter.count - compiles0,
            # random prompts: a prefix cache (paged default) must find nothing to reuse
            "prefix_cache_hit_tokens": final.get("kv_prefix_cache_hits", 0)
            - stats0.get("kv_prefix_cache_hits", 0),
            "steps": int(steps),
            **per_step_ms(steps, step_s, device_s, host_s),
            "host_share": (step_s - device_s) / step_s if step_s else float("nan"),
            "time_breakdown_s": {
                "steps": step_s,
                "schedule": p["schedule_s"],
                "batch_build": p["build_s"],
                "device": p["device_s"],
                "outputs_and_rest": step_s - p["schedule_s"] - p["build_s"] - p["device_s"],
                "stats_sampling_outside_steps": run.monitor_s,
            },
            "decode_calls": int(p["decode_calls"]),
            "decode_s": p["decode_s"],
            "prefill_calls": int(p["prefill_calls"]),
            "prefill_s": p["prefill_s"],
            "decode_row_fill": p["decode_rows"] / max(p["decode_rows_padded"], 1),
            "prefill_token_fill": p["prefill_tokens"] / max(p["prefill_tokens_padded"], 1),
            "decode_buckets": dict(sorted(profiler.buckets.items(), key=lambda kv: -kv[1])),
            "decode_rows_mean": p["decode_rows"] / max(p["decode_calls"], 1),
            "decode_call_ms_mean": 1e3 * p["decode_s"] / max(p["decode_calls"], 1),
            "decode_build_ms_mean": 1e3 * p["decode_build_s"] / max(p["decode_calls"], 1),
            "cpu_s": run.cpu_s,
            "output_tok_per_cpu_s": result["generated_tokens"] / max(run.cpu_s, 1e-9),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "timeline": run.timeline,
        }
        return result

    def close(self) -> None:
        self.engine = None


def run_in_process(
    model: Any, cfg: BenchConfig, workload: workloads.Workload, *, warmup: str,
    temperature: float, progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One configuration, warmed up, measured once."""
    target = InProcessTarget(model, cfg, warmup=warmup, temperature=temperature,
                             progress=progress)  # fmt: skip
    target.warm_up(workload)
    try:
        return target.measure(workload)
    finally:
        target.close()


def run_interleaved(
    targets: list[Any], workload: workloads.Workload, repeat: int, *, vocab_size: int
) -> list[dict[str, Any]]:
    """Warm every target up, then `repeat` rounds of one measured pass per target, in
    turn, so that slow drifts of a shared machine's load hit every configuration alike.
    Round r > 0 uses fresh prompt ids (same lengths and arrivals). Each configuration's
    reported run is its median-throughput pass; all passes are kept under `reps`."""
    passes: list[list[dict[str, Any]]] = [[] for _ in targets]
    try:  # a target that fails to warm up must not leave the others' servers running
        for t in targets:
            t.warm_up(workload)
        for r in range(repeat):
            w = workload if r == 0 else workload.with_fresh_tokens(100 + r, vocab_size)
            for t, out in zip(targets, passes, strict=True):
                out.append(t.measure(w))
    finally:
        for t in targets:
            t.close()
    results = []
    for out in passes:
        order = sorted(range(len(out)), key=lambda i: out[i]["output_tok_s"])
        median = dict(out[order[(len(out) - 1) // 2]])
        median["reps"] = [
            {k: v for k, v in o.items() if k not in ("timeline", "config", "reps")} for o in out
        ]
        median["output_tok_s_reps"] = [o["output_tok_s"] for o in out]
        median["compilations_after_warmup"] = max(o["compilations_after_warmup"] for o in out)
        median["compilations_in_run"] = max(o["compilations_in_run"] for o in out)
        results.append(median)
    return results


# -------------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("jpaged_"):
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name.removeprefix("jpaged_")] = float(value)
    return out


class ServerProcess:
    """`python -m server` on 127.0.0.1 and a free port; stopped (by its own pid) on exit."""

    def __init__(self, model_path: Path, cfg: BenchConfig, *, warmup: bool) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="jpaged-bench-server-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "server", "--model", str(model_path), "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *cfg.server_flags()]  # fmt: skip
        if not warmup:
            cmd.append("--no-warmup")
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(HERE.parent)
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
    url: str, workload: workloads.Workload, temperature: float, *, progress: bool, label: str,
    poll_s: float = 0.05,
) -> tuple[list[RequestRecord], dict[str, list[float]], float]:  # fmt: skip
    import httpx
    from tqdm import tqdm

    records = [RequestRecord(arrival=0.0) for _ in workload.requests]
    keys = TIMELINE_KEYS
    timeline: dict[str, list[float]] = {"t": [], **{k: [] for k in keys}}
    bar = tqdm(total=len(records), desc=label, unit="req", disable=not progress)
    limits = httpx.Limits(max_connections=len(records) + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        finished = asyncio.Event()

        async def one(i: int, w: workloads.WorkloadRequest) -> None:
            await asyncio.sleep(max(0.0, w.arrival_s - (time.perf_counter() - start)))
            rec = records[i]
            rec.arrival = time.perf_counter() - start
            body = {"prompt": list(w.prompt_ids), "max_tokens": w.max_tokens,
                    "temperature": temperature, "ignore_eos": True, "seed": i, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
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
                    for k in keys[2:]:
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
        self, model_path: Path, cfg: BenchConfig, *, warmup: str, temperature: float,
        progress: bool = True, ready_timeout: float = 1800,
    ) -> None:  # fmt: skip
        self.model_path, self.cfg, self.warmup = model_path, cfg, warmup
        self.temperature, self.progress, self.ready_timeout = temperature, progress, ready_timeout
        self.server: ServerProcess | None = None

    def warm_up(self, workload: workloads.Workload) -> None:
        import httpx

        cfg = self.cfg
        server = self.server = ServerProcess(self.model_path, cfg, warmup=self.warmup == "engine")
        start_s = server.wait_ready(self.ready_timeout)
        first = parse_metrics(httpx.get(server.url + "/metrics").text)
        self.blocks_total = int(first.get("kv_blocks_total", 0))
        self.kv_bytes = (self.blocks_total + 1) * kv_block_bytes(self.model_path, cfg)
        print(f"{cfg.label} (server {server.url}): KV pool {self.kv_bytes:,} bytes "
              f"({self.kv_bytes / 2**20:.1f} MiB, {self.blocks_total + 1} blocks x "
              f"{cfg.block_size} tokens incl. the null block); ready after {start_s:.1f} s",
              flush=True)  # fmt: skip
        warm_pass_s = 0.0
        if self.warmup != "engine":  # send the workload once
            t = time.perf_counter()
            hf = json.loads((self.model_path / "config.json").read_text())
            warm = workload.with_fresh_tokens(seed=1, vocab_size=hf.get("vocab_size", 32000))
            asyncio.run(_drive(server.url, warm, self.temperature, progress=self.progress,
                               label=f"{cfg.label} warm-up pass"))  # fmt: skip
            warm_pass_s = time.perf_counter() - t
        self.warmup_s = start_s + warm_pass_s
        self.compilations_at_warmup = parse_metrics(httpx.get(server.url + "/metrics").text).get(
            "compilations", 0.0
        )

    def measure(self, workload: workloads.Workload) -> dict[str, Any]:
        import httpx

        cfg, server = self.cfg, self.server
        assert server is not None, "warm_up first"
        load_before = loadavg()
        before = parse_metrics(httpx.get(server.url + "/metrics").text)
        cpu0 = _proc_cpu_s(server.proc.pid)
        records, timeline, wall = asyncio.run(
            _drive(
                server.url, workload, self.temperature, progress=self.progress, label=cfg.label
            )  # fmt: skip
        )
        cpu_s = _proc_cpu_s(server.proc.pid) - cpu0
        final = parse_metrics(httpx.get(server.url + "/metrics").text)
        stats = {
            "preemptions": final.get("preemptions", 0) - before.get("preemptions", 0),
            "compilations_after_warmup": final.get("compilations", 0) - self.compilations_at_warmup,
        }
        result = summarize(records, timeline, wall, stats, blocks_total=self.blocks_total)
        steps = final.get("steps", 0) - before.get("steps", 0)
        step_s = final.get("step_s", 0) - before.get("step_s", 0)
        device_s = final.get("device_s", 0) - before.get("device_s", 0)
        host_s = final.get("host_s", 0) - before.get("host_s", 0)
        result |= {
            "label": cfg.label,
            "backend": cfg.backend,
            "config": dataclasses.asdict(cfg),
            "mode": "server",
            "warmup": "engine" if self.warmup == "engine" else "workload pass",
            "warmup_s": self.warmup_s,
            "kv_bytes": self.kv_bytes,
            "compilations_in_run": int(
                final.get("compilations", 0) - before.get("compilations", 0)
            ),
            "prefix_cache_hit_tokens": final.get("kv_prefix_cache_hits", 0)
            - before.get("kv_prefix_cache_hits", 0),
            "steps": int(steps),
            **per_step_ms(steps, step_s, device_s, host_s),
            "host_share": (step_s - device_s) / step_s if step_s else float("nan"),
            "cpu_s": cpu_s,  # the server process only (the clients run here)
            "output_tok_per_cpu_s": result["generated_tokens"] / cpu_s if cpu_s > 0 else None,
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "errors": [r.error for r in records if r.error][:5],
            "timeline": timeline,
        }
        return result

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def run_through_server(
    model_path: Path, cfg: BenchConfig, workload: workloads.Workload, *, warmup: str,
    temperature: float, progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One configuration as a server, warmed up, measured once."""
    target = ServerTarget(model_path, cfg, warmup=warmup, temperature=temperature,
                          progress=progress)  # fmt: skip
    try:
        target.warm_up(workload)
        return target.measure(workload)
    finally:
        target.close()


def kv_block_bytes(path: Path, cfg: BenchConfig) -> int:
    """Bytes of one KV block (all layers, K and V) of a checkpoint, as the engine sizes it."""
    from jpaged.cache.kv_pool import block_bytes
    from models.loader import family_for

    hf = json.loads((path / "config.json").read_text())
    c = family_for(hf, str(path)).model_config(hf)
    return block_bytes(c.num_layers, c.num_kv_heads, cfg.block_size, c.head_dim, cfg.dtype)


# -------------------------------------------------------------------------------- report

ROWS: list[tuple[str, str, str]] = [
    ("KV bytes allocated", "kv_bytes", ","),
    ("warm-up (s, excluded)", "warmup_s", ".1f"),
    ("completed requests", "completed", ""),
    ("generated tokens", "generated_tokens", ""),
    ("wall time (s)", "wall_s", ".1f"),
    ("output tok/s", "output_tok_s", ".1f"),
    ("output tok/s, every pass", "output_tok_s_reps", "list"),
    ("output tok per CPU-second", "output_tok_per_cpu_s", ".1f"),
    ("request throughput (req/s)", "request_throughput", ".3f"),
    ("TTFT p50 (ms)", "ttft_p50_ms", ".0f"),
    ("TTFT p99 (ms)", "ttft_p99_ms", ".0f"),
    ("per-token latency p50 (ms)", "itl_p50_ms", ".1f"),
    ("per-token latency p99 (ms)", "itl_p99_ms", ".1f"),
    ("peak concurrent running seqs", "peak_running", ""),
    ("peak KV blocks used", "peak_blocks", ""),
    ("KV utilization at peak", "utilization_at_peak", ".1%"),
    ("internal fragmentation at peak", "fragmentation_at_peak", ".1%"),
    ("preemptions", "preemptions", ""),
    ("compilations after warm-up", "compilations_after_warmup", ""),
    ("engine ms/step", "step_ms_mean", ".2f"),
    ("device ms/step", "device_ms_per_step", ".2f"),
    ("host ms/step", "host_ms_per_step", ".2f"),
    ("host share of step time", "host_share", ".1%"),
]


def table(runs: list[dict[str, Any]]) -> str:
    header = ["metric", *(r["label"] for r in runs)]
    rows = []
    for name, key, spec in ROWS:
        if spec == "list" and all(len(r.get(key, [])) < 2 for r in runs):
            continue  # one pass each: the row above says it
        cells = []
        for r in runs:
            if spec == "list":
                cells.append(" / ".join(f"{v:.0f}" for v in r.get(key, [])))
            elif key == "peak_blocks":
                cells.append(f"{r['peak_blocks_used']} / {r['blocks_total']}")
            elif spec == ",":
                cells.append(f"{r[key]:,}")
            else:
                cells.append(fmt(r.get(key), spec) if spec else fmt(r.get(key)))
        rows.append([name, *cells])
    return render_table(header, rows)


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = next((r for r in runs if r["backend"] == "contiguous"), None)
    if base is None:
        return []
    out = []
    for r in runs:
        if r["backend"] != "paged":
            continue
        per_round = [
            p / c
            for p, c in zip(
                r.get("output_tok_s_reps", [r["output_tok_s"]]),
                base.get("output_tok_s_reps", [base["output_tok_s"]]),
                strict=False,
            )
        ]
        out.append({
            "paged": r["label"], "contiguous": base["label"],
            "peak_running_x": r["peak_running"] / max(base["peak_running"], 1),
            "output_tok_s_x": r["output_tok_s"] / base["output_tok_s"],
            # pass by pass within a round (same machine load, roughly), then the median
            "output_tok_s_x_per_round": per_round,
            "output_tok_s_x_median_of_rounds": float(np.median(per_round)),
            "output_tok_per_cpu_s_x": ((r.get("output_tok_per_cpu_s") or float("nan"))
                                       / (base.get("output_tok_per_cpu_s") or float("nan"))),
            "same_kv_bytes": r["kv_bytes"] == base["kv_bytes"],
        })  # fmt: skip
    return out


def targets(runs: list[dict[str, Any]], rat: list[dict[str, Any]]) -> list[str]:
    lines = []
    for q in rat:
        if len(q.get("output_tok_s_x_per_round", [])) > 1:
            rounds = ", ".join(f"{x:.2f}" for x in q["output_tok_s_x_per_round"])
            median = q["output_tok_s_x_median_of_rounds"]
            lines.append(f"{q['paged']} / {q['contiguous']} output tok/s round by round: "
                         f"{rounds} (median {median:.2f})")  # fmt: skip
        lines.append(f"{q['paged']} vs {q['contiguous']}: peak running x{q['peak_running_x']:.2f} "
                     f"(target >= 3: {'PASS' if q['peak_running_x'] >= 3 else 'FAIL'}), "
                     f"output tok/s x{q['output_tok_s_x']:.2f} "
                     f"(target >= 1.5: {'PASS' if q['output_tok_s_x'] >= 1.5 else 'FAIL'}), "
                     f"same KV bytes: {q['same_kv_bytes']}")  # fmt: skip
    for r in runs:
        if r["backend"] == "paged":
            u = r["utilization_at_peak"]
            lines.append(f"{r['label']}: KV utilization at peak {u:.1%} "
                         f"(target >= 95%: {'PASS' if u >= 0.95 else 'FAIL'})")  # fmt: skip
    zero = all(r["compilations_after_warmup"] == 0 for r in runs)
    lines.append(f"compilations after warm-up: "
                 f"{[r['compilations_after_warmup'] for r in runs]} "
                 f"(target 0 everywhere: {'PASS' if zero else 'FAIL'})")  # fmt: skip
    return lines


def breakdown(runs: list[dict[str, Any]]) -> str:
    """Where step time goes (in-process runs only)."""
    rows = []
    for r in runs:
        b = r.get("time_breakdown_s")
        if not b:
            continue
        steps = max(b["steps"], 1e-9)
        rows.append([
            r["label"], f"{r['steps']}", f"{r['step_ms_mean']:.1f}",
            f"{b['schedule'] / steps:.1%}", f"{b['batch_build'] / steps:.1%}",
            f"{b['device'] / steps:.1%}", f"{b['outputs_and_rest'] / steps:.1%}",
            f"{r['decode_rows_mean']:.1f}", f"{r['decode_call_ms_mean']:.1f}",
            f"{r['decode_build_ms_mean']:.2f}",
            f"{1e3 * b['stats_sampling_outside_steps'] / max(r['steps'], 1):.2f}",
        ])  # fmt: skip
    if not rows:
        return ""
    header = ["config", "steps", "ms/step", "schedule", "batch build", "device",
              "outputs+rest", "rows/decode", "ms/decode call", "build ms/decode",
              "stats() ms/step"]  # fmt: skip
    first = render_table(header, rows)
    rows = []
    for r in runs:
        if "decode_s" not in r:
            continue
        steps = max(r["time_breakdown_s"]["steps"], 1e-9)
        buckets = r.get("decode_buckets", {})
        common = ", ".join(f"{k}:{v}" for k, v in list(buckets.items())[:3])
        common += f" ({len(buckets)} in all)"
        rows.append([
            r["label"], f"{r['decode_s']:.1f} ({r['decode_s'] / steps:.0%})",
            f"{r['prefill_s']:.1f} ({r['prefill_s'] / steps:.0%})",
            f"{r['decode_row_fill']:.0%}", f"{r['prefill_token_fill']:.0%}", common,
        ])  # fmt: skip
    header = [
        "config",
        "decode-only steps s",
        "steps with prompts s",
        "decode token fill",
        "token fill with prompts",
        "commonest decode-only buckets (tokens: calls)",
    ]
    return (
        first + "\n\nwhere the device time goes (fill = real / padded work of the shape "
        "buckets):\n" + render_table(header, rows)
    )


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [3, 3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, c in zip(runs, colors, strict=False):
        tl = r["timeline"]
        axes[0].step(tl["t"], tl["running"], where="post", color=c, label=r["label"])
        axes[1].step(tl["t"], tl["blocks_used"], where="post", color=c, label=r["label"])
    if runs:
        axes[1].axhline(runs[0]["blocks_total"], color="gray", ls="--", lw=1,
                        label="KV blocks in the pool")  # fmt: skip
    axes[0].set(xlabel="time (s)", ylabel="running sequences", title="running sequences")
    axes[1].set(xlabel="time (s)", ylabel="KV blocks used (allocated)",
                title="KV blocks used (same KV bytes)")  # fmt: skip
    for ax in axes[:2]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    labels = [r["label"] for r in runs]
    tps = [r["output_tok_s"] for r in runs]
    bars = axes[2].bar(labels, tps, color=colors[: len(runs)])
    for bar, r in zip(bars, runs, strict=True):
        axes[2].annotate(f"{r['output_tok_s']:.0f} tok/s\npeak {r['peak_running']} seqs",
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=8)  # fmt: skip
    axes[2].set(ylabel="output tok/s", title="throughput")
    axes[2].set_ylim(0, max(tps, default=1) * 1.3)
    axes[2].tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# -------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="bench",
        help="Hugging Face checkpoint directory (in process also a .gguf file), or 'bench' "
        "for the cached ~57M random Llama",
    )
    p.add_argument("--backend", choices=("paged", "contiguous", "both"), default="both")
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default="paged_attention")
    p.add_argument("--num-requests", type=int, help="default: 48 for every workload")
    p.add_argument("--rate", type=float, default=2.0, help="poisson: requests per second")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--through-server",
        action="store_true",
        help="drive a real `python -m server` over HTTP/SSE instead of the engine",
    )
    p.add_argument("--contiguous-batch-size", type=int, default=8)
    p.add_argument(
        "--paged-batch-sizes",
        default="24,48",
        help="comma-separated max_batch_size values for the paged runs",
    )
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="weights and KV cache; auto = bfloat16 on a GPU, float32 elsewhere (bfloat16 "
        "matmuls are slow on XLA's CPU backend)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (vLLM's default)")
    p.add_argument(
        "--warmup",
        choices=("workload", *WARMUP_MODES),
        default="workload",
        help="workload: an unmeasured pass of the workload (compiles the buckets it uses); "
        "engine: the engine's own warm-up (compiles and runs every bucket)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="JSON of raw numbers (default benchmarks/results/serving_<workload>.json)",
    )
    p.add_argument(
        "--plot", type=Path, help="PNG (default benchmarks/serving_<workload>.png); 'none' to skip"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measured passes per configuration, interleaved across them; the "
        "median-throughput pass is reported, every pass is kept in the JSON",
    )
    p.add_argument(
        "--pool-scan",
        metavar="BLOCKS",
        help="comma-separated paged pool sizes (usable blocks, e.g. 1024,16384): time the same "
        "requests at each instead of comparing backends",
    )
    p.add_argument("--scan-requests", type=int, default=32, help="pool scan: requests (= rows)")
    p.add_argument("--scan-prompt-len", type=int, default=100, help="pool scan: prompt tokens")
    p.add_argument("--scan-max-tokens", type=int, default=64, help="pool scan: new tokens")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    from benchmarks import bench_model

    args.dtype = concrete_dtype(args.dtype)  # once: configs, servers and the report agree
    if args.pool_scan:
        return pool_scan_main(args)
    paged_batches = tuple(int(b) for b in args.paged_batch_sizes.split(",") if b)
    configs = matched_configs(
        args.backend, contiguous_batch=args.contiguous_batch_size, paged_batches=paged_batches,
        max_seq_len=args.max_seq_len, block_size=args.block_size, dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    model_path = bench_model.resolve(args.model)
    model: Any = None
    if args.through_server:
        if not (model_path / "config.json").is_file():  # sizes the pool and the vocab
            parser.error(f"--through-server needs a checkpoint directory: {model_path}")
        vocab = json.loads((model_path / "config.json").read_text()).get("vocab_size", 32000)
    else:
        import models

        model = models.load(model_path, dtype=args.dtype)  # a directory or a .gguf
        vocab = model.config.vocab_size
    workload = workloads.make(args.workload, args.num_requests, seed=args.seed, vocab_size=vocab,
                              max_seq_len=args.max_seq_len, rate=args.rate)  # fmt: skip
    info = machine_info()
    print(machine_line(info))
    print(f"model: {model_path} ({args.dtype}); workload: {workload.description}")
    progress = not args.no_progress
    targets: list[Any]
    if args.through_server:
        targets = [
            ServerTarget(model_path, cfg, warmup=args.warmup, temperature=args.temperature,
                         progress=progress)
            for cfg in configs
        ]  # fmt: skip
    else:
        targets = [
            InProcessTarget(model, cfg, warmup=args.warmup, temperature=args.temperature,
                            progress=progress)
            for cfg in configs
        ]  # fmt: skip
    runs = run_interleaved(targets, workload, args.repeat, vocab_size=vocab)
    mode = "server" if args.through_server else "in-process"
    report = {"machine": info, "model": str(model_path), "workload": workload.summary(),
              "mode": mode, "dtype": args.dtype, "block_size": args.block_size,
              "repeat": args.repeat, "runs": runs, "ratios": ratios(runs)}  # fmt: skip
    suffix = f"{args.workload}{'_server' if args.through_server else ''}"
    out = args.out or RESULTS_DIR / f"serving_{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:  # 4 decimals are plenty for a plot, and halve the file
        r["timeline"] = {k: [round(float(v), 4) for v in vs] for k, vs in r["timeline"].items()}
    out.write_text(json.dumps(report, indent=1, default=float))
    png = args.plot or HERE / f"serving_{suffix}.png"
    if str(png).lower() == "none":
        png = None
    show(report, png)
    print(f"raw numbers: {out}")
    return report


def show(report: dict[str, Any], png: Path | None) -> None:
    """Print the table, target checks and time breakdown of a report; write its plot."""
    runs, w = report["runs"], report["workload"]
    print(f"\n## {w['name']} ({report['mode']}, {w['num_requests']} requests, "
          f"block {report.get('block_size', 16)}, {report.get('dtype', 'float32')})")  # fmt: skip
    print(table(runs))
    print()
    for line in targets(runs, report["ratios"]):
        print(line)
    bd = breakdown(runs)
    if bd:
        print("\nstep time breakdown (share of engine step time):")
        print(bd)
    if png is not None:
        plot(runs, png, f"{w['description']} — {report['mode']}, same KV bytes "
                        f"({runs[0]['kv_bytes'] / 2**20:.0f} MiB)")  # fmt: skip
        print(f"plot: {png}")


# -------------------------------------------------------------------------------- pool scan


def pool_scan(
    model: Any, pool_sizes: list[int], *, dtype: str, num_requests: int = 32,
    prompt_len: int = 100, max_tokens: int = 64, block_size: int = 16, max_seq_len: int = 4096,
    max_num_batched_tokens: int = 512, seed: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """The same requests on a paged pool of each size (usable blocks): all rows decode
    together, greedy, EOS ignored, prefix caching off (a warm pass would fill it); a warm
    pass compiles, the timed pass is reported from the engine's own step counters."""
    from jpaged.cache.kv_pool import block_bytes
    from jpaged.config import EngineConfig
    from jpaged.engine.sampling import SamplingParams

    c = model.config
    rng = np.random.default_rng(seed)
    # ids of ordinary tokens: low ids are often specials, and big vocabularies are sparse there
    prompts = rng.integers(3, min(c.vocab_size, 3000), (num_requests, prompt_len)).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def serve_all(engine: Any) -> int:
        for prompt in prompts:
            engine.add(engine.prepare(prompt, params))
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(out.token_ids) for out in engine.step())
        return tokens

    runs = []
    for blocks in pool_sizes:
        config = EngineConfig(
            backend="paged", max_batch_size=num_requests, max_seq_len=max_seq_len,
            block_size=block_size, num_blocks=blocks, dtype=dtype,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
            max_waiting_requests=max(num_requests, 1),
        )  # fmt: skip
        engine = build_engine(model, config, "none")
        serve_all(engine)  # warm pass: compiles the buckets the timed pass uses
        before, t = engine.stats(), time.perf_counter()
        tokens = serve_all(engine)
        wall_s, after = time.perf_counter() - t, engine.stats()
        d = {k: after[k] - before[k] for k in ("steps", "step_s", "device_s", "host_s",
                                               "compilations", "preemptions")}  # fmt: skip
        kv_bytes = (blocks + 1) * block_bytes(c.num_layers, c.num_kv_heads, block_size,
                                              c.head_dim, dtype)  # fmt: skip
        runs.append({
            "num_blocks": blocks, "kv_bytes": kv_bytes, "steps": int(d["steps"]),
            "generated_tokens": tokens, "wall_s": wall_s, "output_tok_s": tokens / wall_s,
            "wall_ms_per_step": 1e3 * wall_s / max(d["steps"], 1),
            **per_step_ms(d["steps"], d["step_s"], d["device_s"], d["host_s"]),
            "compilations_in_run": int(d["compilations"]), "preemptions": int(d["preemptions"]),
        })  # fmt: skip
        r = runs[-1]
        print(f"pool {blocks} blocks ({kv_bytes / 2**20:.0f} MiB): {r['steps']} steps, "
              f"{r['step_ms_mean']:.2f} ms/step (device {r['device_ms_per_step']:.2f}, "
              f"host {r['host_ms_per_step']:.2f})", flush=True)  # fmt: skip
        del engine  # its pool goes before the next one is made
    return runs


SCAN_ROWS: list[tuple[str, str, str]] = [
    ("KV pool MiB", "kv_mib", ".0f"),
    ("steps (timed pass)", "steps", ""),
    ("engine ms/step", "step_ms_mean", ".2f"),
    ("device ms/step", "device_ms_per_step", ".2f"),
    ("host ms/step", "host_ms_per_step", ".2f"),
    ("wall ms/step", "wall_ms_per_step", ".2f"),
    ("output tok/s", "output_tok_s", ".0f"),
    ("compilations in timed pass", "compilations_in_run", ""),
    ("preemptions", "preemptions", ""),
]


def pool_scan_main(args: argparse.Namespace) -> dict[str, Any]:
    """`--pool-scan B1,B2,...`: print the scan's table and ratios; write its JSON."""
    import models
    from benchmarks import bench_model

    if args.through_server:
        raise SystemExit("--pool-scan runs in process; leave out --through-server")
    sizes = sorted({int(b) for b in args.pool_scan.split(",") if b})
    model_path = bench_model.resolve(args.model)
    info = machine_info()
    print(machine_line(info))
    print(f"model: {model_path} ({args.dtype}); pool scan over {sizes} blocks of "
          f"{args.block_size}: {args.scan_requests} prompts x {args.scan_prompt_len} tokens, "
          f"{args.scan_max_tokens} new tokens each, greedy, prefix caching off")  # fmt: skip
    model = models.load(model_path, dtype=args.dtype)
    runs = pool_scan(
        model, sizes, dtype=args.dtype, num_requests=args.scan_requests,
        prompt_len=args.scan_prompt_len, max_tokens=args.scan_max_tokens,
        block_size=args.block_size, max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
    )  # fmt: skip
    small, large = runs[0], runs[-1]
    ratio = {k: large[k] / small[k] if small[k] else float("nan")
             for k in ("step_ms_mean", "device_ms_per_step", "wall_ms_per_step")}  # fmt: skip
    report = {"machine": info, "model": str(model_path), "mode": "pool-scan",
              "dtype": args.dtype, "block_size": args.block_size,
              "requests": {"num_requests": args.scan_requests,
                           "prompt_len": args.scan_prompt_len,
                           "max_tokens": args.scan_max_tokens},
              "runs": runs, "ratio_largest_to_smallest": ratio}  # fmt: skip
    out = args.out or RESULTS_DIR / "pool_scan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    rows = [
        [name, *(fmt(r["kv_bytes"] / 2**20 if key == "kv_mib" else r[key], spec or "")
                 for r in runs)]
        for name, key, spec in SCAN_ROWS
    ]  # fmt: skip
    print(f"\n## pool scan ({args.dtype}, block {args.block_size})")
    print(render_table(["metric", *(f"{r['num_blocks']} blocks" for r in runs)], rows))
    x, dev, wall = (ratio[k] for k in ("step_ms_mean", "device_ms_per_step", "wall_ms_per_step"))
    print(f"\n{large['num_blocks']} / {small['num_blocks']} blocks: engine ms/step x{x:.2f} "
          f"(target <= 1.1: {'PASS' if x <= 1.1 else 'FAIL'}), device ms/step x{dev:.2f}, "
          f"wall ms/step x{wall:.2f}")  # fmt: skip
    print(f"raw numbers: {out}")
    return report


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
    import models
    from benchmarks import bench_model
    from jpaged.engine.runner import Row

    model = models.load(bench_model.resolve(args.model), dtype=args.dtype)
    cfg = matched_configs("paged", paged_batches=(48,), dtype=args.dtype)[0]
    engine = build_engine(model, cfg.engine_config(), "none")
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
            table.append([str(b), spec, f"{shape.tokens} tokens", f"{ms:.1f}",
                          f"{ms / b:.2f}"])  # fmt: skip
            print(" | ".join(table[-1]), flush=True)
    print(render_table(["rows", "context", "bucket", "ms/step (median)", "ms/row"], table))
    print(f"load average after: {loadavg():.2f}")


def replot(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.bench_serving --replot JSON [PNG]`: table and plot again."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving --replot")
    p.add_argument("json", type=Path)
    p.add_argument("png", type=Path, nargs="?")
    args = p.parse_args(argv)
    show(json.loads(args.json.read_text()), args.png or HERE / f"{args.json.stem}.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replot"]:
        replot(sys.argv[2:])
    elif sys.argv[1:2] == ["--decode-profile"]:
        decode_profile(sys.argv[2:])
    else:
        main()
