"""Misbehaving clients: one that stops reading its stream, and a short soak (benchmarks/soak.py)."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from benchmarks import soak
from benchmarks.common import fetch_metrics
from jpaged.config import EngineConfig
from jpaged.engine.engine import Engine
from server.app import Limits

# test_server.py's engine shape, so a run of both compiles each program once
CONFIG = dict(
    backend="paged",
    block_size=16,
    max_seq_len=128,
    max_batch_size=16,
    max_waiting_requests=64,
    dtype="float32",
    warmup=False,
)


def wait_for(client: httpx.Client, **want: float) -> dict[str, float]:
    """/metrics once each named value is as wanted (bounded)."""
    deadline = time.monotonic() + 30
    while any((m := fetch_metrics(client))[k] != v for k, v in want.items()):
        assert time.monotonic() < deadline, f"not {want}: {m}"
        time.sleep(0.02)
    return m


def test_a_client_that_stops_reading_is_dropped_and_its_blocks_freed(model, serve):
    # a long request: 1000 steps take seconds, so it is cut off long before it could end
    config = EngineConfig(**{**CONFIG, "max_seq_len": 1024})
    engine = Engine(model, config)
    # a send buffer of a few KiB: a client that stops reading blocks the server's writes
    # after ~80 KiB (with uvicorn's own 64 KiB), not megabytes
    with (
        serve(engine, send_buffer=4096, limits=Limits(stream_timeout_s=0.3)) as served,
        httpx.Client(base_url=served.url, timeout=30) as client,
    ):
        # 8 x 1000 chunks of ~400 bytes: far more than every buffer on the way holds
        body = (
            b'{"prompt": [5], "max_tokens": 1000, "n": 8, "logprobs": 5, "temperature": 0,'
            b' "ignore_eos": true, "stream": true}'
        )
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(address(served.url))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            # ... and never reads: admitted, then given up on once a chunk waited 0.3 s
            wait_for(client, http_requests_in_flight=1)
            m = wait_for(client, http_requests_in_flight=0, running=0)
            assert m["kv_blocks_used"] == 0
            assert m["tokens_generated"] < 8 * 1000  # cancelled, not run to its end
            s.settimeout(10)
            data = b""
            with contextlib.suppress(ConnectionResetError):  # dropped: a reset, after the data
                while chunk := s.recv(1 << 16):
                    data += chunk
        assert data.startswith(b"HTTP/1.1 200 ") and b"data: {" in data
        assert b"data: [DONE]" not in data  # cut off, not finished
        assert engine.cache.audit() == []

        # a client that reads, even slowly, is not cut off by the same timeout
        with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "slow reader", "max_tokens": 12, "stream": True},
        ) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                time.sleep(0.05 if line else 0)
        assert [line for line in lines if line][-1] == "data: [DONE]", lines[-3:]
        assert wait_for(client, running=0)["kv_blocks_used"] == 0


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# 13 programs to warm up (4 token buckets, 2 row counts x 4 sampler variants, a block copy):
# ~10 s on two cores (3x that with a cold compilation cache)
SMALL = (
    "--dtype float32 --block-size 16 --max-seq-len 256 --max-batch-size 4 "
    "--max-num-batched-tokens 16"
)


@pytest.mark.slow
def test_short_soak(tiny_llama_dir):
    """20 streaming clients for 15 s against `python -m server` (a fifth hang up mid-stream,
    a fifth read slowly): no 5xx or failed stream, every block free, no fd / thread / task
    growth, nothing compiled after the warm-up, RSS flat after the first 5 s, and an audited
    exit on SIGTERM."""
    report = soak.run(20, 15, str(tiny_llama_dir), warmup_s=5, server_args=SMALL, log=print)
    print(soak.table(report))
    assert report["failures"] == [], report["failures"] + [report.get("server_log_tail")]
    outcomes = report["outcomes"]
    assert outcomes["normal"].get("done", 0) > 20 and outcomes["slow"].get("done", 0) > 0
    assert outcomes["disconnect"].get("hung up", 0) > 0
    assert report["kv_blocks_used_end"] == 0 and report["errors"] == {}
