"""Llama 3.x, Qwen3 and Gemma 3 as `flax.nnx` modules, and their checkpoint loader."""

from models.common import CausalLM, forward, logits
from models.config import ModelConfig
from models.loaded import LoadedModel
from models.loader import load

__all__ = ["CausalLM", "LoadedModel", "ModelConfig", "forward", "load", "logits"]
