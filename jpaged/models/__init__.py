"""Llama 3.x, Qwen3 and Gemma 3 as `flax.nnx` modules, and their checkpoint loader."""

from jpaged.models.common import CausalLM, forward, logits
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel
from jpaged.models.loader import load

__all__ = ["CausalLM", "LoadedModel", "ModelConfig", "forward", "load", "logits"]
