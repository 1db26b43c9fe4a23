"""CPU kernels for quantized matmuls at a few tokens (`qdot.cc`), built on first use with the
machine's C++ compiler and registered with XLA's FFI.

XLA:CPU runs the decode step's small dots on one thread and dequantizes through memory
(benchmarks/bench_quant.py); these read each code once and split the output columns over
XLA's intra-op threads. They serve a model that is not split over devices (a custom call
has no partitioning rule), on a CPU, at most `TOKENS` tokens a call (int8 codes: one);
`models.quant.dot` takes the XLA path otherwise, and wherever the kernels cannot be built
(no compiler: one warning). `JPAGED_CPU_KERNELS=0` turns them off.
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
from typing import Any

import jax
import jax.numpy as jnp

from models import demo

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qdot.cc")
TOKENS = 16  # qdot.cc's kTokens
TILE = 16  # qdot.cc's kLanes: output columns must be a multiple
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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def _build() -> Path:
    """The shared library of `SOURCE` for this CPU (`-march=native`), compiled once into
    `demo.cache_dir()`'s kernels/ under a name hashing the source, jaxlib and the CPU."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w"]
    key = hashlib.sha256(
        b"\0".join(
            s.encode()
            for s in (SOURCE.read_text(), jax.lib.__version__, _cpu_name(), compiler, *flags)
        )
    ).hexdigest()[:16]
    cache = demo.cache_dir() / "kernels"
    target = cache / f"qdot-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, "-I", include, str(SOURCE), "-o", tmp],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            os.replace(tmp, target)  # atomic: a process building beside this one is harmless
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{SOURCE.name}: {e.stderr[-2000:]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (once a process; False on failure, with
    a warning, or when `JPAGED_CPU_KERNELS=0`)."""
    if os.environ.get("JPAGED_CPU_KERNELS", "1") == "0":
        return False
    try:
        lib = ctypes.CDLL(str(_build()))
        for name in ("jpaged_qdot_int8", "jpaged_qdot_packed"):
            capsule = jax.ffi.pycapsule(getattr(lib, name))
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except (OSError, RuntimeError) as e:
        log.warning("jpaged: CPU quantized-matmul kernels unavailable, using XLA's: %s", e)
        return False
    return True


def usable(x: jax.Array, parts: tuple[jax.Array, ...]) -> bool:
    """Whether `dot` takes `x [..., in]` against `parts` here (decided while tracing: shapes
    and the backend are static): whole lanes of output columns."""
    codes = parts[0]
    # int8 codes only at one token: past it this kernel loses to XLA's (benchmarks/RESULTS.md,
    # bench_quant's `qdot8`: 120 vs 50 ms at 4 tokens), the packed ones win up to 16
    most = TOKENS if codes.dtype == jnp.uint8 else 1
    return (
        _unsplit.get()
        and jax.default_backend() == "cpu"
        and x.size // x.shape[-1] <= most
        and codes.ndim == 2
        and codes.shape[1] % TILE == 0
        and available()
    )


def dot(x: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
    """float32 `x [..., in] @ w [in, out]`, `w` as `models.quant.arrays` gives it (codes
    int8 or packed uint8, scale and optional offset, sub-blocks along `in`)."""
    codes, scale, *offset = parts
    name = "jpaged_qdot_packed" if codes.dtype == jnp.uint8 else "jpaged_qdot_int8"
    xs = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call: Any = jax.ffi.ffi_call(
        name, jax.ShapeDtypeStruct((xs.shape[0], codes.shape[1]), jnp.float32),
        vmap_method="sequential",
    )  # fmt: skip
    # without offsets the scale stands in for them (never read)
    y = call(xs, codes, scale, offset[0] if offset else scale, affine=bool(offset))
    return y.reshape(*x.shape[:-1], codes.shape[1])
