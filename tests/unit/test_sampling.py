import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.engine.controls import ControlSlots, RowControls
from jpaged.engine.sampling import (
    NUM_TOP_LOGPROBS,
    TEMPERATURE_MAX,
    RequestError,
    SamplingArrays,
    SamplingParams,
    StructuredOutputsParams,
    apply_controls,
    count,
    sample,
    variant,
)

_sample = jax.jit(sample, static_argnames=("greedy", "top"))


def sample_jit(logits, params, **forced):
    """The variant the runner would pick for `params`, unless `forced`."""
    return _sample(logits, params, **{**variant(params), **forced})


def arrays(
    b,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seed=0,
    sample_index=0,
    logprobs=0,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    block_eos=0,
    slot=0,
):
    def full(x, dt):
        return np.broadcast_to(np.asarray(x, dt), (b,)).copy()

    return SamplingArrays(
        full(temperature, np.float32),
        full(top_k, np.int32),
        full(top_p, np.float32),
        full(min_p, np.float32),
        full(seed, np.uint32),
        full(sample_index, np.int32),
        full(logprobs, np.int32),
        full(presence, np.float32),
        full(frequency, np.float32),
        full(repetition, np.float32),
        full(block_eos, np.int32),
        full(slot, np.int32),
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
    assert variant(arrays(4, temperature=0.0)) == {"greedy": True, "top": 0}
    mixed = dataclasses.replace(arrays(4, temperature=0.0), temperature=np.array([0, 0, 0.5, 0]))
    assert variant(mixed) == {"greedy": False, "top": 0}
    asks = dataclasses.replace(arrays(4, temperature=0.0), logprobs=np.array([0, 1, 0, 0]))
    assert variant(asks) == {"greedy": True, "top": NUM_TOP_LOGPROBS}
    # beam search wants more alternatives: a power of two, so few programs compile
    beams = dataclasses.replace(asks, logprobs=np.array([0, 12, 0, 0]))
    assert variant(beams) == {"greedy": True, "top": 16}


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    for a in (arrays(8, top_k=1), arrays(8, top_p=1e-6)):
        tokens, *_ = sample_jit(logits, a)
        np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))


def test_seed_reproducible_and_sample_index_changes_draw(logits):
    a = sample_jit(logits, arrays(8, seed=7))[0]
    b = sample_jit(logits, arrays(8, seed=7))[0]
    np.testing.assert_array_equal(a, b)
    draws = {
        tuple(np.asarray(sample_jit(logits, arrays(8, seed=7, sample_index=i))[0]))
        for i in range(6)
    }
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


def test_min_p_cuts_tokens_below_its_share_of_the_likeliest():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = jnp.tile(jnp.log(probs)[None], (64, 1))
    # 0.3 >= 0.5 * 0.5 > 0.15: two tokens survive; at temperature 2 the third reaches the bar
    tokens, *_ = sample_jit(logits, arrays(64, min_p=0.5, seed=np.arange(64)))
    assert set(np.asarray(tokens).tolist()) == {0, 1}
    tokens, *_ = sample_jit(logits, arrays(64, temperature=2.0, min_p=0.5, seed=np.arange(64)))
    assert set(np.asarray(tokens).tolist()) == {0, 1, 2}


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
        ("logprobs", 21),
        ("n", 0),
        ("n", 1000),
        ("n", 2.0),
        ("ignore_eos", "yes"),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", "2"),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", [5]),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens (16)
        ("structured", {"json": {}}),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", None),
    ],
)
def test_bad_params_name_the_field(field, value):
    with pytest.raises(RequestError, match=field) as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field and isinstance(raised.value, ValueError)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize(
    "spec,field",
    [
        (dict(), "structured"),
        (dict(regex="a", choice=["a"]), "structured"),
        (dict(json="{not json"), "structured.json"),
        (dict(json=[1, 2]), "structured.json"),
        (dict(json_object="yes"), "structured.json_object"),
        (dict(regex=""), "structured.regex"),
        (dict(choice=[]), "structured.choice"),
        (dict(choice=["a", 3]), "structured.choice"),
        (dict(grammar=5), "structured.grammar"),
    ],
)
def test_bad_structured_specs_name_the_field(spec, field):
    with pytest.raises(RequestError) as raised:
        StructuredOutputsParams(**spec)
    assert raised.value.field == field


