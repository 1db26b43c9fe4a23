"""Server fixtures: the real app under uvicorn in a background thread."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

import models
from jpaged.engine.engine import AsyncEngine, Engine
from server.app import build_app


@dataclasses.dataclass
class Served:
    url: str
    engine: Engine
    aengine: AsyncEngine

    def assert_idle(self) -> None:
        """Wait (bounded) until no request holds blocks, then audit the pool for leaks."""
        deadline = time.monotonic() + 10
        while any(
            (stats := self.engine.stats())[k] for k in ("kv_blocks_used", "running", "waiting")
        ):
            assert time.monotonic() < deadline, f"blocks still held: {stats}"
            time.sleep(0.05)
        assert self.engine.cache.audit() == []


@pytest.fixture(scope="session")
def model(tiny_llama_dir: Any) -> Any:
    """The tiny Llama checkpoint in float32, loaded once (its params are never mutated)."""
    return models.load(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint: Any) -> Callable[[str], Any]:
    """`loaded(family)`: a tiny checkpoint of that family in float32, loaded once."""
    cache: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in cache:
            cache[family] = models.load(str(tiny_checkpoint(family)), dtype="float32")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def serve() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """`with serve(engine) as served:` runs the app on `served.url`."""
    return _serve


@contextlib.contextmanager
def _serve(
    engine: Engine, model_name: str = "tiny", send_buffer: int | None = None, **options: Any
) -> Iterator[Served]:
    """uvicorn on 127.0.0.1 and a free port; the app's lifespan runs the engine loop.
    `options` go to `build_app` (API keys, limits). `send_buffer`: the kernel send buffer
    of every connection (accepted sockets inherit SO_SNDBUF from the listener)."""
    aengine = AsyncEngine(engine)
    sock = socket.socket()
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))  # bound here, so the port cannot be taken in between
    config = uvicorn.Config(build_app(aengine, model_name, **options), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, aengine)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
