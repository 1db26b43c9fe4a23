"""SamplingParams and the sampler that runs on the device after each step.

Every row carries its own temperature / top-k / top-p / seed as arrays, so one
compiled program serves any mix of requests. The costly parts are static
variants the host picks per batch, never device-side branches (a `lax.cond` on
GPU copies its predicate to the host and blocks it until the GPU gets there):
an all-greedy batch skips the noise and the top-k/top-p search, and a batch
where nobody asked for logprobs skips the top-5 alternatives (25% of a 48-row
decode step on CPU).

The sampling controls (penalties, logit bias, min_tokens) and the grammar mask of
structured outputs are two more variants, compiled when first needed: `controls`
reads per-sequence state kept on the device (`ControlState`: counts of generated
tokens, the prompt's tokens, dense logit biases), which the sampler itself updates
with each token it samples; `masked` takes a packed token bitmask (32 tokens an int32
word) for the rows a grammar constrains.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NUM_TOP_LOGPROBS = 5  # OpenAI's completions API allows at most 5 alternatives
# OpenAI chat's top_logprobs limit. Sampled tokens only: more than NUM_TOP_LOGPROBS picks a
# sampler variant of its own (compiled when first asked), costing nothing to the others;
# prompt logprobs stay at NUM_TOP_LOGPROBS, which every scoring step program computes.
MAX_LOGPROBS = 20
MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 256  # choices per request (the engine also caps n at max_batch_size)
# What the sampler's arrays hold: float32 temperatures, int32 top_k, uint32 seeds (a larger
# value would fail a whole step). The server's published schema takes its ranges from here.
TEMPERATURE_MAX = float(np.finfo(np.float32).max)
TOP_K_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1
PENALTY_MAX = 2.0  # presence / frequency penalties, as OpenAI bounds them: [-2, 2]
LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit bias: [-100, 100]


class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending request field (the
    server's 400 says which)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:  # (pickled whole: an engine process raises it to its server)
        return type(self), (self.field, str(self))


class ContextLengthError(RequestError):
    """A prompt, with the tokens it asks for, longer than the context (max_seq_len): the
    numbers a server words it with (OpenAI's `context_length_exceeded`)."""

    def __init__(
        self, field: str, message: str, max_seq_len: int, prompt_tokens: int, max_tokens: int
    ) -> None:
        super().__init__(field, message)
        self.max_seq_len, self.prompt_tokens, self.max_tokens = (
            max_seq_len,
            prompt_tokens,
            max_tokens,
        )

    def __reduce__(self) -> tuple:
        numbers = (self.max_seq_len, self.prompt_tokens, self.max_tokens)
        return type(self), (self.field, str(self), *numbers)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema (a dict, or its JSON text), any JSON object, a regular expression (Rust
    `regex` syntax), a choice among strings, or a grammar (Lark or GBNF)."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                "structured",
                "structured outputs take exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}; got {given or 'none'}",
            )
        kind = given[0]
        value = getattr(self, kind)
        field = f"structured.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise RequestError(field, f"{field} is not valid JSON: {e}") from None
            if not isinstance(value, dict | bool):
                raise RequestError(
                    field, f"{field} must be a JSON schema (an object), got {type(value).__name__}"
                )
            object.__setattr__(self, "json", value)
        elif kind == "json_object" and value is not True:
            raise RequestError(field, f"{field} must be true, got {value!r}")
        elif kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise RequestError(field, f"{field} must be a non-empty string, got {value!r}")
        elif kind == "choice" and not (
            isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
        ):
            raise RequestError(
                field, f"{field} must be a non-empty list of non-empty strings, got {value!r}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is cached under."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's tokens; checked once, when made (frozen thereafter)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token, 0..MAX_LOGPROBS
    n: int = 1  # choices sampled from one prefill of the prompt (forked sequences)
    # Each prompt token's own logprob (given the tokens before it) and this many likeliest
    # alternatives, 0..NUM_TOP_LOGPROBS; None = none (vLLM's name).
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the generated tokens: logit -= frequency * count + presence
    # * (count > 0); transformers' repetition penalty over prompt + generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    structured: StructuredOutputsParams | None = None
    # vLLM's: tokens whose probability is under min_p times the likeliest one's are cut
    min_p: float = 0.0
    # vLLM's: tokens that end the output as EOS does (once min_tokens are out; also with
    # ignore_eos), their text left out unless include_stop_str_in_output
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False  # the stop string or token ends the text
    skip_special_tokens: bool = True  # the text leaves special tokens out

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        self.validate()

    @property
    def has_controls(self) -> bool:
        """Whether the sampler needs the request's per-sequence state (penalties, bias,
        stop_token_ids that min_tokens holds back)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.repetition_penalty != 1
            or (self.min_tokens and self.stop_token_ids)
        )

    def validate(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise RequestError(name, f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        check(
            is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT,
            "max_tokens",
            f"an int in [1, {MAX_TOKENS_LIMIT}]",
        )
        # the sampler reads them as float32 / int32: a larger value fails the whole step
        check(
            is_num(self.temperature) and 0 <= self.temperature <= TEMPERATURE_MAX,
            "temperature",
            f"a number in [0, {TEMPERATURE_MAX:.4g}]",
        )
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(
            is_int(self.top_k) and -1 <= self.top_k <= TOP_K_MAX,
            "top_k",
            f"an int in [-1, {TOP_K_MAX}] (-1 or 0 = off)",
        )
        check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed <= SEED_MAX),
            "seed",
            f"None or an int in [0, {SEED_MAX}]",
        )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None or an int in [0, {MAX_LOGPROBS}]",
        )
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an int in [1, {MAX_N}]")
        check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= NUM_TOP_LOGPROBS),
            "prompt_logprobs",
            f"None or an int in [0, {NUM_TOP_LOGPROBS}]",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            check(
                is_num(x) and -PENALTY_MAX <= x <= PENALTY_MAX,
                name,
                f"a number in [{-PENALTY_MAX}, {PENALTY_MAX}]",
            )
        check(
            is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= TEMPERATURE_MAX,
            "repetition_penalty",
            f"a number in (0, {TEMPERATURE_MAX:.4g}] (1 = off)",
        )
        bias = self.logit_bias
        check(
            bias is None
            or (
                isinstance(bias, dict)
                and all(
                    is_int(t)
                    and 0 <= t <= TOP_K_MAX
                    and is_num(b)
                    and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX
                    for t, b in bias.items()
                )
            ),
            "logit_bias",
            f"None or a dict of token id (an int >= 0) -> bias in [{-LOGIT_BIAS_MAX}, "
            f"{LOGIT_BIAS_MAX}]",
        )
        check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an int in [0, max_tokens ({self.max_tokens})]",
        )
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        check(
            isinstance(self.stop_token_ids, list)
            and all(is_int(t) and 0 <= t <= TOP_K_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids (ints >= 0)",
        )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name, "a bool")
        check(
            self.structured is None or isinstance(self.structured, StructuredOutputsParams),
            "structured",
            "None or a StructuredOutputsParams",
        )
        # a grammar that is complete allows only EOS, which min_tokens would forbid
        check(
            self.structured is None or self.min_tokens == 0,
            "min_tokens",
            "0 with structured outputs (a complete output allows only EOS)",
        )


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: choice 0 keeps the request's
    seed (so it samples what an n = 1 request would), the others get independent ones."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters: NumPy on the host, jax Arrays inside the step."""

    temperature: np.ndarray | jax.Array  # f32 [B]
    top_k: np.ndarray | jax.Array  # int32 [B], 0 = off
    top_p: np.ndarray | jax.Array  # f32 [B]
    min_p: np.ndarray | jax.Array  # f32 [B], 0 = off
    seed: np.ndarray | jax.Array  # uint32 [B]
    sample_index: np.ndarray | jax.Array  # int32 [B] tokens sampled so far: a fresh key each
    logprobs: np.ndarray | jax.Array  # int32 [B] alternatives wanted, 0 = none
    presence_penalty: np.ndarray | jax.Array  # f32 [B]
    frequency_penalty: np.ndarray | jax.Array  # f32 [B]
    repetition_penalty: np.ndarray | jax.Array  # f32 [B], 1 = off
    block_eos: np.ndarray | jax.Array  # int32 [B], 1 = min_tokens not reached: no EOS
    slot: np.ndarray | jax.Array  # int32 [B] the row's sequence in `ControlState`

    def pack(self) -> np.ndarray:  # int32 [fields, B]: the fields' bits, to travel with the step
        return np.stack(
            [np.asarray(getattr(self, name)).view(np.int32) for name in SAMPLING_FIELDS]
        )

    @classmethod
    def unpack(cls, packed: jax.Array) -> SamplingArrays:  # packed: int32 [fields, B]
        def typed(i: int, field: dataclasses.Field) -> jax.Array:
            dtype = {"float": jnp.float32, "uint32": jnp.uint32}.get(_KIND[field.name])
            return packed[i] if dtype is None else jax.lax.bitcast_convert_type(packed[i], dtype)

        return cls(**{f.name: typed(i, f) for i, f in enumerate(dataclasses.fields(cls))})


# (looked up once: `dataclasses.fields` walks the class each call, and every call packs these)
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingArrays))
_KIND = {
    "temperature": "float",
    "top_p": "float",
    "min_p": "float",
    "seed": "uint32",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
}
_KIND.update({name: "int" for name in SAMPLING_FIELDS if name not in _KIND})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ControlState:
    """What the `controls` variant reads per sequence, kept on the device: one row a slot
    (sequences with penalties or a logit bias), plus a last, inert row every other row
    reads and writes (its penalties are off, its bias zero)."""

    counts: jax.Array  # int32 [slots + 1, V] generated tokens, by id
    prompt: jax.Array  # bool [slots + 1, V] the prompt's tokens (repetition penalty)
    bias: jax.Array  # f32 [slots + 1, V]
    # bool [slots + 1, V] the tokens min_tokens holds back: EOS, and a slot's stop_token_ids
    # (vLLM's); the inert row EOS alone
    held: jax.Array


