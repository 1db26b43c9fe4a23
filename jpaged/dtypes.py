"""Weight and KV dtypes by name, and what "auto" means on this machine."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
DTYPE_NAMES = ("auto", *sorted(DTYPES))

# 1-byte KV cache types, and the largest magnitude each holds: a token's head vector is
# stored divided by its scale, absmax / that magnitude, so writing a token never
# rescales another.
KV_QUANT = {
    "int8": (jnp.dtype(jnp.int8), 127.0),
    "fp8_e4m3": (jnp.dtype(jnp.float8_e4m3fn), 448.0),
    "fp8_e5m2": (jnp.dtype(jnp.float8_e5m2), 57344.0),
}
# "auto": the KV cache keeps the model's dtype
KV_CACHE_DTYPES = ("auto", *KV_QUANT)


def concrete_dtype(dtype: Any) -> Any:
    """`"auto"` -> "bfloat16" on a GPU, "float32" elsewhere; anything else unchanged.

    float32 off the GPU because XLA's CPU bfloat16 matmuls are the slow path (the demo
    model in bfloat16 served 40 tok/s on a 2-core CPU, below llama.cpp's 45).
    """
    if isinstance(dtype, str) and dtype == "auto":
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return dtype


def resolve_dtype(dtype: Any) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    return jnp.dtype(dtype)
