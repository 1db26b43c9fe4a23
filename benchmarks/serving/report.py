"""The serving benchmark's report: the metrics table, paged / contiguous ratios, target
checks, where the engine's step time goes, and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import fmt, render_table

ROWS: list[tuple[str, str, str]] = [
    ("KV bytes allocated", "kv_bytes", ","),
    ("KV bytes per device", "kv_bytes_per_device", ","),
    ("weight bytes per device", "param_bytes_per_device", ","),
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
    ("spec: verifications (rows with drafts)", "spec_drafts", ".0f"),
    ("spec: draft tokens accepted", "spec_acceptance_rate", ".1%"),
    ("spec: mean acceptance length", "spec_mean_acceptance_length", ".2f"),
]


def table(runs: list[dict[str, Any]]) -> str:
    header = ["metric", *(r["label"] for r in runs)]
    rows = []
    for name, key, spec in ROWS:
        if spec == "list" and all(len(r.get(key, [])) < 2 for r in runs):
            continue  # one pass each: the row above says it
        if (spec == "," or key.startswith("spec_")) and not any(key in r for r in runs):
            continue  # results from before the row existed, or without speculation
        cells = []
        for r in runs:
            if spec == "list":
                cells.append(" / ".join(f"{v:.0f}" for v in r.get(key, [])))
            elif key == "peak_blocks":
                cells.append(f"{r['peak_blocks_used']} / {r['blocks_total']}")
            elif spec == ",":
                cells.append(f"{r[key]:,}" if key in r else "-")
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
        out.append(
            {
                "paged": r["label"],
                "contiguous": base["label"],
                "peak_running_x": r["peak_running"] / max(base["peak_running"], 1),
                "output_tok_s_x": r["output_tok_s"] / base["output_tok_s"],
                # pass by pass within a round (same machine load, roughly), then the median
                "output_tok_s_x_per_round": per_round,
                "output_tok_s_x_median_of_rounds": float(np.median(per_round)),
                "output_tok_per_cpu_s_x": (
                    (r.get("output_tok_per_cpu_s") or float("nan"))
                    / (base.get("output_tok_per_cpu_s") or float("nan"))
                ),
                "same_kv_bytes": r["kv_bytes"] == base["kv_bytes"],
            }
        )
    return out


def targets(runs: list[dict[str, Any]], rat: list[dict[str, Any]]) -> list[str]:
    lines = []
    for q in rat:
        if len(q.get("output_tok_s_x_per_round", [])) > 1:
            rounds = ", ".join(f"{x:.2f}" for x in q["output_tok_s_x_per_round"])
            median = q["output_tok_s_x_median_of_rounds"]
            lines.append(
                f"{q['paged']} / {q['contiguous']} output tok/s round by round: "
                f"{rounds} (median {median:.2f})"
            )
        lines.append(
            f"{q['paged']} vs {q['contiguous']}: peak running x{q['peak_running_x']:.2f} "
            f"(target >= 3: {'PASS' if q['peak_running_x'] >= 3 else 'FAIL'}), "
            f"output tok/s x{q['output_tok_s_x']:.2f} "
            f"(target >= 1.5: {'PASS' if q['output_tok_s_x'] >= 1.5 else 'FAIL'}), "
            f"same KV bytes: {q['same_kv_bytes']}"
        )
    for r in runs:
        if r["backend"] == "paged":
            u = r["utilization_at_peak"]
            lines.append(
                f"{r['label']}: KV utilization at peak {u:.1%} "
                f"(target >= 95%: {'PASS' if u >= 0.95 else 'FAIL'})"
            )
    for r in runs:  # a variant (drafts, adapters) against the same configuration without
        for field in ("speculative", "lora"):
            plain = {**r["config"], field: None}
            off = next(
                (
                    o
                    for o in runs
                    if r["config"].get(field) and o["config"] == {**plain, "label": o["label"]}
                ),
                None,
            )
            if off is None:
                continue
            per = [
                a / b
                for a, b in zip(
                    r.get("output_tok_s_reps", [r["output_tok_s"]]),
                    off.get("output_tok_s_reps", [off["output_tok_s"]]),
                    strict=False,
                )
            ]
            x = r["output_tok_s"] / off["output_tok_s"]
            line = (
                f"{r['label']} / {off['label']}: output tok/s x{x:.2f} (pass by pass: "
                f"{', '.join(f'{p:.2f}' for p in per)})"
            )
            if field == "speculative":
                line += (
                    f", acceptance {r['spec_acceptance_rate']:.1%}, mean acceptance length "
                    f"{r['spec_mean_acceptance_length']:.2f}"
                )
            else:
                step_x = r["step_ms_mean"] / off["step_ms_mean"]
                line += (
                    f" (target >= 0.85: {'PASS' if x >= 0.85 else 'FAIL'}), ms per step "
                    f"x{step_x:.2f}, {r.get('lora_bytes_per_adapter', 0) / 2**20:.1f} MiB "
                    "per resident adapter"
                )
            lines.append(line)
    zero = all(r["compilations_after_warmup"] == 0 for r in runs)
    lines.append(
        f"compilations after warm-up: "
        f"{[r['compilations_after_warmup'] for r in runs]} "
        f"(target 0 everywhere: {'PASS' if zero else 'FAIL'})"
    )
    return lines


def breakdown(runs: list[dict[str, Any]]) -> str:
    """Where step time goes, from the engine's own counters (runs that carry them)."""
    runs = [r for r in runs if r.get("time_breakdown_s")]
    if not runs:
        return ""
    rows = []
    for r in runs:
        b = r["time_breakdown_s"]
        steps = max(b["steps"], 1e-9)
        sampling = b.get("stats_sampling_outside_steps")  # in process only
        rows.append(
            [
                r["label"],
                f"{r['steps']}",
                f"{r['step_ms_mean']:.1f}",
                f"{b['schedule'] / steps:.1%}",
                f"{b['batch_build'] / steps:.1%}",
                f"{b['device'] / steps:.1%}",
                f"{b['outputs_and_rest'] / steps:.1%}",
                f"{r['decode_rows_mean']:.1f}",
                "-" if sampling is None else f"{1e3 * sampling / max(r['steps'], 1):.2f}",
            ]
        )
    header = [
        "config",
        "steps",
        "ms/step",
        "schedule",
        "batch build",
        "device",
        "outputs+rest",
        "rows/decode",
        "stats() ms/step",
    ]
    first = render_table(header, rows)
    rows = []
    for r in runs:
        buckets = r.get("decode_buckets")  # in process only
        common = "-"
        if buckets is not None:
            common = ", ".join(f"{k}:{v}" for k, v in list(buckets.items())[:3])
            common += f" ({len(buckets)} in all)"
        rows.append(
            [r["label"], f"{r['decode_row_fill']:.0%}", f"{r['mixed_token_fill']:.0%}", common]
        )
    header = [
        "config",
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
        axes[1].axhline(
            runs[0]["blocks_total"], color="gray", ls="--", lw=1, label="KV blocks in the pool"
        )
    axes[0].set(xlabel="time (s)", ylabel="running sequences", title="running sequences")
    axes[1].set(
        xlabel="time (s)",
        ylabel="KV blocks used (allocated)",
        title="KV blocks used (same KV bytes)",
    )
    for ax in axes[:2]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    labels = [r["label"] for r in runs]
    tps = [r["output_tok_s"] for r in runs]
    bars = axes[2].bar(labels, tps, color=colors[: len(runs)])
    for bar, r in zip(bars, runs, strict=True):
        axes[2].annotate(
            f"{r['output_tok_s']:.0f} tok/s\npeak {r['peak_running']} seqs",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes[2].set(ylabel="output tok/s", title="throughput")
    axes[2].set_ylim(0, max(tps, default=1) * 1.3)
    axes[2].tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def show(report: dict[str, Any], png: Path | None) -> None:
    """Print the table, target checks and time breakdown of a report; write its plot."""
    runs, w = report["runs"], report["workload"]
    print(
        f"\n## {w['name']} ({report['mode']}, {w['num_requests']} requests, "
        f"block {report.get('block_size', 16)}, {report.get('dtype', 'float32')})"
    )
    print(table(runs))
    print()
    for line in targets(runs, report["ratios"]):
        print(line)
    bd = breakdown(runs)
    if bd:
        print("\nstep time breakdown (share of engine step time):")
        print(bd)
    if png is not None:
        plot(
            runs,
            png,
            f"{w['description']} — {report['mode']}, same KV bytes "
            f"({runs[0]['kv_bytes'] / 2**20:.0f} MiB)",
        )
        print(f"plot: {png}")