def test_min_tokens_and_structured_are_refused_together():
    with pytest.raises(RequestError) as raised:
        SamplingParams(min_tokens=2, structured=StructuredOutputsParams(regex="a+"))
    assert raised.value.field == "min_tokens"


# -- sampling controls against transformers' logits processors ------------------------

VOCAB = 300
EOS = (7, 11)


def controls_state(rows):
    """ControlState holding `rows` [(history, prompt_len, logit_bias)], slot i for row i,
    filled as the runner fills it."""
    slots = ControlSlots(len(rows), VOCAB, EOS, jnp.asarray)
    controls = [
        RowControls(logit_bias=bias, history=history, prompt_len=n) for history, n, bias in rows
    ]
    assigned = slots.assign(list(range(len(rows))), controls, lambda f, *a: f(*a))
    np.testing.assert_array_equal(assigned, np.arange(len(rows)))
    return slots.state


@pytest.fixture(scope="module")
def histories():
    rng = np.random.default_rng(1)
    out = []
    for _ in range(4):
        n = int(rng.integers(1, 12))
        history = rng.integers(0, VOCAB, n + int(rng.integers(0, 12))).tolist()
        out.append((history, n))
    return out


def test_repetition_penalty_equals_transformers(logits, histories):
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    state = controls_state([(h, n, None) for h, n in histories])
    for penalty in (1.3, 0.7):
        p = arrays(4, repetition=penalty, slot=np.arange(4))
        got = apply_controls(logits[:4], p, state, None)
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        for i, (history, _) in enumerate(histories):  # over prompt + generated tokens
            want = hf(torch.tensor([history]), torch.tensor(np.asarray(logits[i : i + 1])))
            np.testing.assert_allclose(got[i], want[0].numpy(), rtol=1e-6)


def test_presence_and_frequency_penalties_are_openais(logits, histories):
    state = controls_state([(h, n, None) for h, n in histories])
    p = arrays(4, presence=0.5, frequency=-1.25, slot=np.arange(4))
    got = np.asarray(apply_controls(logits[:4], p, state, None))
    for i, (history, n) in enumerate(histories):  # over generated tokens only
        counts = np.bincount(history[n:], minlength=VOCAB)
        want = np.asarray(logits[i]) - (-1.25) * counts - 0.5 * (counts > 0)
        np.testing.assert_allclose(got[i], want, rtol=1e-6)


def test_logit_bias_and_min_tokens_equal_transformers(logits):
    import torch
    from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

    bias = {3: 5.0, 250: -100.0, 7: 0.5}
    state = controls_state([([1, 2], 2, bias), ([1, 2], 2, None)])
    p = arrays(2, slot=np.arange(2), block_eos=np.array([1, 0]))
    got = np.asarray(apply_controls(logits[:2], p, state, None))
    ids, scores = torch.tensor([[1, 2]]), torch.tensor(np.asarray(logits[:2]))
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids, scores[:1])
    want = MinNewTokensLengthLogitsProcessor(2, 1, list(EOS))(ids, want)  # 0 of 1 new tokens
    np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[1], np.asarray(logits[1]), rtol=1e-6)  # no controls


