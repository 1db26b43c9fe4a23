"""C++ kernels for the CPU step (`models/qdot.cc`, `jpaged/kernels/attention.cc`), built on
first use with the machine's C++ compiler (`-march=native`: machines change, so nothing is
built at install) and registered with XLA's FFI.

They serve a model that lies whole on one device (`unsplit`: a custom call has no
partitioning rule), on a CPU; their callers take XLA's path otherwise, and wherever a
kernel cannot be built (no compiler: one warning). `JPAGED_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax

log = logging.getLogger(__name__)

HEADER = Path(__file__).with_name("cpu.h")  # what the kernels share
_unsplit = contextvars.ContextVar("unsplit", default=False)


@contextlib.contextmanager
def unsplit(model_is_whole: bool) -> Iterator[None]:
    """Trace inside: whether the model being traced lies whole on one device (the kernels
    are used only then)."""
    token = _unsplit.set(model_is_whole)
    try:
        yield
    finally:
        _unsplit.reset(token)


def serves() -> bool:
    """Whether a kernel may serve what is being traced: a whole model, on a CPU."""
    return _unsplit.get() and jax.default_backend() == "cpu"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jpaged" / "kernels"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def build(source: Path) -> Path:
    """The shared library of `source` (which may include `cpu.h`) for this CPU
    (`-march=native`), compiled once into `cache_dir()` under a name hashing the sources,
    jaxlib, the CPU and the compiler."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w"]
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (source.read_text(), HEADER.read_text(), jax.lib.__version__,
                      _cpu_name(), compiler, *flags)
        )
    ).hexdigest()[:16]  # fmt: skip
    cache = cache_dir()
    target = cache / f"{source.stem}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, "-I", jax.ffi.include_dir(), "-I", str(HEADER.parent),
                 str(source), "-o", tmp],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            os.replace(tmp, target)  # atomic: a process building beside this one is harmless
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{source.name}: {e.stderr[-2000:]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def register(source: Path, names: tuple[str, ...]) -> bool:
    """Build `source` and register its FFI handlers `names` (once a process); False, with a
    warning, when that fails, and when `JPAGED_CPU_KERNELS=0`."""
    if os.environ.get("JPAGED_CPU_KERNELS", "1") == "0":
        return False
    try:
        lib = ctypes.CDLL(str(build(source)))
        for name in names:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    except (OSError, RuntimeError) as e:
        log.warning("jpaged: CPU kernels of %s unavailable, using XLA's path: %s", source.name, e)
        return False
    return True
