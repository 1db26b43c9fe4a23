"""Speculative decoding with n-gram drafts (vLLM's prompt lookup), verified in the ragged step.

The proposer needs no second model: for each decoding sequence it finds the last
earlier occurrence of the sequence's most recent n-gram (n from `prompt_lookup_max`
down to `prompt_lookup_min`) in its own prompt + output, and proposes the (up to
`num_speculative_tokens`) tokens that followed it. A sequence with drafts puts its
last token and the drafts on the step's token axis like a small prompt chunk; the
step samples after each of those 1 + k positions (the LM head and sampler see only
them), each position keyed by the output index it would sample (`sample_index`).

Acceptance is one rule for greedy and sampled rows: accept the longest prefix of
drafts equal to the tokens sampled before them, then emit the first sampled token
that differs (or the one after the last draft). Greedy, that is "equal to the
argmax". Sampled, it is the speculative-sampling rule for a one-hot draft
distribution q: the sampler draws by Gumbel-max from p, so the draw equals the
draft t with probability p(t) (= min(1, p/q)), and a draw that differs is
distributed as p with t removed and renormalised, the rule's correction. Since a
position's key is the output index it samples, an accepted prefix sees exactly the
context and noise it would have without speculation: outputs are those of
speculation off, token for token, up to float rounding.

Back-off, so speculation does not cost where it does not help: no drafts while more
than `disable_by_batch_size` (vLLM's name; default 4) sequences run, nor while
requests wait for a row; a request whose drafts keep being
rejected stops proposing for a while, twice as long each time (probes again after 1,
2, 4, ... 64 steps); one whose context has no match looks again every other step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# acceptance (accepted / proposed, averaged over recent drafting steps) below which a
# request backs off
MIN_ACCEPTANCE = 0.25
MAX_BACKOFF = 64  # steps
# a request whose context has no match skips this many steps before looking again (a
# step that may draft reads the calls in flight first: with async scheduling, looking
# every step would give up the overlap of host and device)
NO_MATCH_WAIT = 2


def extra_samples(spec: dict[str, Any] | None, max_batch_size: int) -> int:
    """Sample rows a step has beyond one a sequence (max_batch_size): enough for 1 + k
    positions of each sequence of a batch small enough to draft. Every step computes
    logits for every sample row, drafts or not, so a large batch with few drafting
    sequences gets none (`disable_by_batch_size` x (1 + k) <= max_batch_size)."""
    if spec is None:
        return 0
    drafting = min(spec["disable_by_batch_size"], max_batch_size)
    return max(0, drafting * (1 + spec["num_speculative_tokens"]) - max_batch_size)


def from_flags(k: int | None, lo: int | None = None, hi: int | None = None) -> dict | None:
    """The config of `--speculative-ngram K [--prompt-lookup-min A] [--prompt-lookup-max B]`
    (None without K; ValueError for bounds without it)."""
    if k is None:
        if lo is not None or hi is not None:
            raise ValueError("--prompt-lookup-min/--prompt-lookup-max need --speculative-ngram")
        return None
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k}
    for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None:
            spec[key] = v
    return spec


def propose(contexts: Sequence[Sequence[int]], k: int, lo: int, hi: int) -> list[np.ndarray]:
    """N-gram drafts for each context, vectorised over the batch: the `k` tokens after the
    last earlier occurrence of its longest suffix n-gram, n from `hi` down to `lo`, that
    has one (none where nothing matches)."""
    lens = np.array([len(c) for c in contexts])
    width = int(lens.max(initial=0))
    # right-aligned, so every row's suffix n-gram sits in the same columns; -1 pads
    ctx = np.full((len(contexts), width), -1, np.int64)
    for row, c in enumerate(contexts):
        ctx[row, width - len(c) :] = c
    starts = np.full(len(contexts), -1)  # where each row's drafts start (-1: no match yet)
    for n in range(hi, lo - 1, -1):
        if width <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:, :-1], n, axis=1)
        # earlier windows equal to the suffix (the suffix itself is not among them)
        hit = (windows == ctx[:, None, width - n :]).all(-1) & (lens > n)[:, None]
        last = windows.shape[1] - 1 - np.argmax(hit[:, ::-1], axis=1)
        take = (starts < 0) & hit.any(1)
        starts[take] = last[take] + n
    # A continuation that reaches the end of the context goes on with the drafts themselves
    # (the match says token j + p follows as token j did: a loop of period p).
    period = width - starts
    return [
        ctx[row, s + np.arange(k) % p] if s >= 0 else ctx[row, :0]
        for row, (s, p) in enumerate(zip(starts, period, strict=True))
    ]


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix equal to the tokens sampled before each."""
    d = len(drafts)
    return int(np.cumprod(np.asarray(sampled[:d]) == np.asarray(drafts)).sum())


