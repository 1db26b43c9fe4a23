"""LoadedModel: what `models.load` returns, a model ready for an engine."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jpaged.models.common import CausalLM
from jpaged.models.config import ModelConfig
from jpaged.models.gemma3_vision import Gemma3Vision
from jpaged.models.image import ImageProcessing


@dataclasses.dataclass
class LoadedModel:
    """What `models.load` returns: the module (its weights on the devices), its tokenizer
    and generation config, where it came from, and a vision-language model's vision half."""

    model: CausalLM  # a `models.common.CausalLM` (`models.llama.Llama`, ...)
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    generation_config: dict  # generation_config.json as a dict ({} when absent)
    source: str  # the file or directory it came from
    # Gemma3ForConditionalGeneration's tower and projector (`models.gemma3_vision`); None
    # for a text-only model
    vision: Gemma3Vision | None = None
    # how images become the vision tower's pixels (with `vision`)
    image_processing: ImageProcessing | None = None
    # the devices its text model's weights are split over (`models.load(tensor_parallel=)`
    # or `shard_model`); None: whole on JAX's default device
    mesh: Mesh | None = None

    @property
    def config(self) -> ModelConfig:
        """The config the module runs with (tensor-parallel: its KV heads repeated)."""
        return self.model.config
