"""One model over two processes (jax.distributed, gloo on CPU), each with fake devices:
the tokens of one process, the server on process 0, a clean SIGTERM, a lost worker. And
the server over two data-parallel replicas, from its command line to its exit audit.

Each test starts its processes on 127.0.0.1 with free ports and bounds them with
timeouts: a process is the point here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import jpaged
from jpaged import models

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from multiprocess_generate import ENGINE, SPECULATIVE, generate_variants, workload  # noqa: E402

# family: (checkpoint overrides, devices a process): both split 8 ways over 2 x 4 devices
# (Gemma's one KV head repeated 8 times). Llama is large enough (27 MB) that what loading
# holds in host memory shows.
FAMILIES = {
    "llama": (
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "hidden_size": 256,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
        },
        4,
    ),
    "gemma3": ({"num_attention_heads": 8}, 4),
}
TIMEOUT = 120


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


@contextlib.contextmanager
def processes(commands: list[list[str]], devices: int) -> Iterator[list[subprocess.Popen]]:
    """Start them (process 0 first in the list), each writing to a file of its own (a
    pipe nobody reads would fill and block it); kill whatever is left at the end."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs = [
            subprocess.Popen(
                c, cwd=ROOT, env=env(devices), stdout=log, stderr=subprocess.STDOUT, text=True
            )
            for c, log in zip(commands, logs, strict=True)
        ]
        for p, log in zip(procs, logs, strict=True):
            p.log = log  # type: ignore[attr-defined]
        try:
            yield procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)


def output(p: subprocess.Popen) -> str:
    """What `p` wrote so far, without gloo's connection lines."""
    log = p.log  # type: ignore[attr-defined]
    log.seek(0)
    return "\n".join(line for line in log.read().splitlines() if "[Gloo]" not in line)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_processes_generate_one_process_tokens(tiny_checkpoint: Callable[..., Path], family):
    overrides, devices = FAMILIES[family]
    path = tiny_checkpoint(family, **overrides)
    prompts, params = workload()
    llm = jpaged.LLM(models.load(path, dtype="float32"), **ENGINE)
    outs = llm.generate(prompts[:4], params[:4]) + llm.generate(prompts[4:], params[4:])
    expected = [[c.token_ids for c in o.choices] for o in outs]
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in outs)
    assert re.fullmatch("[a-f]{3,5}", outs[-1].text), outs[-1].text  # the regex held
    (port,) = free_ports(1)
    script = [
        sys.executable,
        str(HERE / "multiprocess_generate.py"),
        str(path),
        f"127.0.0.1:{port}",
        "2",
    ]
    with processes([[*script, "0"], [*script, "1"]], devices) as (driver, worker):
        assert driver.wait(TIMEOUT) == 0, output(driver)
        assert worker.wait(TIMEOUT) == 0, output(worker)  # released by process 0's exit
        result = json.loads(output(driver).strip().splitlines()[-1])
    assert result["tokens"] == expected
    assert result["hits"] > 0 and result["used"] == 0  # LATER hit the prefix cache
    if family == "llama":  # each process assembled its half of the weights, never all
        assert result["assembling_peak"] < 0.75 * result["model_bytes"], result


def test_workers_run_process_zeros_programs_for_drafts_logprobs_and_beams(tiny_checkpoint):
    """The step shapes (a drafting step samples more positions than it has sequences) and
    sampler variants (alternatives searched: 5 for logprobs, 8 for 4 beams) a plain
    workload never makes: each worker makes process 0's device calls, call for call."""
    path = tiny_checkpoint("llama", **FAMILIES["llama"][0])
    llm = jpaged.LLM(models.load(path, dtype="float32"), **ENGINE, speculative=SPECULATIVE)
    expected = generate_variants(llm)
    (port,) = free_ports(1)
    script = [sys.executable, str(HERE / "multiprocess_generate.py"), str(path)]
    script += [f"127.0.0.1:{port}", "2"]
    commands = [[*script, "0", "variants"], [*script, "1", "variants"]]
    with processes(commands, 2) as (driver, worker):
        assert driver.wait(TIMEOUT) == 0, output(driver)
        assert worker.wait(TIMEOUT) == 0, output(worker)
        result = json.loads(output(driver).strip().splitlines()[-1])
        mirrored = json.loads(output(worker).strip().splitlines()[-1])
    assert result["drafts"] > 0 and expected["drafts"] > 0
    assert result["tokens"] == expected["tokens"] and result["beams"] == expected["beams"]
    for key in ("logprobs", "top"):
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-4, atol=1e-5)
    assert {c[1].get("top") for c in result["calls"]} >= {"0", "5", "8"}
    assert mirrored["calls"] == result["calls"]


def start_server(path: Path, *extra: str) -> tuple[list[list[str]], str]:
    coordinator, http = free_ports(2)
    flags = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(path),
        *extra,  # no --dtype: "auto" asks for the backend only after jax.distributed starts
        "--block-size",
        "4",
        "--max-seq-len",
        "256",
        "--max-batch-size",
        "4",
        "--num-processes",
        "2",
        "--coordinator",
        f"127.0.0.1:{coordinator}",
        "--heartbeat-timeout",
        "5",
    ]
    commands = [[*flags, "--process-id", "0", "--port", str(http)], [*flags, "--process-id", "1"]]
    return commands, f"http://127.0.0.1:{http}"


