"""jpaged's forward vs transformers' PyTorch model, in float32, on tiny random checkpoints.

Every step goes through the paged KV pool: prefill of a batch of prompts of different
lengths (with a padding row), >= 16 decode steps over a randomized non-contiguous block
assignment and over a contiguous one, and chunked prefill over cached prefix blocks.
The reference is one transformers forward per whole sequence: its logits at position p
are what jpaged must produce for the step whose last token sits at p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from jpaged.cache import kv_pool
from jpaged.cache.protocol import StepMetadata

# case id -> (family, config.json overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {}),
    "gemma3_mm": ("gemma3_mm", {}),
    # Llama-3.1-8B-style untied LM head, plus the optional biases and linear RoPE scaling
    "llama_untied_bias": ("llama", {
        "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
        "rope_scaling": {"factor": 4.0, "rope_type": "linear"},
    }),
}  # fmt: skip
ATOL = 1e-4
BLOCK, NUM_BLOCKS, WIDTH = 4, 48, 8  # WIDTH pages hold a prompt plus every decode step
LQ, STEPS = 16, 16
PROMPT_LENS = [5, None, 16, 11]  # None: a padding row
SPLITS = [2, None, 9, 6]  # chunked prefill: first chunk length per row

forward = jax.jit(models.forward, static_argnames=("config", "attention_impl"), donate_argnums=1)


@dataclasses.dataclass
class Case:
    model: models.LoadedModel
    sequences: list[np.ndarray | None]  # prompt + STEPS tokens per row
    reference: list[np.ndarray | None]  # transformers' logits [len, vocab] per row


@pytest.fixture(scope="module", params=list(CASES))
def case(
    request: pytest.FixtureRequest,
    tiny_checkpoint: Callable[..., Path],
    hf_reference: Callable[[Path], Any],
) -> Case:
    import torch

    family, overrides = CASES[request.param]
    path = tiny_checkpoint(family, **overrides)
    model = models.load(path, dtype="float32")
    rng = np.random.default_rng(0)
    sequences: list[np.ndarray | None] = []
    reference: list[np.ndarray | None] = []
    for n in PROMPT_LENS:
        if n is None:
            sequences.append(None)
            reference.append(None)
            continue
        seq = rng.integers(0, model.config.vocab_size, n + STEPS)
        with torch.no_grad():
            logits = hf_reference(path)(torch.tensor(seq[None])).logits[0].numpy()
        sequences.append(seq)
        reference.append(logits)
    return Case(model, sequences, reference)


def page_tables(layout: str) -> list[list[int]]:
    if layout == "contiguous":
        return [list(range(1 + WIDTH * r, 1 + WIDTH * (r + 1))) for r in range(len(PROMPT_LENS))]
    blocks = np.random.default_rng(1).permutation(np.arange(1, NUM_BLOCKS))
    return [blocks[WIDTH * r : WIDTH * (r + 1)].tolist() for r in range(len(PROMPT_LENS))]


def step(
    case: Case,
    kv: kv_pool.KVPool,
    tables: list[list[int]],
    ends: list[int],  # per row: tokens stored after this step
    starts: list[int],  # per row: first new token
    lq: int,
    impl: str = "xla",
) -> tuple[np.ndarray, kv_pool.KVPool]:
    """Run one forward writing tokens [start, end) of every live row; padding rows stay empty."""
    live = [s is not None for s in case.sequences]
    context = np.array([e if ok else 0 for e, ok in zip(ends, live, strict=True)], np.int32)
    query = np.array([e - s if ok else 0 for s, e, ok in zip(starts, ends, live, strict=True)],
                     np.int32)  # fmt: skip
    table = np.array([t if ok else [0] * WIDTH for t, ok in zip(tables, live, strict=True)],
                     np.int32)  # fmt: skip
    j = np.arange(lq)
    valid = j < query[:, None]
    pos = np.where(valid, (context - query)[:, None] + j, 0)
    slots = np.where(valid, np.take_along_axis(table, pos // BLOCK, 1) * BLOCK + pos % BLOCK, 0)
    tokens = np.zeros((len(tables), lq), np.int32)
    for r, seq in enumerate(case.sequences):
        if seq is not None:
            tokens[r, : query[r]] = seq[starts[r] : ends[r]]
    meta = StepMetadata(slots.astype(np.int32), table, context, query)
    logits, kv = forward(case.model.params, kv, jnp.asarray(tokens), meta,
                         config=case.model.config, attention_impl=impl)  # fmt: skip
    return np.asarray(logits), kv


def check(case: Case, logits: np.ndarray, ends: list[int], what: str) -> None:
    for r, ref in enumerate(case.reference):
        if ref is None:
            assert np.isfinite(logits[r]).all(), f"{what}: padding row {r} is not finite"
            continue
        err = np.abs(logits[r] - ref[ends[r] - 1]).max()
        assert err <= ATOL, f"{what}: row {r} position {ends[r] - 1}: max abs diff {err:.2e}"


def new_pool(case: Case) -> kv_pool.KVPool:
    c = case.model.config
    return kv_pool.create(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                          dtype="float32")  # fmt: skip


def prompt_lens() -> list[int]:
    return [n or 0 for n in PROMPT_LENS]


def test_prefill(case: Case) -> None:
    ends = prompt_lens()
    logits, _ = step(case, new_pool(case), page_tables("paged"), ends, [0] * len(ends), LQ)
    check(case, logits, ends, "prefill")


@pytest.mark.parametrize(
    "layout, impl", [("paged", "xla"), ("contiguous", "xla"), ("paged", "pallas")]
)
def test_decode(case: Case, layout: str, impl: str) -> None:
    tables = page_tables(layout)
    ends = prompt_lens()
    kv = new_pool(case)
    _, kv = step(case, kv, tables, ends, [0] * len(ends), LQ)
    for i in range(STEPS):
        starts, ends = ends, [e + 1 for e in ends]
        logits, kv = step(case, kv, tables, ends, starts, 1, impl)
        check(case, logits, ends, f"{layout}/{impl} decode step {i}")


def test_chunked_prefill(case: Case) -> None:
    tables = page_tables("paged")
    splits = [s or 0 for s in SPLITS]
    ends = prompt_lens()
    kv = new_pool(case)
    logits, kv = step(case, kv, tables, splits, [0] * len(ends), LQ)
    check(case, logits, splits, "first chunk")
    logits, kv = step(case, kv, tables, ends, splits, LQ)
    check(case, logits, ends, "second chunk over cached blocks")


def test_attn_softcap_paths_agree(case: Case) -> None:
    """attn_logit_softcapping (no family's transformers port applies it) is applied the same
    way by the prefill path and the decode kernel."""
    capped = dataclasses.replace(case.model, config=dataclasses.replace(
        case.model.config, attn_logit_softcapping=0.5))  # fmt: skip
    capped_case = Case(capped, case.sequences, case.reference)
    tables = page_tables("paged")
    ends = prompt_lens()
    one_shot, _ = step(capped_case, new_pool(case), tables, ends, [0] * len(ends), LQ)
    before = [e - 1 if e else 0 for e in ends]
    _, kv = step(capped_case, new_pool(case), tables, before, [0] * len(ends), LQ)
    decoded, _ = step(capped_case, kv, tables, ends, before, 1)
    live = [r for r, n in enumerate(PROMPT_LENS) if n is not None]
    np.testing.assert_allclose(decoded[live], one_shot[live], atol=ATOL)
    uncapped, _ = step(case, new_pool(case), tables, ends, [0] * len(ends), LQ)
    assert np.abs(uncapped[live] - one_shot[live]).max() > 1e-2  # the cap really acted


def test_bfloat16_tracks_float32(case: Case) -> None:
    model = models.load(case.model.source, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    c = model.config
    kv = kv_pool.create(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        block_size=BLOCK, num_blocks=NUM_BLOCKS, dtype="bfloat16")  # fmt: skip
    ends = prompt_lens()
    logits, _ = step(Case(model, case.sequences, case.reference), kv, page_tables("paged"),
                     ends, [0] * len(ends), LQ)  # fmt: skip
    assert logits.dtype == np.float32
    for r, ref in enumerate(case.reference):
        if ref is not None:
            scale = np.abs(ref[ends[r] - 1]).max()
            assert np.abs(logits[r] - ref[ends[r] - 1]).max() < 0.1 * scale


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 8.0},
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ],
    ids=["default", "linear", "llama3"],
)  # fmt: skip
def test_rope_inv_freq_matches_transformers(rope_scaling: dict | None) -> None:
    """At Llama-3.2-1B's real head_dim and theta, where llama3 scaling hits all three bands."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models import llama
    from models.common import rope_inv_freq

    hf = {"hidden_size": 2048, "num_attention_heads": 32, "head_dim": 64, "rope_theta": 500000.0,
          "rope_scaling": rope_scaling, "max_position_embeddings": 131072}  # fmt: skip
    config = llama.model_config(hf)
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    hf_config = LlamaConfig(**hf)
    kind = hf_config.rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[kind](hf_config)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
