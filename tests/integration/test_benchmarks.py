"""Smoke test of the serving benchmarks on the tiny Llama: both backends, a few requests."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from benchmarks import bench_capacity, bench_kernel, bench_serving, common, workloads
from benchmarks.serving.configs import matched_configs
from benchmarks.serving.pool_scan import SCAN_ROWS
from benchmarks.serving.report import ROWS
from jpaged.dtypes import concrete_dtype

SMALL = [
    "--max-seq-len",
    "64",
    "--block-size",
    "16",
    "--max-num-batched-tokens",
    "32",
    "--contiguous-batch-size",
    "2",
    "--paged-batch-sizes",
    "4",
    "--no-progress",
]
# (the speculative decoding rows show only where a configuration speculates)
TABLE_ROWS = [name for name, key, spec in ROWS if spec != "list" and not key.startswith("spec_")]
RUN_FIELDS = {
    "completed",
    "generated_tokens",
    "wall_s",
    "output_tok_s",
    "request_throughput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "peak_running",
    "peak_blocks_used",
    "utilization_at_peak",
    "fragmentation_at_peak",
    "preemptions",
    "compilations_after_warmup",
    "kv_bytes",
    "warmup_s",
    "host_share",
    "timeline",
    "step_ms_mean",
    "device_ms_per_step",
    "host_ms_per_step",
}


def test_workloads_are_seeded_and_shaped() -> None:
    a = workloads.make("paged_attention", seed=3)
    assert a == workloads.make("paged_attention", seed=3)
    assert a != workloads.make("paged_attention", seed=4)
    assert a.num_requests == 48
    assert all(128 <= r.prompt_len <= 384 and 128 <= r.max_tokens <= 256 for r in a.requests)
    assert all(r.arrival_s == 0 for r in a.requests)
    tail = workloads.make("long_tail", 24, max_seq_len=1024)
    assert max(r.total_len for r in tail.requests) >= 0.75 * 1024
    assert all(r.total_len <= 1024 for r in tail.requests)
    arrivals = [r.arrival_s for r in workloads.make("poisson", 20, rate=4.0).requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_matched_configs_share_kv_bytes() -> None:
    configs = matched_configs("both")
    assert [c.label for c in configs] == ["contiguous b8", "paged b24", "paged b48"]
    assert {c.num_blocks for c in configs if c.backend == "paged"} == {8 * 4096 // 16}
    assert {c.dtype for c in configs} == {concrete_dtype("auto")}  # resolved: float32 on a CPU


def test_map_count_guard_is_for_xla_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert common.program_budget() is None
    common.check_program_budget(10**6, "a GPU warm-up")  # refuses nothing


@pytest.mark.parametrize("warmup", ["engine", "workload"])
def test_bench_serving_both_backends(
    tiny_llama_dir: Path, tmp_path: Path, warmup: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """engine: every bucket compiled (and run) up front; workload: an unmeasured pass
    first, then two measured passes per backend, interleaved."""
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    repeat = 1 if warmup == "engine" else 2
    report = bench_serving.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--backend",
            "both",
            "--workload",
            "long_tail",
            "--num-requests",
            "5",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--warmup",
            warmup,
            "--repeat",
            str(repeat),
            *SMALL,
        ]
    )
    printed = capsys.readouterr().out
    for row in TABLE_ROWS:
        assert row in printed
    assert ("output tok/s, every pass" in printed) == (repeat > 1)
    assert "KV pool" in printed and "bytes" in printed
    data = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert data["dtype"] == concrete_dtype("auto")
    runs = data["runs"]
    assert [r["backend"] for r in runs] == ["contiguous", "paged"]
    for r in runs:
        assert set(r) >= RUN_FIELDS
        assert r["completed"] == 5 and r["failed"] == 0
        assert r["generated_tokens"] == sum(w["max_tokens"] for w in _requests(report))
        assert r["compilations_after_warmup"] == 0
        assert r["compilations_in_run"] == 0
        assert len(r["output_tok_s_reps"]) == len(r["reps"]) == repeat
        assert r["device_ms_per_step"] > 0 and r["host_ms_per_step"] > 0
    assert runs[0]["kv_bytes"] == runs[1]["kv_bytes"]
    assert runs[0]["peak_running"] <= 2 <= runs[1]["peak_running"]
    assert data["ratios"][0]["same_kv_bytes"]
    # the step time breakdown, from the engine's counters over the measured pass
    assert "step time breakdown" in printed and "commonest decode-only buckets" in printed
    for r in runs:
        b = r["time_breakdown_s"]
        assert b["steps"] > 0 and b["device"] > 0 and b["schedule"] > 0 and b["batch_build"] > 0
        assert b["outputs_and_rest"] == pytest.approx(
            b["steps"] - b["schedule"] - b["batch_build"] - b["device"]
        )
        assert b["stats_sampling_outside_steps"] > 0
        assert r["decode_calls"] > 0 and r["mixed_calls"] > 0
        assert sum(r["decode_buckets"].values()) == r["decode_calls"]
        assert 0 < r["decode_row_fill"] <= 1 and 0 < r["mixed_token_fill"] <= 1
    # --replot prints the same tables again from the JSON
    bench_serving.replot([str(out), str(tmp_path / "again.png")])
    again = capsys.readouterr().out
    assert report_tables(again) == report_tables(printed)


def report_tables(printed: str) -> str:
    """The printed report from its heading on, less the paths of its files."""
    report = printed[printed.index("\n## ") :]
    return "\n".join(
        line for line in report.splitlines() if not line.startswith(("plot: ", "raw numbers: "))
    )


def test_bench_serving_pool_scan(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same requests on two pool sizes: a warm pass, then a timed pass per size."""
    out = tmp_path / "scan.json"
    report = bench_serving.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--pool-scan",
            "64,16",
            "--scan-requests",
            "4",
            "--scan-prompt-len",
            "8",
            "--scan-max-tokens",
            "4",
            "--max-seq-len",
            "64",
            "--max-num-batched-tokens",
            "32",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    for row, _, _ in SCAN_ROWS:
        assert row in printed
    assert "64 / 16 blocks: engine ms/step x" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=float))
    assert report["dtype"] == concrete_dtype("auto")
    small, large = report["runs"]
    assert (small["num_blocks"], large["num_blocks"]) == (16, 64)
    assert large["kv_bytes"] * 17 == small["kv_bytes"] * 65  # the null block counted
    for r in report["runs"]:
        assert r["generated_tokens"] == 4 * 4 and r["steps"] > 0
        assert r["compilations_in_run"] == 0 and r["preemptions"] == 0
        assert r["device_ms_per_step"] > 0 and r["host_ms_per_step"] > 0
    ratio = report["ratio_largest_to_smallest"]
    assert ratio["step_ms_mean"] == pytest.approx(large["step_ms_mean"] / small["step_ms_mean"])


