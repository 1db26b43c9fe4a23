"""jpaged: LLM serving with a paged KV cache in JAX.

The public names load lazily: `models` imports `jpaged.cache`, and the engine
imports `models`, so an eager import here would be circular. Python runs this file
before any `jpaged.*` module, so `import models` first would reach an engine import
here while `models` is half imported; only moving the cache and kernels out of the
`jpaged` package (the top level is fixed) would end that.
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