def apply_controls(
    logits: jax.Array,  # f32 [B, V]
    p: SamplingArrays,
    state: ControlState | None,
    mask: jax.Array | None,  # int32 [B, ceil(V / 32)] allowed tokens, bit t % 32 of word t // 32
) -> jax.Array:
    """The logits the sampler picks from: logit bias, then the repetition penalty, then
    frequency and presence penalties (vLLM's order), then min_tokens and the grammar mask."""
    if state is not None:
        counts = state.counts[p.slot]
        logits = logits + state.bias[p.slot]
        rep = p.repetition_penalty[:, None]
        seen = state.prompt[p.slot] | (counts > 0)
        logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
        logits = (
            logits
            - p.frequency_penalty[:, None] * counts
            - p.presence_penalty[:, None] * (counts > 0)
        )
        logits = jnp.where((p.block_eos[:, None] > 0) & state.held[p.slot], -jnp.inf, logits)
    if mask is not None:
        logits = jnp.where(allowed(mask, logits.shape[-1]), logits, -jnp.inf)
    return logits


def allowed(mask: jax.Array, vocab: int) -> jax.Array:
    """bool [B, vocab] from a packed bitmask int32 [B, ceil(vocab / 32)]."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(len(mask), -1)[:, :vocab] > 0


def count(state: ControlState, slots: np.ndarray | jax.Array, tokens: jax.Array) -> ControlState:
    """Count each row's sampled token in its slot's row (the inert row for the others)."""
    return dataclasses.replace(state, counts=state.counts.at[slots, tokens].add(1))


def sample(
    logits: jax.Array,  # f32 [B, V]
    params: SamplingArrays,
    *,
    greedy: bool,
    top: int,
    state: ControlState | None = None,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (token ids [B], their logprobs [B], top ids [B, K], top logprobs [B, K]).

    `greedy`: every row has temperature 0 (argmax only). `top`: the alternatives some
    row asked for (K of them: NUM_TOP_LOGPROBS, or more for beam search); 0: none,
    and the top ids / logprobs are NUM_TOP_LOGPROBS columns of zeros. Logprobs are those of the
    model's distribution (before controls, temperature and truncation), as vLLM reports
    them. `state` (the `controls` variant) and `mask` (the `masked` one) change the
    logits tokens are picked from (`apply_controls`).
    """
    k = min(top or NUM_TOP_LOGPROBS, logits.shape[-1])
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    picked = apply_controls(logits, params, state, mask)
    tokens = _argmax(picked) if greedy else _sample_tokens(picked, params)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=1) - lse
    if top:
        top_logits, top_ids = _top_k(logits, k)
        top_logprobs = top_logits - lse
    else:
        top_logprobs, top_ids = jnp.zeros((len(logits), k)), jnp.zeros((len(logits), k), jnp.int32)
    return tokens.astype(jnp.int32), chosen[:, 0], top_ids, top_logprobs


