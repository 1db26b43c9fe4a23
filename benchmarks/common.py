"""Shared pieces of the serving benchmarks (and of the server tests): machine info, the
server's /metrics, warm-up, stats."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import httpx

# ----------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    import jax
    import jaxlib

    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = float("nan")
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_gib, 1),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "command": " ".join(["python -m " + _module_name(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"machine: {info['nproc']} cores ({info['cpu']}), {info['memory_gib']} GiB, "
        f"JAX {info['jax']} on {info['backend']}, Python {info['python']}"
    )


# ----------------------------------------------------------------------------- /metrics


def parse_metrics(text: str) -> dict[str, float]:
    """The server's Prometheus text (`/metrics`) as {name without `jpaged_`: value}."""
    pairs = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
    return {name.removeprefix("jpaged_"): float(value) for name, value in pairs}


def fetch_metrics(client: httpx.Client) -> dict[str, float]:
    r = client.get("/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


# ----------------------------------------------------------------------------- warm-up

# Measured on this machine: each XLA:CPU step program of the bench model holds ~140
# memory mappings (LLVM code/data sections) for as long as it is cached (a paged b48
# server at max_seq_len 4096: 36,295 after its 205 step + 13 sampler programs).
MAPS_PER_PROGRAM = 150


def program_budget() -> int | None:
    """How many more step programs this process can hold before vm.max_map_count; None
    when unknown or unlimited (off the CPU: the mappings are XLA:CPU's JIT-compiled code)."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return max(0, (limit - used - 2000) // MAPS_PER_PROGRAM)


def check_program_budget(num_programs: int, what: str) -> None:
    """Refuse up front what would make LLVM abort the process mid-compile."""
    budget = program_budget()
    if budget is not None and num_programs > budget:
        raise SystemExit(
            f"{what}: {num_programs} shape buckets to compile, but this process can hold only "
            f"~{budget} more XLA:CPU programs before vm.max_map_count "
            f"(~{MAPS_PER_PROGRAM} mappings each); LLVM would abort with 'Unable to allocate "
            f"section memory'. Use --warmup workload, or fewer buckets."
        )


def build_engine(model: Any, config: Any, *, warmup: bool = False) -> Any:
    """An Engine (or `config.data_parallel` replicas behind a router), warmed up by each
    replica's `Runner.warmup` (every token bucket compiled and run) or not at all; the
    vm.max_map_count guard applies first."""
    import dataclasses

    from jpaged.engine.router import build

    engine = build(model, dataclasses.replace(config, warmup=False))
    if warmup:
        runners = [e.runner for e in engine.replicas]  # each compiles its own programs
        shapes = sum(len(r.warmup_shapes()) for r in runners)
        check_program_budget(shapes, "--warmup engine")
        for r in runners:  # exactly what EngineConfig.warmup=True runs in Engine.__init__
            r.warmup()
        engine.mark_warm()
    return engine


# ----------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and np.isnan(value):
        return "-"
    if isinstance(value, int | np.integer):
        return str(int(value))
    return format(value, spec)


RESULTS = Path(__file__).with_name("RESULTS.md")


def append_results(heading: str, run_text: str) -> None:
    """Append a run under `heading` ("## ...") in RESULTS.md, a new section at the end if
    there is none yet."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = text.find(f"\n{heading}\n")
    if start < 0:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n" + run_text
    else:
        end = text.find("\n## ", start + len(heading) + 2)
        end = len(text) if end < 0 else end + 1
        text = text[:end].rstrip("\n") + "\n\n" + run_text + "\n" + text[end:]
    RESULTS.write_text(text.rstrip("\n") + "\n")


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table (also readable in a terminal)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: (
        "| "
        + " | ".join(  # noqa: E731
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        + " |"
    )
    sep = (
        "| "
        + " | ".join("-" * w if i == 0 else "-" * (w - 1) + ":" for i, w in enumerate(widths))
        + " |"
    )
    return "\n".join([line(header), sep, *(line(r) for r in rows)])