@dataclasses.dataclass
class _Backoff:
    rate: float = 1.0  # recent acceptance (accepted / proposed), optimistic at first
    wait_until: int = 0  # the step from which the request proposes again
    wait: int = 0  # its last back-off, in steps


class Speculator:
    """The proposer's settings, each request's back-off, and the counters (metrics)."""

    def __init__(self, spec: dict[str, Any], max_batch_size: int) -> None:
        self.k = spec["num_speculative_tokens"]
        self.lo, self.hi = spec["prompt_lookup_min"], spec["prompt_lookup_max"]
        self.max_running = spec["disable_by_batch_size"]
        self.extra = extra_samples(spec, max_batch_size)
        self.step = 0
        self._backoff: dict[Any, _Backoff] = {}  # by request (identity)
        self.num_drafts = 0  # verifications: rows that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, running: Sequence[Any]) -> bool:
        """Whether this step may draft: few enough sequences run, and one of them may.
        With async scheduling the engine then reads the calls in flight first (drafts come
        from their tokens)."""
        return len(running) <= self.max_running and any(
            self._eligible(r, known=False) for r in running
        )

    def _eligible(self, req: Any, known: bool = True) -> bool:
        p = req.params
        b = self._backoff.get(req)
        return (
            req.prefilled
            and (req.num_pending == 0 or not known)  # its last token is on the host
            and req.params.max_tokens - req.num_sampled >= 2  # room for a draft and more
            # the sampler's per-sequence state (penalties, grammars, min_tokens) follows
            # one token a step
            and not p.has_controls
            and req.matcher is None
            and req.beam is None  # a beam decodes one token a step: the search picks the next
            and req.num_sampled >= p.min_tokens
            and (b is None or b.wait_until <= self.step)
        )

    def propose(self, running: Sequence[Any]) -> dict[int, np.ndarray]:
        """Drafts for the running requests that may draft now, by `id(request)`."""
        self.step += 1
        live = set(map(id, running))
        for req in [r for r in self._backoff if id(r) not in live]:
            del self._backoff[req]
        if len(running) > self.max_running:
            return {}
        reqs = [r for r in running if self._eligible(r)]
        drafts = {}
        for req, d in zip(
            reqs, propose([r.all_ids for r in reqs], self.k, self.lo, self.hi), strict=True
        ):
            if len(d):
                drafts[id(req)] = d
            else:  # look again in a step: a match may start any token
                self._backoff.setdefault(req, _Backoff()).wait_until = self.step + NO_MATCH_WAIT
        return drafts

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        """A verification's outcome: count it, and back the request off if its drafts keep
        failing."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        req.num_draft_tokens += proposed
        req.num_accepted_tokens += accepted
        b = self._backoff.setdefault(req, _Backoff())
        b.rate = 0.5 * b.rate + 0.5 * accepted / proposed
        if b.rate < MIN_ACCEPTANCE:
            self._back_off(req)
            b.rate = MIN_ACCEPTANCE  # one good verification after the wait lifts it again
        elif accepted:
            b.wait = 0

    def _back_off(self, req: Any) -> None:
        b = self._backoff.setdefault(req, _Backoff())
        b.wait = min(2 * b.wait or 1, MAX_BACKOFF)
        b.wait_until = self.step + b.wait

    def stats(self) -> dict[str, float]:
        counts = {
            "spec_drafts": self.num_drafts,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
        }
        return {**counts, **rates(counts)}


def rates(counts: Mapping[str, float]) -> dict[str, float]:
    """The ratios of `Speculator.stats`' counts (one engine's, or the sums of several)."""
    drafts, proposed = counts["spec_drafts"], counts["spec_draft_tokens"]
    accepted = counts["spec_accepted_tokens"]
    return {
        "spec_acceptance_rate": accepted / max(proposed, 1),
        # tokens a verification emits: the accepted drafts and the one sampled after
        "spec_mean_acceptance_length": 1 + accepted / max(drafts, 1),
    }
