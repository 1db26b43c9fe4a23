"""Beam search over shared blocks: the parameters and the host side of the search.

A beam search request is a group of `beam_width` Request objects, one a beam, like
the choices of `n > 1`. Each step every live beam computes its last token and
returns the `top` likeliest next tokens with their logprobs (a top-k on the device,
no vocabulary-sized transfer); `BeamSearch.select` then picks the next beams across
the whole group as transformers' `generate(num_beams=...)` does, and the scheduler
moves the KV memory to match: a beam several children extend is forked (its blocks
shared, the partial last one copied on the first write), a beam no child extends
is freed in the same step.

The algorithm is transformers' (`GenerationMixin._beam_search`): the `top` =
max(2, 1 + #EOS) x `beam_width` best continuations over all beams; those among the
first `beam_width` that end (EOS, a stop string, `max_tokens`) become finished
hypotheses scored `cum_logprob / generated_length ** length_penalty`, the best
`beam_width` unfinished ones run on. `early_stopping`: False (transformers'
default) stops once `beam_width` hypotheses are finished and the best running
beam, scored at its current length, cannot beat the worst of them; True stops as
soon as `beam_width` are finished; "never" (with a positive length penalty)
assumes a running beam could still reach `max_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jpaged.engine.sampling import RequestError, SamplingParams

# |length_penalty| bound: length ** penalty stays a finite float for any max_tokens
LENGTH_PENALTY_MAX = 10.0


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """How to search a prompt's continuations (vLLM's `BeamSearchParams`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # False | True | "never", as transformers
    stop: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        width = self.beam_width
        if not (isinstance(width, int) and not isinstance(width, bool) and width >= 1):
            raise RequestError("beam_width", f"beam_width must be an int >= 1, got {width!r}")
        lp = self.length_penalty
        if not (
            isinstance(lp, int | float)
            and not isinstance(lp, bool)
            and abs(lp) <= LENGTH_PENALTY_MAX
        ):
            raise RequestError(
                "length_penalty",
                "length_penalty must be a number in "
                f"[{-LENGTH_PENALTY_MAX}, {LENGTH_PENALTY_MAX}], got {lp!r}",
            )
        if self.early_stopping not in (False, True, "never"):
            raise RequestError(
                "early_stopping",
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
            )
        self.sampling()  # max_tokens, ignore_eos and stop are checked as SamplingParams'

    def sampling(self) -> SamplingParams:
        """What each beam decodes with: greedy, one sequence a beam."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=0.0,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            n=self.beam_width,
        )


@dataclasses.dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the one that ended it included)."""

    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A next beam: `parent` (an index into the live beams) extended by `token`."""

    parent: int
    token: int
    logprob: float
    cum_logprob: float


class BeamSearch:
    """One request's search state: its finished hypotheses and when to stop.

    `stopped(ids)`: whether generated tokens `ids` end on a stop string (None: no stop
    strings); EOS and max_tokens are checked here.
    """

    def __init__(
        self,
        params: BeamSearchParams,
        eos_ids: Sequence[int],
        vocab_size: int,
        stopped: Callable[[list[int]], bool] | None = None,
    ) -> None:
        self.params = params
        self.width = params.beam_width
        self.eos = frozenset(() if params.ignore_eos else eos_ids)
        # every continuation that can matter: a single beam may supply all of them
        self.top = min(max(2, 1 + len(self.eos)) * self.width, vocab_size)
        self.stopped = stopped
        self.restart()

    def restart(self) -> None:
        """Forget everything (a preempted group searches again from its prompt)."""
        self.finished: list[Hypothesis] = []
        self.improvable = True  # transformers' `is_early_stop_heuristic_unsatisfied`
        self.done = False

    def select(
        self,
        outputs: Sequence[list[int]],  # each live beam's generated tokens so far
        cum_logprobs: Sequence[float],  # [beams]
        top_ids: np.ndarray,  # int [beams, >= top] each beam's likeliest next tokens
        top_logprobs: np.ndarray,  # f32 [beams, >= top]
        token_logprobs: Sequence[list[float]],  # [beams] the logprob of each generated token
    ) -> list[Continuation]:
        """The next live beams, best first (none once `done`); records finished ones."""
        p, width = self.params, self.width
        ids, lps = top_ids[:, : self.top], top_logprobs[:, : self.top].astype(np.float64)
        totals = (np.asarray(cum_logprobs, np.float64)[:, None] + lps).ravel()
        # the `top` best over every beam; ties go to the earlier beam, then the likelier token
        order = np.argsort(-totals, kind="stable")[: self.top]
        length = len(outputs[0]) + 1  # every live beam has generated as many tokens
        # hypotheses are kept while the last step left room for better ones
        closed = not self.improvable or (len(self.finished) == width and p.early_stopping is True)
        running: list[Continuation] = []
        for rank, flat in enumerate(order.tolist()):
            beam, j = divmod(flat, ids.shape[1])
            token = int(ids[beam, j])
            cont = Continuation(beam, token, float(lps[beam, j]), float(totals[flat]))
            reason = self._ends(outputs[beam], token, length)
            if reason is None:
                if len(running) < width:
                    running.append(cont)
            elif rank < width and not closed:  # only the first `width` may finish
                self._finish(cont, outputs, token_logprobs, length, reason)
        full = len(self.finished) == width
        if running and full:
            best = running[0].cum_logprob
            horizon = length
            if p.early_stopping == "never" and p.length_penalty > 0:
                horizon = p.max_tokens
            self.improvable &= best / horizon**p.length_penalty > self.finished[-1].score
        # (at max_tokens every continuation ends: none runs on)
        self.done = not running or not self.improvable or (full and p.early_stopping is True)
        return [] if self.done else running

    def _ends(self, output: list[int], token: int, length: int) -> str | None:
        if token in self.eos:
            return "stop"
        if self.stopped is not None and self.stopped([*output, token]):
            return "stop"
        return "length" if length >= self.params.max_tokens else None

    def _finish(
        self,
        cont: Continuation,
        outputs: Sequence[list[int]],
        token_logprobs: Sequence[list[float]],
        length: int,
        reason: str,
    ) -> None:
        """Keep a continuation that ended as a hypothesis if it ranks among the best."""
        score = cont.cum_logprob / length**self.params.length_penalty
        if len(self.finished) == self.width and score <= self.finished[-1].score:
            return
        self.finished.append(
            Hypothesis(
                [*outputs[cont.parent], cont.token],
                [*token_logprobs[cont.parent], cont.logprob],
                cont.cum_logprob,
                score,
                reason,
            )
        )
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[self.width :]
