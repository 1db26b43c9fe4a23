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
from flax import nnx

from jpaged import models
from jpaged.cache import kv_pool
from jpaged.kernels import ragged_plan
from jpaged.models import loader

# case id -> (family, config.json overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    # Qwen3-MoE: 8 experts, top-2 unnormalised, a dense layer (tests/unit/test_moe.py: more)
    "qwen3moe": ("qwen3moe", {}),
    "gemma3": ("gemma3", {}),
    "gemma3_mm": ("gemma3_mm", {}),
    # Llama-3.1-8B-style untied LM head, plus the optional biases and linear RoPE scaling
    "llama_untied_bias": (
        "llama",
        {
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {"factor": 4.0, "rope_type": "linear"},
        },
    ),
}
# Cases whose attention is another case's (Qwen3-MoE's is Qwen3's): the tests of attention
# alone (the Pallas kernel, chunks over cached blocks, soft caps) run on that case only, as
# each is a program or more to compile (the suite's time)
SAME_ATTENTION = {"qwen3moe": "qwen3"}
ATOL = 1e-4
BLOCK, NUM_BLOCKS, WIDTH = 4, 48, 8  # WIDTH pages hold a prompt plus every decode step
STEPS = 16
PROMPT_LENS = [5, None, 16, 11]  # None: a padding row
SPLITS = [2, None, 9, 6]  # chunked prefill: first chunk length per row

forward = jax.jit(models.forward, static_argnames=("attention_impl",), donate_argnums=2)


@dataclasses.dataclass
class Case:
    model: models.LoadedModel
    sequences: list[np.ndarray | None]  # prompt + STEPS tokens per row
    reference: list[np.ndarray | None]  # transformers' logits [len, vocab] per row
    name: str = ""  # its id in CASES


def attention_only(case: Case) -> None:
    """Skip a test of attention alone on a case whose attention another case tests."""
    if case.name in SAME_ATTENTION:
        pytest.skip(f"attention as {SAME_ATTENTION[case.name]}'s, tested there")


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
    return Case(model, sequences, reference, request.param)


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
    impl: str = "xla",
) -> tuple[np.ndarray, kv_pool.KVPool]:
    """One forward writing tokens [start, end) of every live row (decodes and chunks alike,
    in one flat step with padding tokens and a padding sequence); logits per row, the
    padding sequence's for padding rows."""
    live = [r for r, seq in enumerate(case.sequences) if seq is not None and ends[r] > starts[r]]
    query = np.array([ends[r] - starts[r] for r in live])
    new = [case.sequences[r][starts[r] : ends[r]] for r in live]  # type: ignore[index]
    num_tokens = int(query.sum()) + 3
    meta = ragged_plan.plan(
        query,
        np.array([ends[r] for r in live]),
        np.array([tables[r] for r in live]),
        num_tokens=num_tokens,
        num_seqs=len(live) + 1,
        width=WIDTH,
        block_size=BLOCK,
        impl=impl,
    )
    tokens = np.zeros(num_tokens, np.int32)
    tokens[: query.sum()] = np.concatenate(new)
    last = np.zeros(len(live) + 1, np.int32)
    last[: len(live)] = np.cumsum(query) - 1
    logits, kv = forward(
        *nnx.split(case.model.model),
        kv,
        jnp.asarray(tokens),
        meta,
        jnp.asarray(last),
        attention_impl=impl,
    )
    logits = np.asarray(logits)
    rows = np.repeat(logits[-1:], len(case.sequences), axis=0)
    rows[live] = logits[: len(live)]
    return rows, kv


def check(case: Case, logits: np.ndarray, ends: list[int], what: str) -> None:
    for r, ref in enumerate(case.reference):
        if ref is None:
            assert np.isfinite(logits[r]).all(), f"{what}: padding row {r} is not finite"
            continue
        err = np.abs(logits[r] - ref[ends[r] - 1]).max()
        assert err <= ATOL, f"{what}: row {r} position {ends[r] - 1}: max abs diff {err:.2e}"


def new_pool(case: Case) -> kv_pool.KVPool:
    c = case.model.config
    return kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        dtype="float32",
    )