def _requests(report: dict) -> list[dict]:
    w = report["workload"]
    lt = workloads.make("long_tail", w["num_requests"], vocab_size=320, max_seq_len=64)
    return [{"max_tokens": r.max_tokens} for r in lt.requests]


def test_bench_capacity_ratio(tmp_path: Path) -> None:
    report = bench_capacity.main(
        [
            "--no-throughput",
            "--distributions",
            "paged_attention",
            "--block-sizes",
            "16,64",
            "--out",
            str(tmp_path / "cap.json"),
            "--plot",
            "none",
        ]
    )
    (cap,) = report["capacity"]
    assert cap["contiguous"]["held"] == 8
    assert cap["paged"]["held"] >= 3 * cap["contiguous"]["held"]
    assert cap["paged"]["utilization"] >= 0.95
    assert [e["block_size"] for e in report["sweep"]] == [16, 64]


def test_bench_serving_through_server(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A real `python -m server` subprocess with its own warm-up (fast at this size)."""
    out = tmp_path / "server.json"
    bench_serving.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--backend",
            "paged",
            "--workload",
            "long_tail",
            "--num-requests",
            "3",
            "--through-server",
            "--out",
            str(out),
            "--plot",
            "none",
            "--warmup",
            "engine",
            *SMALL,
        ]
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "server" and run["completed"] == 3, run.get("errors")
    assert run["generated_tokens"] > 0 and run["ttft_p50_ms"] > 0
    # /metrics is polled, so a run this short may finish between two samples
    assert run["timeline"]["t"] and "peak_running" in run and "peak_blocks_used" in run
    assert run["compilations_after_warmup"] == 0
    # /metrics carries the engine's counters: the breakdown is there, the buckets are not
    assert run["time_breakdown_s"]["device"] > 0 and run["decode_row_fill"] > 0
    assert run["time_breakdown_s"]["stats_sampling_outside_steps"] is None
    assert "decode_buckets" not in run


def test_bench_kernel_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU table (the GPU table's code runs in gpu_check's test)."""
    bench_kernel.main(["--batch", "1", "--ctx", "256", "--dtype", "float32", "int8", "--no-write"])
    out = capsys.readouterr().out
    assert "| float32 | 1 | 256 |" in out and "| int8 | 1 | 256 |" in out


def test_bench_weights_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each form at two token counts on a small stack, its error against the float weights'
    output within the codes' rounding, the programs written."""
    from benchmarks import bench_weights

    argv = ["--layers", "2", "--shape", "64,128,32", "--tokens", "1,3", "--repeats", "1"]
    bench_weights.main([*argv, "--dtype", "float32", "--hlo", str(tmp_path), "--no-write"])
    out = capsys.readouterr().out.splitlines()
    rows = [r.split(" | ") for r in out if r.count(" | ") == 6 and not r.startswith("|")]
    assert [r[:2] for r in rows] == [[f, t] for f in bench_weights.FORMS for t in ("1", "3")]
    errors = {r[0]: float(r[6]) for r in rows}
    assert errors["float"] == 0 and 0 < errors["int8"] < 0.02 and 0 < errors["fp8"] < 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"bench_weights_{f}_1.txt" for f in sorted(bench_weights.FORMS)
    ]


