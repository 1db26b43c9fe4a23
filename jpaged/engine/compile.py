"""Compiling the step programs: JAX's on-disk cache, compiles side by side, the progress.

A step program compiles in about a second on a CPU and ~20 s on a GPU (GEMM autotuning),
one per token bucket: warm-up is a server's start. Programs are lowered (Python, under the
GIL) one after another and compiled (XLA, outside it) on a few threads at once; a jitted
call then finds its program compiled (JAX keeps a lowering's executable). With the on-disk
cache JAX also keeps XLA's per-fusion GPU autotuning results beside the programs
(`jax_persistent_cache_enable_xla_caches`' default), so a program compiled anew (changed
code, a new bucket) skips the tuning of every fusion it shares with one compiled before.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

# XLA compiles in this process so far, every thread's (`compilations`)
_compilations = 0
_lock = threading.Lock()


def _count_compile(event: str, duration_secs: float, **_: str | int) -> None:
    global _compilations
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compilations() -> int:
    """XLA backend compiles in this process so far (every thread's)."""
    return _compilations


def compile_all(lowered: Iterable[Any], progress: Progress) -> None:
    """Compile each of `lowered` (`jax.stages.Lowered`, made as the iteration goes: Python,
    under the GIL, one after another) on a pool of threads meanwhile, advancing `progress`
    as each is done."""
    with ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="jpaged-compile") as pool:
        futures = [pool.submit(program.compile) for program in lowered]
        for future in futures:
            future.result()
            progress.advance()


def use_compilation_cache(path: str) -> None:
    """Persist compiled programs on disk, in `path` (JAX's setting, for the whole process),
    each entry written whole (`_put_whole`)."""
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    # our step programs compile in about a second on CPU: cache them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    if _put_in_place is not None:
        lru_cache.LRUCache.put = _put_whole  # type: ignore[method-assign]


try:  # JAX's own (private) file cache: where it is not, entries are written as JAX writes them
    from jax._src import lru_cache

    _put_in_place = lru_cache.LRUCache.put if hasattr(lru_cache, "_CACHE_SUFFIX") else None
except ImportError:
    _put_in_place = None


def _put_whole(self: lru_cache.LRUCache, key: str, value: bytes) -> None:
    """JAX's cache entry, renamed to its name once written. JAX writes it in place, and
    processes share the directory (the test suite's workers, the servers it starts): one
    reading an entry half-written warns and compiles again, or fails where warnings are
    errors."""
    where = os.fspath(self.path)
    if self.eviction_enabled or "://" in where:  # under JAX's file lock; remote: JAX's write
        assert _put_in_place is not None
        _put_in_place(self, key, value)
        return
    entry = os.path.join(where, f"{key}{lru_cache._CACHE_SUFFIX}")
    if os.path.exists(entry):
        return
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{key}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, entry)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Progress:
    """Warm-up progress on stderr: a bar redrawn in place on a terminal, a few plain
    lines (a quarter at a time) in a log."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._logged = 0
        print(f"jpaged: warm-up: {what}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            bar = "#" * (30 * self.done // self.total)
            line = f"\rjpaged: [{bar:<30}] {self.done}/{self.total} ({elapsed:.0f} s)"
            print(line, end="", file=sys.stderr, flush=True)
        elif 4 * self.done // self.total > self._logged:
            self._logged = 4 * self.done // self.total
            print(
                f"jpaged: warm-up {self.done}/{self.total} programs ({elapsed:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)
