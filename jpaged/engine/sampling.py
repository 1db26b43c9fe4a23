"""SamplingParams and the sampler that runs inside the jitted step.

Every row carries its own temperature / top-k / top-p / seed as arrays, so one
compiled program serves any mix of requests; `greedy` is static so the common
all-greedy batch compiles without the sort and the noise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NUM_TOP_LOGPROBS = 5  # OpenAI's completions API allows at most 5 alternatives
MAX_TOKENS_LIMIT = 1 << 20


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token, 0..NUM_TOP_LOGPROBS
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        check(
            is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT,
            "max_tokens",
            f"an int in [1, {MAX_TOKENS_LIMIT}]",
        )
        check(is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "an int >= -1 (-1 or 0 = off)")
        check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**32),
            "seed",
            "None or an int in [0, 2**32)",
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
        check(is_int(self.n) and self.n == 1, "n", "1 (parallel sampling is not supported yet)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters: NumPy on the host, jax Arrays inside the step."""

    temperature: np.ndarray | jax.Array  # f32 [B]
    top_k: np.ndarray | jax.Array  # int32 [B], 0 = off
    top_p: np.ndarray | jax.Array  # f32 [B]
    seed: np.ndarray | jax.Array  # uint32 [B]
    step: np.ndarray | jax.Array  # int32 [B] tokens generated so far: a fresh key per token


def sample(
    logits: jax.Array,  # f32 [B, V]
    params: SamplingArrays,
    *,
    greedy: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (token ids [B], their logprobs [B], top ids [B, K], top logprobs [B, K]).

    Logprobs are those of the model's distribution (before temperature and
    truncation), as vLLM reports them.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(NUM_TOP_LOGPROBS, logits.shape[-1]))
    tokens = top_ids[:, 0] if greedy else _sample_tokens(logits, params)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    return tokens.astype(jnp.int32), chosen, top_ids.astype(jnp.int32), top_lp


def _sample_tokens(logits: jax.Array, p: SamplingArrays) -> jax.Array:
    vocab = logits.shape[-1]
    is_greedy = p.temperature <= 0
    scaled = logits / jnp.where(is_greedy, 1.0, p.temperature)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
    # top-k: the k-th largest logit is the cut-off (k = 0 keeps everything)
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=1)
    # top-p: keep the smallest prefix whose mass reaches top_p (always the top token)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p.top_p[:, None]
    pth = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.maximum(kth, pth)
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(p.seed, p.step)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1)
    return jnp.where(is_greedy, jnp.argmax(logits, axis=-1), sampled)
