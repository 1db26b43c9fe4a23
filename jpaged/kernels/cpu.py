"""C++ kernels for the CPU step (`jpaged/models/qdot.cc`, `jpaged/kernels/attention.cc`), built on
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


BUILD_TIMEOUT_S = 300  # a compile that hangs: XLA's path, as when there is no compiler


@functools.cache
def _target(compiler: str, march: str) -> str:
    """What a build with `march` targets on this machine: the compiler's version and the
    macros the flag defines (its instruction sets: `__AVX512F__`, `__AVX2__`, ...). Two
    CPUs sold under one name ("AMD EPYC") may differ in them: a cache shared between them
    must not hand one a library built for the other (SIGILL)."""
    macros = subprocess.run(
        [compiler, march, "-dM", "-E", "-x", "c++", "-"],
        input="", check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    version = subprocess.run(
        [compiler, "--version"], check=True, capture_output=True, text=True, timeout=60
    )
    return version.stdout + "".join(sorted(macros.stdout.splitlines(keepends=True)))


@contextlib.contextmanager
def _one_builder(lock: Path) -> Iterator[None]:
    """Processes that need one library take turns (the test suite's workers and its
    eight-device run start together, each finding the cache cold): the first builds it,
    the others wait, then find it built. Without `fcntl`, each builds its own."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def build(source: Path) -> Path:
    """The shared library of `source` (which may include `cpu.h`) for this CPU
    (`-march=native`), compiled once into `cache_dir()` under a name hashing the sources,
    jaxlib, the compiler and what it targets here (`_target`)."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    # JPAGED_CPU_MARCH: another target than this CPU's (e.g. -march=x86-64-v2: the generic path)
    march = os.environ.get("JPAGED_CPU_MARCH", "-march=native")
    flags = ["-O3", march, "-shared", "-fPIC", "-std=c++17", "-w"]
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (source.read_text(), HEADER.read_text(), jax.lib.__version__,
                      _target(compiler, march), compiler, *flags)
        )
    ).hexdigest()[:16]  # fmt: skip
    cache = cache_dir()
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _one_builder(cache / f"{target.name}.lock"):
        if target.exists():  # built by the process this one waited for
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, "-I", jax.ffi.include_dir(), "-I", str(HEADER.parent),
                 str(source), "-o", tmp],
                check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
            )  # fmt: skip
            os.replace(tmp, target)  # atomic: a process building beside this one is harmless
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{source.name}: {e.stderr[-2000:]}") from e
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{source.name}: the compiler ran past {e.timeout} s") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


ISA = ("avx2", "avx512", "vnni")  # the bits of cpu.h's `jpaged_isa`
_libraries: dict[Path, ctypes.CDLL] = {}  # the registered ones


def isa(source: Path) -> frozenset[str]:
    """The instruction sets `source`'s registered library was built for (`jpaged_isa`);
    none when it is not registered."""
    lib = _libraries.get(source)
    bits = lib.jpaged_isa() if lib is not None else 0
    return frozenset(name for i, name in enumerate(ISA) if bits >> i & 1)


def _load(source: Path, fallback: str) -> ctypes.CDLL | None:
    """`source` built and loaded; None, with a warning naming the `fallback`, when that
    fails, and when `JPAGED_CPU_KERNELS=0`."""
    if os.environ.get("JPAGED_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(build(source)))
    except Exception as e:  # no compiler, a failed or hung build, a failed load
        log.warning("jpaged: %s unavailable, using %s: %s", source.name, fallback, e)
        return None


@functools.cache
def library(source: Path) -> ctypes.CDLL | None:
    """`source`'s plain C functions (once a process), for host work; None: NumPy's path."""
    return _load(source, "NumPy")


@functools.cache
def register(source: Path, names: tuple[str, ...]) -> bool:
    """Build `source` and register its FFI handlers `names` (once a process); False, with a
    warning, when that fails, and when `JPAGED_CPU_KERNELS=0`."""
    lib = _load(source, "XLA's path")
    if lib is None:
        return False
    try:
        for name in names:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
        _libraries[source] = lib
    except Exception as e:  # a symbol missing, a registration refused: XLA's path
        log.warning("jpaged: CPU kernels of %s unavailable, using XLA's path: %s", source.name, e)
        return False
    return True