def test_min_tokens_holds_stop_token_ids_back_with_eos(logits):
    """vLLM's: a row's stop_token_ids, like EOS, are not sampled before min_tokens; its
    slot, refilled for another sequence, holds EOS alone again."""
    slots = ControlSlots(2, VOCAB, EOS, jnp.asarray)
    rows = [RowControls(history=[1], prompt_len=1, held=[5, 250]), RowControls(history=[1])]
    slots.assign([0, 1], rows, lambda f, *a: f(*a))
    p = arrays(3, slot=np.array([0, 1, 2]), block_eos=1)  # slot 2: the inert row
    got = np.isneginf(np.asarray(apply_controls(logits[:3], p, slots.state, None)))
    assert [set(np.flatnonzero(row)) for row in got] == [{5, 7, 11, 250}, {7, 11}, {7, 11}]
    done = arrays(1, slot=0, block_eos=0)  # min_tokens reached
    assert not np.isneginf(np.asarray(apply_controls(logits[:1], done, slots.state, None))).any()
    slot = slots.assign([2], [RowControls(history=[1])], lambda f, *a: f(*a))  # 0 and 1 left
    assert slot.tolist() == [0]
    p = arrays(1, slot=slot, block_eos=1)
    got = np.isneginf(np.asarray(apply_controls(logits[:1], p, slots.state, None)))
    assert set(np.flatnonzero(got[0])) == {7, 11}


def test_a_biased_token_is_sampled_as_often_as_its_probability():
    rows, bias = 4000, 6.0
    state = controls_state([([0], 1, {3: bias})])
    logits = jnp.zeros((rows, VOCAB))
    params = arrays(rows, seed=np.arange(rows), slot=0)
    tokens, *_ = _sample(logits, params, greedy=False, top=0, state=state)
    want = np.exp(bias) / (np.exp(bias) + VOCAB - 1)  # 0.57
    assert abs(np.mean(np.asarray(tokens) == 3) - want) < 0.025


def test_the_sampler_counts_what_it_samples():
    state = controls_state([([5, 6], 2, None)])
    slots, tokens = jnp.array([0, 0, 1]), jnp.array([9, 9, 4])  # row 2: the inert slot
    counted = count(state, slots, tokens)
    assert int(counted.counts[0, 9]) == 2 and int(counted.counts[0].sum()) == 2
    p = arrays(1, frequency=1.0)
    np.testing.assert_allclose(apply_controls(jnp.zeros((1, VOCAB)), p, counted, None)[0, 9], -2)


def test_the_grammar_mask_keeps_only_allowed_tokens(logits):
    allowed_ids = [[3, 40, 299], [0]]
    mask = np.zeros((2, (VOCAB + 31) // 32), np.int32)
    for i, ids in enumerate(allowed_ids):
        for t in ids:
            mask[i, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(2**31))
    for greedy in (True, False):
        tokens, lp, *_ = _sample(
            logits[:2], arrays(2, seed=np.arange(2)), greedy=greedy, top=0, mask=jnp.asarray(mask)
        )
        for i, ids in enumerate(allowed_ids):
            assert int(tokens[i]) in ids
        if greedy:
            assert int(tokens[0]) == ids_max(logits[0], allowed_ids[0])
        # logprobs stay the model's
        np.testing.assert_allclose(
            lp, jax.nn.log_softmax(logits[:2])[np.arange(2), tokens], rtol=1e-5
        )


def test_a_huge_temperature_samples_only_allowed_tokens(logits):
    """Near float32's top a temperature's reciprocal is zero on XLA:CPU; masked tokens
    stay out (they turned NaN, and the row sampled token 0)."""
    mask = np.zeros((4, (VOCAB + 31) // 32), np.int32)
    mask[:, 1] = 1 << 5  # token 37 only
    tokens, *_ = _sample(
        logits[:4] * 10,
        arrays(4, temperature=TEMPERATURE_MAX, seed=np.arange(4)),
        greedy=False,
        top=0,
        mask=jnp.asarray(mask),
    )
    assert tokens.tolist() == [37] * 4


def ids_max(row, ids):
    return ids[int(np.argmax(np.asarray(row)[ids]))]
