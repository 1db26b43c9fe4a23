"""Where a served decode step's device time goes, kernel by kernel (`jax.profiler`).

    python -m benchmarks.gpu_check --sections trace --models 1B --users 1,64   # on a GPU

`trace` prefills `users` requests, then serves `steps` decode steps under `jax.profiler.trace`
and reads the trace back (`jax.profiler.ProfileData`): per step, the wall time, the time some
kernel was running (the union of the kernels' intervals: the rest is the device idle,
waiting for launches or for the host), the kernels run, and the kernels that took the most
time, grouped by name (a trailing number dropped: one fusion of each layer is one row). On a
GPU the kernels are the device planes' events (CUPTI's: kernels inside CUDA graphs too, and
memory copies); on a CPU, the XLA ops the host's threads ran.
"""

from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax

from benchmarks.common import render_table
from benchmarks.host_path import PARTS, decode_pass

# host-thread events on a CPU that are the thread pool's bookkeeping, not an op's run
_NOT_OPS = ("ThreadpoolListener", "end: ", "ThunkExecutor")
_SUFFIX = re.compile(r"([._]\d+)+$")
HOST_EVENTS = 12  # the host's events a trace lists


def kernel_events(xplane: Path) -> list[tuple[str, float, float]]:
    """(name, start ns, duration ns) of every kernel in a trace file: the GPU planes' stream
    events where there are any, else the CPU's XLA ops."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    gpu, cpu = [], []
    for plane in data.planes:
        for line in plane.lines:
            if plane.name.startswith("/device:GPU") and "XLA" not in line.name:
                gpu += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            elif plane.name == "/host:CPU" and line.name.startswith("tf_XLA"):
                cpu += [
                    (e.name, e.start_ns, e.duration_ns)
                    for e in line.events
                    if e.duration_ns > 0 and not e.name.startswith(_NOT_OPS)
                ]
    return gpu or cpu


def host_events(xplane: Path) -> dict[str, tuple[int, float]]:
    """{name: (count, total ns)} of the events XLA and its runtime record on the host's
    threads (the Python tracer is off): launching programs, transfers, and
    `command_buffer::update`, XLA re-recording a CUDA graph (every node reading or writing
    a buffer that moved since the graph's last run is rewritten before the graph launches).
    Events nest: a parent's time includes its children's."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    events: dict[str, list[float]] = defaultdict(list)
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):  # (a CPU's ops: `kernel_events`)
                continue
            for e in line.events:
                events[_SUFFIX.sub("", e.name)].append(e.duration_ns)
    return {name: (len(d), float(sum(d))) for name, d in events.items()}


def busy_ns(events: list[tuple[str, float, float]]) -> float:
    """The time some kernel ran: the union of the events' intervals."""
    total, end = 0.0, float("-inf")
    for _, start, duration in sorted(events, key=lambda e: e[1]):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(
    events: list[tuple[str, float, float]], steps: int, wall_s: float, top: int = 12
) -> str:
    """The trace's totals a step, then its `top` kernel groups by time."""
    groups: dict[str, list[float]] = defaultdict(list)
    for name, _, duration in events:
        groups[_SUFFIX.sub("", name)].append(duration)
    busy = busy_ns(events) / steps / 1e3
    wall = 1e6 * wall_s
    head = (
        f"{steps} steps: {wall:.0f} us a step (wall), kernels running {busy:.0f} us "
        f"({busy / wall:.0%}), {len(events) / steps:.0f} kernels a step"
    )
    rows = [
        [name[:72], f"{len(d) / steps:.1f}", f"{sum(d) / steps / 1e3:.1f}",
         f"{sum(d) / len(d) / 1e3:.1f}", f"{sum(d) / steps / 1e3 / wall:.0%}"]
        for name, d in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]  # fmt: skip
    table = render_table(["kernel", "a step", "us a step", "us each", "of the wall"], rows)
    return f"{head}\n\n{table}"


def _options() -> Any:
    """No Python function tracing: it slows the host's part of a step several times."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def trace(engine: Any, users: int, steps: int, prompt_tokens: int, keep: Path | None) -> str:
    """`users` decoding on `engine`: a pass that compiles, then `steps` served steps traced;
    the trace file is copied to `keep` when given."""
    decode = decode_pass
    decode(engine, users, steps, seed=0, loras=[], prompt_tokens=prompt_tokens)
    with tempfile.TemporaryDirectory() as root:
        r = decode(
            engine, users, steps, seed=1, loras=[], prompt_tokens=prompt_tokens,
            around=lambda: jax.profiler.trace(root, profiler_options=_options()),
        )  # fmt: skip
        (xplane,) = Path(root).rglob("*.xplane.pb")
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_bytes(xplane.read_bytes())
        events = kernel_events(xplane)
        on_host = host_events(xplane)
    host = ", ".join(f"{k.removesuffix('_s')} {1e3 * r[k]:.2f} ms" for k in PARTS)
    summary = summarize(events, steps, r["wall_s"])
    updates, update_ns = on_host.get("command_buffer::update", (0, 0.0))
    busiest = sorted(on_host.items(), key=lambda kv: -kv[1][1])[:HOST_EVENTS]
    listed = "; ".join(
        f"{name[:60]} {n / steps:.1f}x {ns / steps / 1e3:.0f} us" for name, (n, ns) in busiest
    )
    return (
        f"{users} users): {summary}\n\nThe engine's counters a step: {host}; CUDA graphs "
        f"re-recorded {updates / steps:.1f} times a step, {update_ns / steps / 1e3:.0f} us. "
        f"The host's busiest events a step (nested): {listed}"
    )
