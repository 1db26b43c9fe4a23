"""Functional ports of Llama 3.x, Qwen3 and Gemma 3 and their checkpoint loader."""

from models.common import forward
from models.config import LoadedModel, ModelConfig
from models.loader import load

__all__ = ["LoadedModel", "ModelConfig", "forward", "load"]