def wait_healthy(url: str, driver: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert driver.poll() is None and time.monotonic() < deadline, output(driver)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)


def test_server_on_process_zero_answers_and_sigterm_stops_both(tiny_checkpoint):
    path = tiny_checkpoint("llama", **FAMILIES["llama"][0])
    commands, url = start_server(path, "--max-num-batched-tokens", "4")  # warm-up mirrored
    with processes(commands, 2) as (driver, worker):
        wait_healthy(url, driver)
        body = {"prompt": [5, 17, 99, 3], "max_tokens": 5, "temperature": 0, "n": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 2
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(TIMEOUT) == 0
        assert worker.wait(TIMEOUT) == 0
        assert "every KV block free (audited)" in output(driver)
        assert "process 1 stopped with process 0" in output(worker)


def test_a_setting_given_to_one_process_only_stops_every_process(tiny_checkpoint):
    path = tiny_checkpoint("llama", **FAMILIES["llama"][0])
    (driver_flags, worker_flags), _ = start_server(path, "--no-warmup")
    # the worker's own value wins its argparse: a pool of other blocks, another KV dtype
    worker_flags += ["--max-seq-len", "128", "--kv-cache-dtype", "int8"]
    with processes([driver_flags, worker_flags], 2) as (driver, worker):
        assert worker.wait(TIMEOUT) == 1 and driver.wait(TIMEOUT) == 1
        for p, value in ((worker, "'int8'"), (driver, "'auto'")):
            log = output(p)
            assert "EngineConfig.max_seq_len of process 1 differs from process 0's" in log, log
            assert "EngineConfig.kv_cache_dtype of process 1 differs" in log, log
            assert value in log and "Traceback" not in log, log


def test_killed_worker_ends_process_zeros_requests_within_seconds(tiny_checkpoint):
    """Two ways a dead worker reaches process 0, whichever comes first: its collective fails
    (the stream ends with a WorkerLost error event, later requests are refused), or JAX's
    coordination service sees the worker gone and terminates process 0 (the stream is cut).
    Either way, no request waits."""
    path = tiny_checkpoint("llama", **FAMILIES["llama"][0])
    commands, url = start_server(path, "--no-warmup")
    with processes(commands, 2) as (driver, worker):
        wait_healthy(url, driver)
        body = {
            "prompt": [5, 17, 99, 3],
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        rest: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            # killed once decode steps run: a kill while process 0 still compiles its first
            # decode program (no warm-up) leaves only the coordination service to notice
            tokens = (line for line in lines if line.startswith("data: {"))
            assert [next(tokens) for _ in range(3)]
            worker.kill()
            killed = time.monotonic()
            with contextlib.suppress(httpx.RemoteProtocolError):
                rest = [line for line in lines if line.startswith("data: ")]
        waited = time.monotonic() - killed
        print(f"killed worker: the stream ended {waited:.3f} s later", "" if rest else "(cut)")
        assert waited < 10, waited
        if rest:
            error = json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
            assert "WorkerLost" in error and "other processes failed" in error, error
            with contextlib.suppress(httpx.TransportError):  # unless terminated meanwhile
                r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
                assert r.status_code in (500, 503) and "WorkerLost" in r.text, r.text
                return
        assert driver.wait(10) != 0
        assert "distributed service detected fatal errors" in output(driver), output(driver)


def test_server_with_two_replicas_routes_and_drains_on_sigterm(tiny_checkpoint):
    """`--data-parallel 2` on 2 devices: one server, a batch spread over both replicas
    (the router in /metrics), SIGTERM's drain and the exit audit of both pools."""
    path = tiny_checkpoint("llama", **FAMILIES["llama"][0])
    (http,) = free_ports(1)
    url = f"http://127.0.0.1:{http}"
    flags = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(path),
        "--no-warmup",
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--max-seq-len",
        "64",
        "--max-batch-size",
        "4",
        "--port",
        str(http),
    ]
    refused = subprocess.run(
        [*flags, "--data-parallel", "3"],
        cwd=ROOT,
        env=env(2),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert refused.returncode == 2
    assert "data_parallel=3 x tensor_parallel=1 needs 3 devices" in refused.stderr
    with processes([[*flags, "--data-parallel", "2"]], 2) as (server,):
        wait_healthy(url, server)
        body = {"prompt": [[5, 17, 99, 3], [6, 7, 8]], "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'jpaged_router_routed{replica="0"} 1.0' in metrics
        assert 'jpaged_router_routed{replica="1"} 1.0' in metrics
        server.send_signal(signal.SIGTERM)
        assert server.wait(TIMEOUT) == 0, output(server)
        log = output(server)
        assert "in each of 2 replicas" in log and "every KV block free (audited)" in log
