"""Models of a geometry with random weights, made on the device, and a word tokenizer for
them: the decode benchmarks' models (`gpu_check`'s 1B and 8B geometries, and `TINY`, the
tiny Llama whose steps cost the device next to nothing: `host_path`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jpaged.config import EngineConfig
from jpaged.models import loader
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel

TINY = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip


def word_tokenizer(vocab: int) -> Any:
    """A tokenizer of `vocab` words `t0 t1 ...`: random weights have no text, but the
    engine detokenizes what it serves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def random_model(config: ModelConfig, dtype: str) -> LoadedModel:
    """A model of `config`'s geometry with random weights, made on the device."""
    build = loader.MODELS[config.architecture]
    # one program makes every weight (eagerly, each op of the initializers compiles apart)
    module = nnx.jit(lambda: build(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))()
    return LoadedModel(module, word_tokenizer(config.vocab_size), {}, "random")


def tiny_model(config: EngineConfig) -> LoadedModel:
    """`TINY` in `config.dtype` (an engine process's `Launch.load`)."""
    return random_model(TINY, config.dtype)