def prompt_lens() -> list[int]:
    return [n or 0 for n in PROMPT_LENS]


def test_prefill(case: Case) -> None:
    ends = prompt_lens()
    logits, _ = step(case, new_pool(case), page_tables("paged"), ends, [0] * len(ends))
    check(case, logits, ends, "prefill")


@pytest.mark.parametrize(
    "layout, impl", [("paged", "xla"), ("contiguous", "xla"), ("paged", "pallas")]
)
def test_decode(case: Case, layout: str, impl: str) -> None:
    if impl == "pallas":
        attention_only(case)
    tables = page_tables(layout)
    ends = prompt_lens()
    kv = new_pool(case)
    _, kv = step(case, kv, tables, ends, [0] * len(ends))
    for i in range(STEPS):
        starts, ends = ends, [e + 1 for e in ends]
        logits, kv = step(case, kv, tables, ends, starts, impl)
        check(case, logits, ends, f"{layout}/{impl} decode step {i}")


def test_chunked_prefill(case: Case) -> None:
    attention_only(case)  # (a mixture's chunk after decodes: test_mixed_step)
    tables = page_tables("paged")
    splits = [s or 0 for s in SPLITS]
    ends = prompt_lens()
    kv = new_pool(case)
    logits, kv = step(case, kv, tables, splits, [0] * len(ends))
    check(case, logits, splits, "first chunk")
    logits, kv = step(case, kv, tables, ends, splits)
    check(case, logits, ends, "second chunk over cached blocks")


def test_mixed_step(case: Case) -> None:
    """Decodes and prompt chunks in one step: rows 0 and 3 decode while row 2 finishes its
    prompt over its cached first chunk."""
    tables = page_tables("paged")
    ends = prompt_lens()
    first = [ends[0], 0, SPLITS[2], ends[3]]
    kv = new_pool(case)
    logits, kv = step(case, kv, tables, first, [0] * len(ends))
    check(case, logits, first, "prefill")
    mixed = [first[0] + 1, 0, ends[2], first[3] + 1]
    logits, kv = step(case, kv, tables, mixed, first)
    check(case, logits, mixed, "decodes beside a prompt chunk")


def test_attn_softcap_paths_agree(case: Case) -> None:
    """attn_logit_softcapping (no family's transformers port applies it) is applied the same
    way by a prefill step and a decode step."""
    attention_only(case)
    config = dataclasses.replace(case.model.config, attn_logit_softcapping=0.5)
    graphdef = nnx.graphdef(loader.abstract(config, jnp.float32))
    capped = dataclasses.replace(case.model, model=nnx.merge(graphdef, nnx.state(case.model.model)))
    capped_case = Case(capped, case.sequences, case.reference)
    tables = page_tables("paged")
    ends = prompt_lens()
    one_shot, _ = step(capped_case, new_pool(case), tables, ends, [0] * len(ends))
    before = [e - 1 if e else 0 for e in ends]
    _, kv = step(capped_case, new_pool(case), tables, before, [0] * len(ends))
    decoded, _ = step(capped_case, kv, tables, ends, before)
    live = [r for r, n in enumerate(PROMPT_LENS) if n is not None]
    np.testing.assert_allclose(decoded[live], one_shot[live], atol=ATOL)
    uncapped, _ = step(case, new_pool(case), tables, ends, [0] * len(ends))
    assert np.abs(uncapped[live] - one_shot[live]).max() > 1e-2  # the cap really acted


def test_bfloat16_tracks_float32(case: Case) -> None:
    model = models.load(case.model.source, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(model.model)))
    c = model.config
    kv = kv_pool.create(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        dtype="bfloat16",
    )
    ends = prompt_lens()
    logits, _ = step(
        Case(model, case.sequences, case.reference), kv, page_tables("paged"), ends, [0] * len(ends)
    )
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
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_inv_freq_matches_transformers(rope_scaling: dict | None) -> None:
    """At Llama-3.2-1B's real head_dim and theta, where llama3 scaling hits all three bands."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jpaged.models import llama
    from jpaged.models.common import rope_inv_freq

    hf = {
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": 131072,
    }
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