def test_bench_beam_smoke(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_beam

    bench_beam.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--prompts",
            "2",
            "--width",
            "2",
            "--prompt-tokens",
            "16",
            "--new",
            "4",
            "--block-size",
            "4",
            "--no-write",
        ]
    )
    out = capsys.readouterr().out
    assert "beam search, paged" in out and "2 greedy sequences" in out and ": met)" in out


def test_profile_step_splits_a_decode_step(tiny_llama_dir: Path) -> None:
    """Served and device-alone time per step, the host's parts, no compilation in the
    measured passes (the first pass compiled what they run), with and without adapters;
    prompts of two pages, an int8 KV cache."""
    from benchmarks import profile_step

    argv = ["--model", str(tiny_llama_dir), "--users", "1,2", "--steps", "3", "--lora-ranks", "0,4",
            "--prompt-tokens", "20", "--kv-cache-dtype", "int8"]  # fmt: skip
    rows = profile_step.main(argv)
    assert [r[:2] for r in rows] == [["1", "0"], ["1", "4"], ["2", "0"], ["2", "4"]]
    for r in rows:
        served, alone, idle = (float(x) for x in r[2:5])
        assert served > 0 and alone > 0
        assert abs(idle - max(served - alone, 0.0)) <= 0.11  # each printed to 0.1 ms
        assert all(float(x) >= 0 for x in r[6:11]) and float(r[8]) > 0
        assert r[-1] == "0"


def test_bench_cpu_attention_times_both_paths() -> None:
    """Prompts and decodes, float32 and int8 pools: both paths timed, their outputs equal."""
    from benchmarks import bench_cpu_attention

    argv = ["--cases", "2x40,3x1@40", "--heads", "4,2,16", "--kv", "auto,int8",
            "--repeats", "1", "--no-write"]  # fmt: skip
    rows = bench_cpu_attention.main(argv)
    assert [r[:2] for r in rows] == [["2x40", "auto"], ["3x1@40", "auto"], ["2x40", "int8"],
                                     ["3x1@40", "int8"]]  # fmt: skip
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0
        assert float(r[-1]) < 1e-4


def test_gpu_check_runs_whole_on_tiny_shapes(tmp_path: Path) -> None:
    """The prepared GPU run, every section, small (on a CPU the kernels are interpreted)."""
    from benchmarks import gpu_check

    text = gpu_check.main(["--small", "--users", "2", "--steps", "2", "--out", str(tmp_path)])
    assert "| tiny  |     2 |" in text and "Pool scan (2 users" in text
    assert "| 64 | 2 | 64 |" in text and "Every output within" in text
    assert (tmp_path / "gpu_check.md").read_text().strip() == text.strip()
    # the trace read back: the step's ops found, and its file kept for a viewer
    trace = text.split("Trace (tiny, 2 users): ")[1]
    assert int(trace.split(" kernels a step")[0].split(", ")[-1]) > 0
    assert (tmp_path / "trace_tiny_2.xplane.pb").stat().st_size > 0


def test_trace_busy_time_is_the_union_of_kernels() -> None:
    from benchmarks import trace_step

    events = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]
    assert trace_step.busy_ns(events) == 20.0
    text = trace_step.summarize(events, steps=1, wall_s=40e-9)
    assert "kernels running 0 us (50%)" in text and "| a      |" in text


