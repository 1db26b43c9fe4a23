"""jpaged: LLM serving with a paged KV cache in JAX.

The public names load lazily: Python runs this file before any `jpaged.*` module, and
one module (`jpaged.dtypes`, a kernel) should not cost the whole engine. Floors, top
down: `engine`
(the step loop, its contract) over `models` (the `flax.nnx` families and their
loader) over `cache` and `kernels` over `config` and `dtypes`.
"""

from typing import Any

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "Completion",
    "EngineConfig",
    "LoRARequest",
    "RequestError",
    "SamplingParams",
    "generate",
]


def __getattr__(name: str) -> Any:
    if name == "EngineConfig":
        from jpaged.config import EngineConfig

        return EngineConfig
    if name in ("SamplingParams", "RequestError"):
        from jpaged.engine import sampling

        return getattr(sampling, name)
    if name == "LoRARequest":
        from jpaged.engine.lora import LoRARequest

        return LoRARequest
    if name == "BeamSearchParams":
        from jpaged.engine.beam import BeamSearchParams

        return BeamSearchParams
    if name in ("LLM", "BeamSearchOutput", "Completion", "generate"):
        from jpaged.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
