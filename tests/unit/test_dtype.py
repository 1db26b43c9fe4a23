"""dtype="auto", the default of the engine, `generate`, the server and `models.load`:
bfloat16 on a GPU, float32 elsewhere, resolved once; an explicit dtype always wins over
what a checkpoint declares or stores."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jpaged
from jpaged import models
from jpaged.config import EngineConfig
from jpaged.dtypes import concrete_dtype

THIS_MACHINE = "bfloat16" if jax.default_backend() == "gpu" else "float32"


@pytest.fixture
def pretend(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """`pretend("gpu")`: jax.default_backend() says so. Only "auto" reads it; nothing here
    runs on the pretended device."""
    return lambda backend: monkeypatch.setattr(jax, "default_backend", lambda: backend)


@pytest.mark.parametrize("backend,expected", [("cpu", "float32"), ("gpu", "bfloat16")])
def test_auto_resolves_by_backend(
    pretend: Callable[[str], None], backend: str, expected: str
) -> None:
    pretend(backend)
    assert concrete_dtype("auto") == expected
    assert EngineConfig().dtype == expected  # the default
    assert EngineConfig(dtype="auto").dtype == expected
    for explicit in ("bfloat16", "float32", "float16"):
        assert EngineConfig(dtype=explicit).dtype == explicit


def test_default_on_this_machine_is_concrete() -> None:
    config = EngineConfig()
    assert config.dtype == THIS_MACHINE  # float32 on a CPU
    assert dataclasses.replace(config, warmup=False).dtype == THIS_MACHINE


def test_bad_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.dtype.*'auto'.*'int8'"):
        EngineConfig(dtype="int8")
    # generate() checks its keywords before loading anything
    with pytest.raises(ValueError, match=r"EngineConfig\.dtype"):
        jpaged.generate(["x"], model="/nonexistent/checkpoint", dtype="int8")


def test_a_one_shot_generate_compiles_only_what_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """No warm-up for one call (every shape bucket compiled for prompts that use two), unless
    asked for; an LLM keeps its warm-up."""
    from jpaged.engine import llm

    seen: list[object] = []

    class Engine:
        def __init__(self, model: str, **options: object) -> None:
            seen.append(options.get("warmup"))

        def generate(self, prompts: object, params: object) -> list:
            return []

    monkeypatch.setattr(llm, "LLM", Engine)
    jpaged.generate(["x"], model="m", max_tokens=1)
    jpaged.generate(["x"], model="m", max_tokens=1, warmup=True)
    assert seen == [False, True]
    assert EngineConfig().warmup  # LLM(model) warms up


def test_generate_loads_a_path_in_the_resolved_dtype(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    real = models.load

    def load(
        path: str,
        dtype: str,
        tensor_parallel: int = 1,
        quantization: str = "auto",
        activations: str = "float",
    ) -> models.LoadedModel:
        loads.append(dtype)
        return real(path, dtype, tensor_parallel, quantization, activations)

    monkeypatch.setattr(models, "load", load)
    out = jpaged.generate(
        ["hi"],
        model=str(tiny_llama_dir),
        dtype="auto",
        max_tokens=2,
        temperature=0,
        ignore_eos=True,
        warmup=False,
        max_seq_len=32,
        max_batch_size=2,
        block_size=4,
    )
    assert loads == [THIS_MACHINE]
    assert len(out[0].token_ids) == 2


def test_explicit_dtype_wins_over_the_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_llama_dir, tmp_path / "ckpt")
    hf = json.loads((path / "config.json").read_text())
    hf.update(torch_dtype="float16", dtype="float16")  # transformers 4 and 5 spell it so
    (path / "config.json").write_text(json.dumps(hf))
    weights = load_file(path / "model.safetensors")
    save_file(
        {k: v.astype(np.float16) for k, v in weights.items()},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )

    def dtypes(model: models.LoadedModel) -> set[jnp.dtype]:
        return {x.dtype for x in jax.tree_util.tree_leaves(nnx.state(model.model))}

    for dtype in ("float32", "bfloat16"):
        assert dtypes(models.load(path, dtype=dtype)) == {jnp.dtype(dtype)}
    assert dtypes(models.load(path)) == {jnp.dtype(THIS_MACHINE)}  # auto, not float16
