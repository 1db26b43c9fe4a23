"""Server fixtures (the real app under uvicorn in a background thread), and pytest runs on 8
fake CPU devices in subprocesses."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from jpaged import models
from jpaged.engine.async_engine import AsyncEngine
from jpaged.engine.engine import Engine
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


ROOT = Path(__file__).resolve().parents[2]
# (JAX_PLATFORMS: CPU devices even beside a GPU; JAX's CUDA plugin in .gpu-aot/ (.gpu-aot.sh)
# registered for the step-structure tests' deviceless compiles, not failing to find a GPU;
# those compiles run `ptxas` without its optimizations: the programs' structure the same,
# 1b-1's compile 4.9 -> 3.9 s; the run's own tests/conftest.py adds LLVM's flag, as here)
EIGHT_DEVICES = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8"
    " --xla_gpu_disable_gpuasm_optimizations=true",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / ".gpu-aot"), os.environ.get("PYTHONPATH")) if p
    ),
}


class EightDevices:
    """`python -m pytest args` in a subprocess on 8 fake CPU devices (the device count is
    fixed when JAX starts, and the suite runs on one), its output in a temporary file."""

    def __init__(self, *args: str, **env: str) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (`check` reads and closes it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
            cwd=ROOT,
            env={**os.environ, **EIGHT_DEVICES, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def check(self, timeout: float = 900) -> None:
        """It passed, skipping nothing."""
        try:
            code = self.proc.wait(timeout)
        finally:
            self.proc.kill()
        with self.log:
            self.log.seek(0)
            out = self.log.read()
        assert code == 0, out[-9000:]
        assert " skipped" not in out.strip().splitlines()[-1], out[-2000:]


MULTIDEVICE = "tests/multidevice"
_started = pytest.StashKey[EightDevices]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The run of tests/multidevice starts when its test is collected, beside the rest of the
    suite: its ~2 minutes are mostly XLA compiling on one core (the suite's 15 minutes are
    counted on a 2-core machine). Not in an xdist worker: every worker collects every test,
    and one of them runs it; there the run starts with its test (`eight_devices`), and the
    other workers keep the cores busy meanwhile."""
    if hasattr(config, "workerinput"):
        return
    if any(item.name == "test_tensor_parallel_on_eight_devices" for item in items):
        config.stash[_started] = EightDevices(MULTIDEVICE)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run its test never collected (the session stopped first) ends with the session."""
    if (run := session.config.stash.get(_started, None)) is not None:
        run.proc.kill()


@pytest.fixture
def eight_devices(pytestconfig: pytest.Config) -> Callable[..., None]:
    """`eight_devices(*pytest_args, **env)`: that pytest run on 8 fake CPU devices passes,
    skipping nothing (tests/multidevice's, when started at collection, is waited for)."""

    def run(*args: str, **env: str) -> None:
        started = pytestconfig.stash.get(_started, None)
        if args == (MULTIDEVICE,) and not env and started is not None:
            started.check()
        else:
            EightDevices(*args, **env).check()

    return run
