"""What a measured pass reports: request latencies from per-token times, and the engine's
own counters over the pass (deltas of `engine.stats()`, or of `/metrics` over HTTP, which
exports the same names). Both drivers build their result with `pass_result`."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from benchmarks import workloads
from benchmarks.common import loadavg, percentile
from benchmarks.serving.configs import BenchConfig
from jpaged.engine.engine import COUNTERS

TIMELINE_KEYS = (
    "running",
    "waiting",
    "blocks_used",
    "utilization",
    "fragmentation",
    "tokens_stored",
)


@dataclasses.dataclass
class RequestRecord:
    arrival: float  # when it was added / sent, seconds from the run's start
    token_times: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    finish: float | None = None
    error: str | None = None


@dataclasses.dataclass
class PassResult:
    records: list[RequestRecord]
    timeline: dict[str, list[float]]
    wall_s: float
    cpu_s: float  # user + system CPU time of the process that ran the engine
    monitor_s: float | None = None  # in process: engine.stats() sampling between steps


def new_timeline() -> dict[str, list[float]]:
    return {"t": [], **{k: [] for k in TIMELINE_KEYS}}


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
    return {
        "step_ms_mean": 1e3 * step_s / n,
        "device_ms_per_step": 1e3 * device_s / n,
        "host_ms_per_step": 1e3 * host_s / n,
    }


def pass_result(
    cfg: BenchConfig,
    run: PassResult,
    before: dict[str, float],
    after: dict[str, float],
    *,
    mode: str,
    warmup: str,
    warmup_s: float,
    kv_bytes: int,
    blocks_total: int,
    compilations_at_warmup: float,
    load_before: float,
    **extra: Any,
) -> dict[str, Any]:
    """One measured pass: the requests' metrics, and the engine's counters `before` and
    `after` it (their growth; `compilations_at_warmup`: the engine's compilation count
    when warm-up ended). `extra` adds or overrides fields."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    counts = {
        "preemptions": d["preemptions"],
        "compilations_after_warmup": after.get("compilations", 0.0) - compilations_at_warmup,
    }
    result = summarize(run.records, run.timeline, run.wall_s, counts, blocks_total=blocks_total)
    step_s, device_s = d["step_s"], d["device_s"]
    tokens = result["generated_tokens"]
    result |= {
        "label": cfg.label,
        "backend": cfg.backend,
        "config": dataclasses.asdict(cfg),
        "mode": mode,
        "warmup": warmup,
        "warmup_s": warmup_s,
        "kv_bytes": kv_bytes,
        "kv_bytes_per_device": kv_bytes // (cfg.tensor_parallel * cfg.data_parallel),
        "compilations_in_run": int(d["compilations"]),
        # random prompts: a prefix cache (paged default) must find nothing to reuse
        "prefix_cache_hit_tokens": d["kv_prefix_cache_hits"],
        "steps": int(d["steps"]),
        **per_step_ms(d["steps"], step_s, device_s, d["host_s"]),
        "host_share": (step_s - device_s) / step_s if step_s else float("nan"),
        "time_breakdown_s": {
            "steps": step_s,
            "schedule": d["schedule_s"],
            "batch_build": d["build_s"],  # host work inside the runner's dispatch
            "device": device_s,  # dispatching, and waiting for the device's results
            "outputs_and_rest": step_s - d["schedule_s"] - d["build_s"] - device_s,
            "stats_sampling_outside_steps": run.monitor_s,
        },
        # "decode" calls: every row one token; "mixed" calls: prompt chunks
        # among them; padded = the token bucket the runner compiled the call for
        "decode_calls": int(d["decode_calls"]),
        "mixed_calls": int(d["mixed_calls"]),
        "decode_rows_mean": d["decode_tokens"] / max(d["decode_calls"], 1),
        "decode_row_fill": d["decode_tokens"] / max(d["decode_tokens_padded"], 1),
        "mixed_token_fill": d["mixed_tokens"] / max(d["mixed_tokens_padded"], 1),
        "cpu_s": run.cpu_s,
        "output_tok_per_cpu_s": tokens / run.cpu_s if run.cpu_s > 0 else None,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "errors": [r.error for r in run.records if r.error][:5],
        **(
            {}
            if cfg.speculative is None
            else {
                "spec_drafts": d["spec_drafts"],
                "spec_draft_tokens": d["spec_draft_tokens"],
                "spec_accepted_tokens": d["spec_accepted_tokens"],
                "spec_acceptance_rate": d["spec_accepted_tokens"] / max(d["spec_draft_tokens"], 1),
                # tokens a verification emits, the one sampled after the drafts included
                "spec_mean_acceptance_length": 1
                + d["spec_accepted_tokens"] / max(d["spec_drafts"], 1),
            }
        ),
        "timeline": run.timeline,
        **extra,
    }
    return result


class Target(Protocol):
    """One configuration under test: warmed up once, then measured pass by pass."""

    def warm_up(self, workload: workloads.Workload) -> None: ...

    def measure(self, workload: workloads.Workload) -> dict[str, Any]: ...

    def close(self) -> None: ...


def run_interleaved(
    targets: list[Target], workload: workloads.Workload, repeat: int, *, vocab_size: int
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