def test_bench_big_writes_a_q4_k_m_file_as_llama_cpp_mixes_it(tmp_path: Path) -> None:
    """`bench_big`'s Q4_K_M mix at a tiny geometry: the types llama.cpp picks (Q6_K in the
    tied head and in V and FFN down of the layers `use_more_bits` names), and a file jpaged
    loads, each weight whose layers mix types held a stack a type."""
    import gguf

    from benchmarks import bench_big
    from jpaged import models
    from jpaged.models import quant

    shape = bench_big.Shape(3, 256, 512, 4, 2, 64, tied=True, vocab=600)
    bench_big.write(tmp_path / "tiny.gguf", shape, "q4_k_m")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors}
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    # 3 layers: the last (i >= 7 * 3 // 8 = 2, and i % 3 == 2) Q6_K, the others Q4_K
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(3)} == {"Q4_K"}
    layout = quant.layout_of(models.load(str(tmp_path / "tiny.gguf")).model)
    # the layers' scales and the table's in the file's two levels; Q6_K's codes at six bits
    # where the CPU kernels read them (a table of 600 rows, not whole groups of 32: int8),
    # the kernels' codes in their order
    kernels = models.qdot.int8_kernel()
    q4_k = quant.Form(32, True, packed=True, group=8, tiled=kernels)
    q6_k = quant.Form(16, False, group=16, bits=6)
    narrow = q6_k._replace(narrow=kernels, tiled=kernels)
    assert layout["layers.mlp.down.kernel"] == quant.Mixed((q4_k, narrow), (0, 0, 1))
    assert layout["layers.attn.o.kernel"] == q4_k
    assert layout["embed.embedding"] == q6_k


def test_bench_big_writes_a_qwen3moe_file_llama_cpp_and_jpaged_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench_big`'s Qwen3-30B-A3B-shaped kind at a tiny geometry: the keys llama.cpp's
    qwen3moe needs, the experts stacked 3-D in Q4_K_M's types (down Q6_K where
    `use_more_bits`), float32 routers and Q/K norms, and a file jpaged loads as a mixture."""
    import gguf

    from benchmarks import bench_big
    from jpaged import models
    from jpaged.models import quant

    shape = bench_big.Shape(3, 256, 512, 4, 2, 64, False, 600, experts=4, used=2, expert_mlp=256)
    bench_big.write(tmp_path / "moe.gguf", shape, "q4_k_m")
    reader = gguf.GGUFReader(tmp_path / "moe.gguf")
    keys = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("qwen3moe.")}
    assert keys["qwen3moe.expert_count"] == 4 and keys["qwen3moe.expert_used_count"] == 2
    assert keys["qwen3moe.expert_feed_forward_length"] == 256
    tensors = {t.name: t for t in reader.tensors}
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert {types[f"blk.{i}.ffn_gate_exps.weight"] for i in range(3)} == {"Q4_K"}
    # GGUF's shapes reversed: [hidden, expert FFN, experts], the router [hidden, experts]
    assert tuple(tensors["blk.0.ffn_gate_exps.weight"].shape) == (256, 256, 4)
    assert tuple(tensors["blk.0.ffn_down_exps.weight"].shape) == (256, 256, 4)
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_q_norm.weight"] == "F32"
    loaded = models.load(str(tmp_path / "moe.gguf"))
    moe = loaded.config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 256)
    layout = quant.layout_of(loaded.model)
    assert isinstance(layout["layers.moe.down.kernel"], quant.Mixed)
    assert layout["layers.moe.down.kernel"].of_layer == (0, 0, 1)
    # the grouped experts' quantized stacks go to the CPU kernels where they lie (where
    # they serve), with the dense reference's logits
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpaged.models import moe, qdot

    tokens = jnp.asarray(np.arange(300, 332).reshape(2, 16), jnp.int32)
    out, calls = {}, {}
    for impl in ("grouped", "dense"):
        monkeypatch.setattr(moe, "IMPL", impl)
        f = jax.jit(lambda model, t: models.logits(model, t))  # (a program an impl)
        out[impl] = np.asarray(f(loaded.model, tokens))
        calls[impl] = f.lower(loaded.model, tokens).as_text().count("jpaged_qdot")
    np.testing.assert_allclose(out["grouped"], out["dense"], atol=1e-3 * np.abs(out["dense"]).max())
    # the experts' K-quant blocks, decoded straight into their stacks, against gguf's own
    # dequantization of the file
    floats = models.load(str(tmp_path / "moe.gguf"), quantization="none").model
    want = np.asarray(models.logits(floats, tokens))
    np.testing.assert_allclose(out["dense"], want, atol=1e-4 * np.abs(want).max())
    if qdot.stacks():  # gate, up, and down's two forms
        assert calls["grouped"] == calls["dense"] + 4
