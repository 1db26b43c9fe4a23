"""The dtype names the engine and the loaders take, and what "auto" means.

A leaf module (JAX only): `jpaged.config` and `models` both resolve "auto" here, and
`models` is imported while `jpaged.config` is still initialising.
"""

from __future__ import annotations

from typing import Any

import jax

from jpaged.cache.kv_pool import DTYPES

AUTO = "auto"
DTYPE_NAMES = (AUTO, *sorted(DTYPES))


def concrete_dtype(dtype: Any) -> Any:
    """`"auto"` -> "bfloat16" on a GPU, "float32" elsewhere; anything else unchanged.

    float32 off the GPU because XLA's CPU bfloat16 matmuls are the slow path (the demo
    model in bfloat16 served 40 tok/s on a 2-core CPU, below llama.cpp's 45).
    """
    if isinstance(dtype, str) and dtype == AUTO:
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return dtype