def score(
    logits: jax.Array,  # f32 [P, V]
    targets: jax.Array,  # int32 [P]
    *,
    top: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (logprob of each target [P], top ids [P, K], top logprobs [P, K]): how likely
    the model found tokens it was given (prompt logprobs), and, if `top`, its likeliest
    alternatives (zeros otherwise)."""
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logits, targets[:, None], axis=1) - lse
    k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    if not top:
        return chosen[:, 0], jnp.zeros((len(logits), k), jnp.int32), jnp.zeros((len(logits), k))
    top_logits, top_ids = _top_k(logits, k)
    return chosen[:, 0], top_ids, top_logits - lse


def variant(params: SamplingArrays) -> dict[str, Any]:
    """The `sample` variant a batch needs, from its host-side (NumPy) parameters: the
    alternatives it searches are NUM_TOP_LOGPROBS, or a power of two above (beams)."""
    wanted = int(np.asarray(params.logprobs).max())
    top = 0 if wanted <= 0 else max(NUM_TOP_LOGPROBS, 1 << (wanted - 1).bit_length())
    return {"greedy": not bool((np.asarray(params.temperature) > 0).any()), "top": top}


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` by k max-reductions. XLA on CPU lowers `lax.top_k` to a full sort of the
    vocabulary whenever its result feeds further ops (measured: 600 ms vs 2 ms at 48 x 32k)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    values, ids = [], []
    for _ in range(k):
        idx = _argmax(x)[:, None]
        values.append(jnp.take_along_axis(x, idx, axis=-1))
        ids.append(idx.astype(jnp.int32))
        x = jnp.where(iota == idx, -jnp.inf, x)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)


# Halvings of the logit range that find each cut-off: float32 has a 24-bit significand, so
# ~24 narrow the range to float32's spacing at the logits' scale, where midpoints stop moving.
BISECTION_ROUNDS = 24


def _sample_tokens(logits: jax.Array, p: SamplingArrays) -> jax.Array:
    vocab = logits.shape[-1]
    is_greedy = p.temperature <= 0
    # XLA divides by multiplying with the reciprocal, which flushes to zero past 2**126:
    # -inf * 0 would make every masked token NaN and the row's argmax token 0
    scaled = jnp.where(
        logits > -jnp.inf, logits / jnp.where(is_greedy, 1.0, p.temperature)[:, None], -jnp.inf
    )
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, vocab), vocab)[:, None]

    # Two cut-offs, each the largest logit that still keeps k tokens (top-k) or top_p of the
    # mass (top-p), found by bisection over the logit range: sorting the vocabulary instead
    # costs ~50x more on CPU. Tokens at or above both cut-offs survive.
    def keeps(t: jax.Array) -> tuple[jax.Array, jax.Array]:
        kept = scaled[None] >= t[..., None]
        mass = jnp.where(kept, probs[None], 0).sum(-1)
        return kept[0].sum(-1) >= k[:, 0], mass[1] >= p.top_p

    def bisect(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # [2, B]: row 0 for top-k, row 1 for top-p
        mid = (lo + hi) / 2
        ok = jnp.stack(keeps(mid))
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    top = scaled.max(-1)
    shape = (2, *top.shape)
    # masked tokens (-inf) would pin the lower bound at -inf: bisect over the finite ones
    bottom = jnp.where(jnp.isfinite(scaled), scaled, top[:, None]).min(-1)
    bounds = (jnp.broadcast_to(bottom, shape), jnp.broadcast_to(top, shape))
    lo, _ = jax.lax.fori_loop(0, BISECTION_ROUNDS, bisect, bounds)
    # min_p keeps p >= min_p * p_max, i.e. scaled >= top + log(min_p): a third cut-off, in
    # closed form (log 0 = -inf keeps everything)
    floor = top + jnp.log(p.min_p)
    # never cut the best token, whatever rounding did to the mass
    cutoff = jnp.minimum(jnp.maximum(lo.max(0), floor), top)[:, None]
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(p.seed, p.sample_index)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys)
    sampled = _argmax(masked + gumbel)
    return jnp.where(is_greedy, _argmax(logits), sampled)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum; XLA's CPU argmax (a variadic reduce) is ~20x slower."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == x.max(-1, keepdims=True), iota, x.shape[-1]), axis=-1)
