import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.engine.sampling import (
    NUM_TOP_LOGPROBS,
    RequestError,
    SamplingArrays,
    SamplingParams,
    sample,
    variant,
)

_sample = jax.jit(sample, static_argnames=("greedy", "top"))


def sample_jit(logits, params, **forced):
    """The variant the runner would pick for `params`, unless `forced`."""
    return _sample(logits, params, **{**variant(params), **forced})


def arrays(b, temperature=1.0, top_k=0, top_p=1.0, seed=0, sample_index=0, logprobs=0):
    def full(x, dt):
        return np.broadcast_to(np.asarray(x, dt), (b,)).copy()

    return SamplingArrays(
        full(temperature, np.float32),
        full(top_k, np.int32),
        full(top_p, np.float32),
        full(seed, np.uint32),
        full(sample_index, np.int32),
        full(logprobs, np.int32),
    )


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(0), (8, 300)) * 3


def test_greedy_and_logprobs(logits):
    wants = np.array([0] * 7 + [2], np.int32)  # one row asking is enough for the whole batch
    a = arrays(8, temperature=0.0)
    tokens, lp, top_ids, top_lp = sample_jit(logits, dataclasses.replace(a, logprobs=wants))
    ref = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    np.testing.assert_allclose(lp, ref.max(-1), rtol=1e-6)
    assert top_ids.shape == (8, NUM_TOP_LOGPROBS)
    np.testing.assert_allclose(top_lp, jnp.sort(ref, -1)[:, ::-1][:, :NUM_TOP_LOGPROBS], rtol=1e-6)
    np.testing.assert_array_equal(top_ids[:, 0], tokens)


def test_no_alternatives_unless_asked(logits):
    tokens, lp, top_ids, _ = sample_jit(logits, arrays(8, temperature=0.0))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits, -1).max(-1), rtol=1e-6)
    assert not np.asarray(top_ids).any()


def test_mixed_batch_greedy_rows_stay_greedy(logits):
    temps = np.array([0.0, 1.0] * 4, np.float32)
    tokens, *_ = sample_jit(logits, dataclasses.replace(arrays(8, seed=3), temperature=temps))
    np.testing.assert_array_equal(np.asarray(tokens)[::2], np.asarray(jnp.argmax(logits, -1))[::2])


def test_temperature_zero_rows_are_greedy_in_the_sampling_variant(logits):
    tokens, *_ = sample_jit(logits, arrays(8, temperature=0.0), greedy=False)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))


def test_variant_follows_the_batch():
    assert variant(arrays(4, temperature=0.0)) == {"greedy": True, "top": False}
    mixed = dataclasses.replace(arrays(4, temperature=0.0), temperature=np.array([0, 0, 0.5, 0]))
    assert variant(mixed) == {"greedy": False, "top": False}
    asks = dataclasses.replace(arrays(4, temperature=0.0), logprobs=np.array([0, 1, 0, 0]))
    assert variant(asks) == {"greedy": True, "top": True}


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    for a in (arrays(8, top_k=1), arrays(8, top_p=1e-6)):
        tokens, *_ = sample_jit(logits, a)
        np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))


def test_seed_reproducible_and_sample_index_changes_draw(logits):
    a = sample_jit(logits, arrays(8, seed=7))[0]
    b = sample_jit(logits, arrays(8, seed=7))[0]
    np.testing.assert_array_equal(a, b)
    draws = {tuple(np.asarray(sample_jit(logits, arrays(8, seed=7, sample_index=i))[0]))
             for i in range(6)}  # fmt: skip
    assert len(draws) > 1


def test_top_k_restricts_support():
    logits = jnp.tile(jnp.arange(50, dtype=jnp.float32)[None] * 0.01, (64, 1))
    tokens, *_ = sample_jit(logits, arrays(64, top_k=3, seed=np.arange(64)))
    assert set(np.asarray(tokens).tolist()) <= {47, 48, 49}
    assert len(set(np.asarray(tokens).tolist())) > 1


def test_top_p_restricts_support():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = jnp.tile(jnp.log(probs)[None], (64, 1))
    tokens, *_ = sample_jit(logits, arrays(64, top_p=0.7, seed=np.arange(64)))
    assert set(np.asarray(tokens).tolist()) == {0, 1}


def test_sample_frequencies_follow_temperature_one():
    probs = np.array([0.6, 0.3, 0.1], np.float32)
    logits = jnp.tile(jnp.log(probs)[None], (4000, 1))
    tokens, *_ = sample_jit(logits, arrays(4000, seed=np.arange(4000)))
    freq = np.bincount(np.asarray(tokens), minlength=3) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2**30),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", 10**400),  # beyond float32: the step would fail for every row
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2**31),  # beyond int32
        ("seed", -1),
        ("stop", [""]),
        ("logprobs", 6),
        ("n", 0),
        ("n", 1000),
        ("n", 2.0),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_params_name_the_field(field, value):
    with pytest.raises(RequestError, match=field) as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field and isinstance(raised.value, ValueError)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="x").stop == ["x"]
