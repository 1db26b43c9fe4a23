"""Tensor parallelism on 8 fake CPU devices, in a subprocess: the device count is fixed
when JAX starts, and the rest of the suite runs on one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def pytest_in_subprocess(*args: str, **env: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=ROOT,
        env={**os.environ, **EIGHT_DEVICES, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]


def test_tensor_parallel_on_eight_devices():
    pytest_in_subprocess("tests/multidevice")


# The server tests whose requests reach what the split changes: the step over 4 devices,
# the vocabulary-parallel LM head under sampling and logprobs, forks of a sharded pool and
# the engine's metrics. The rest of that module tests HTTP handling the split never sees.
SPLIT_SERVER_TESTS = (
    "test_engine_is_split_as_asked",
    "test_models_health_metrics",
    "test_completion_stream_equals_non_stream",
    "test_completion_logprobs",
    "test_n_choices_stream_and_non_stream",
)


def test_server_split_four_ways_answers_the_server_tests_that_reach_the_split():
    pytest_in_subprocess(
        *(f"tests/integration/test_server.py::{t}" for t in SPLIT_SERVER_TESTS),
        JPAGED_TEST_TENSOR_PARALLEL="4",
    )
