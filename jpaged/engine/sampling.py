"""SamplingParams and the sampler that runs on the device after each step.

Every row carries its own temperature / top-k / top-p / seed as arrays, so one
compiled program serves any mix of requests. The costly parts are static
variants the host picks per batch, never device-side branches (a `lax.cond` on
GPU copies its predicate to the host and blocks it until the GPU gets there):
an all-greedy batch skips the noise and the top-k/top-p search, and a batch
where nobody asked for logprobs skips the top-5 alternatives (25% of a 48-row
decode step on CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NUM_TOP_LOGPROBS = 5  # OpenAI's completions API allows at most 5 alternatives
MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 256  # choices per request (the engine also caps n at max_batch_size)
# What the sampler's arrays hold: float32 temperatures, int32 top_k, uint32 seeds (a larger
# value would fail a whole step). The server's published schema takes its ranges from here.
TEMPERATURE_MAX = float(np.finfo(np.float32).max)
TOP_K_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1


class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending request field (the
    server's 400 says which)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    logprobs: int | None = None  # alternatives per token, 0..NUM_TOP_LOGPROBS
    n: int = 1  # choices sampled from one prefill of the prompt (forked sequences)
    # Each prompt token's own logprob (given the tokens before it) and this many likeliest
    # alternatives, 0..NUM_TOP_LOGPROBS; None = none (vLLM's name).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        self.validate()

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
            self.logprobs is None
            or (is_int(self.logprobs) and 0 <= self.logprobs <= NUM_TOP_LOGPROBS),
            "logprobs",
            f"None or an int in [0, {NUM_TOP_LOGPROBS}]",
        )
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an int in [1, {MAX_N}]")
        check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= NUM_TOP_LOGPROBS),
            "prompt_logprobs",
            f"None or an int in [0, {NUM_TOP_LOGPROBS}]",
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
    seed: np.ndarray | jax.Array  # uint32 [B]
    sample_index: np.ndarray | jax.Array  # int32 [B] tokens sampled so far: a fresh key each
    logprobs: np.ndarray | jax.Array  # int32 [B] alternatives wanted, 0 = none

    def pack(self) -> np.ndarray:  # int32 [6, B]: the fields' bits, to travel with the step
        fields = dataclasses.fields(self)
        return np.stack([np.asarray(getattr(self, f.name)).view(np.int32) for f in fields])

    @classmethod
    def unpack(cls, packed: jax.Array) -> SamplingArrays:  # packed: int32 [6, B]
        bits = jax.lax.bitcast_convert_type
        return cls(
            temperature=bits(packed[0], jnp.float32),
            top_k=packed[1],
            top_p=bits(packed[2], jnp.float32),
            seed=bits(packed[3], jnp.uint32),
            sample_index=packed[4],
            logprobs=packed[5],
        )


def sample(
    logits: jax.Array,  # f32 [B, V]
    params: SamplingArrays,
    *,
    greedy: bool,
    top: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (token ids [B], their logprobs [B], top ids [B, K], top logprobs [B, K]).

    `greedy`: every row has temperature 0 (argmax only). `top`: some row asked for
    logprobs; otherwise the top ids / logprobs are zeros. Logprobs are those of the
    model's distribution (before temperature and truncation), as vLLM reports them.
    """
    k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    tokens = _argmax(logits) if greedy else _sample_tokens(logits, params)
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


def variant(params: SamplingArrays) -> dict[str, bool]:
    """The `sample` variant a batch needs, from its host-side (NumPy) parameters."""
    return {
        "greedy": not bool((np.asarray(params.temperature) > 0).any()),
        "top": bool((np.asarray(params.logprobs) > 0).any()),
    }


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
    scaled = logits / jnp.where(is_greedy, 1.0, p.temperature)[:, None]
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
    bounds = (jnp.broadcast_to(scaled.min(-1), shape), jnp.broadcast_to(top, shape))
    lo, _ = jax.lax.fori_loop(0, BISECTION_ROUNDS, bisect, bounds)
    # never cut the best token, whatever rounding did to the mass
    cutoff = jnp.minimum(lo.max(0), top)[:, None]
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(p.seed, p.sample_index)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys)
    sampled = _argmax(masked + gumbel)
    return jnp.where(is_greedy, _argmax(logits), sampled)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum; XLA's CPU argmax (a variadic reduce) is ~20x slower."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == x.max(-1, keepdims=True), iota, x.shape[-1]), axis=-1)
