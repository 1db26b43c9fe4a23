"""Tensor parallelism on 8 fake CPU devices, in a subprocess: the device count is fixed
when JAX starts, and the rest of the suite runs on one device."""

from __future__ import annotations

from collections.abc import Callable


def test_tensor_parallel_on_eight_devices(eight_devices: Callable[..., None]) -> None:
    eight_devices("tests/multidevice")


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


def test_server_split_four_ways_answers_the_server_tests_that_reach_the_split(
    eight_devices: Callable[..., None],
) -> None:
    eight_devices(
        *(f"tests/integration/test_server.py::{t}" for t in SPLIT_SERVER_TESTS),
        JPAGED_TEST_TENSOR_PARALLEL="4",
    )
