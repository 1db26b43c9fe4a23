"""A request's life: waiting -> running -> finished, plus its incremental text.

A request with `n > 1` choices is a group of `n` Request objects sharing one id
(`group`, each with its `index`). The group waits and is admitted as one: a
leader prefills the prompt up to its last token, then forks the other live
choices off its sequence (`pending_fork`, `fork_at`); from there each choice
computes the last prompt token itself and samples on its own.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Sequence
from typing import Any

from jpaged.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request (deltas, for streaming)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    tokens: list[str] | None  # each new token's own text, when logprobs were asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    index: int = 0  # which choice of an n > 1 request
    # On a choice's first output, if the request asked for prompt logprobs (one entry per
    # prompt token, the first None): each token's logprob, its alternatives, its text.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[str, float] | None] | None = None
    prompt_token_texts: list[str] | None = None


class Detokenizer:
    """A request's one way from token ids to text.

    `push` decodes incrementally and never emits half a multi-byte character:
    it decodes a short window of recent tokens and emits only what the newest
    tokens add, holding text back while it ends in U+FFFD (an incomplete UTF-8
    sequence) — the scheme of vLLM and TGI. `token` is one token's own text
    (for logprobs).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # context so leading spaces decode right
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


_ids = itertools.count()


class Request:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_ids: tuple[int, ...],
        request_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.index = index
        self.group: list[Request] = [self]  # every choice of the request, by index
        # Set while this choice leads its group's prefill: the choices to fork off its
        # sequence once `fork_at` tokens (all but the last prompt token) are computed.
        self.pending_fork: list[Request] = []
        self.fork_at = 0
        self.prompt_ids = prompt_ids
        self._ids = list(prompt_ids)  # prompt + output, kept up to date
        self.params = params
        self.eos_ids = () if params.ignore_eos else eos_ids
        self.seed = 0  # set by the engine: params.seed or a draw from the engine's RNG
        self.status = Status.WAITING
        self.seq_id: int | None = None  # cache sequence while running
        self.num_computed = 0  # tokens whose K/V the cache holds, or will once dispatched steps ran
        # Tokens dispatched steps will sample that the host has not read yet (at most one
        # with overlapped steps), and where the latest sits on the device (`Pending.ring_index`).
        self.num_pending = 0
        self.ring_index = -1
        self.epoch = 0  # bumped by preemption: results of steps dispatched before are stale
        self.committed_blocks = 0  # full blocks already offered to the prefix cache
        # False until the prompt (or, after preemption, prompt + output) is in the
        # cache and a token was sampled from it; then each step decodes one token.
        self.prefilled = False
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.tokens: list[str] = []  # each output token's text, when logprobs were asked for
        self.text = ""  # full output text, stop strings removed
        self.sent = 0  # characters of `text` already streamed
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.detok = Detokenizer(tokenizer, prompt_ids)
        # Filled as prefill chunks are scored; n > 1 choices share their leader's lists.
        want = params.prompt_logprobs
        self.prompt_logprobs: list[float | None] | None = (
            None if want is None else [None] * len(prompt_ids)
        )
        self.prompt_top_logprobs: list[dict[str, float] | None] | None = (
            [None] * len(prompt_ids) if want else None
        )
        self._prompt_sent = False
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output ids (the request's own list: do not modify)."""
        return self._ids

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before sampling (or, for a group leader, before forking)."""
        return self.fork_at if self.pending_fork else self.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, read or not (the next one's sampling step)."""
        return len(self.output_ids) + self.num_pending

    @property
    def will_finish(self) -> bool:
        """Pending tokens reach max_tokens: another step would compute one never emitted."""
        return self.num_sampled >= self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return not self.prefilled

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(
        self,
        token_id: int,
        logprob: float,
        top_ids: Sequence[int] = (),
        top_logprobs: Sequence[float] = (),
    ) -> None:
        """Record a sampled token (and its `params.logprobs` likeliest alternatives) and
        decide whether the request is done."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_ids.append(token_id)
        self._ids.append(token_id)
        self.logprobs.append(logprob)
        if self.params.logprobs is not None:
            self.tokens.append(self.detok.token(token_id))
        if self.params.logprobs:
            top = zip(top_ids, top_logprobs, strict=True)
            self.top_logprobs.append({self.detok.token(int(t)): float(lp) for t, lp in top})
        if token_id in self.eos_ids:
            self.finish("stop")
            return
        self.text += self.detok.push(token_id)
        for stop in self.params.stop:
            cut = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish("stop")
                return
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    def prompt_ids_to_score(self, start: int, n: int) -> list[int]:
        """Prompt logprobs: the prompt tokens that follow positions start..start+n-1, which
        a step computing those positions scores (none once output began: they are known)."""
        if self.prompt_logprobs is None or self.output_ids:
            return []
        return self.prompt_ids[start + 1 : start + 1 + n]

    def record_prompt_logprobs(self, start: int, scores: Any) -> None:
        """A step scored the prompt tokens after positions start, start+1, ... (`Scores`)."""
        assert self.prompt_logprobs is not None
        k = self.params.prompt_logprobs or 0
        tops = zip(scores.top_ids[:, :k].tolist(), scores.top_logprobs[:, :k].tolist(), strict=True)
        for j, (logprob, (ids, lps)) in enumerate(zip(scores.logprobs.tolist(), tops, strict=True)):
            self.prompt_logprobs[start + 1 + j] = logprob
            if self.prompt_top_logprobs is not None:
                top = zip(ids, lps, strict=True)
                self.prompt_top_logprobs[start + 1 + j] = {self.detok.token(t): lp for t, lp in top}

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

    def take_output(self, new_ids: list[int]) -> RequestOutput:
        """The delta since the last call. Text that may still turn into a stop string is held."""
        hold = 0 if self.finished else max((len(s) - 1 for s in self.params.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent : end], end
        n = len(new_ids)
        out = RequestOutput(
            request_id=self.id,
            text=delta,
            token_ids=new_ids,
            logprobs=self.logprobs[len(self.logprobs) - n :] if n else [],
            top_logprobs=(self.top_logprobs[len(self.top_logprobs) - n :] if n else [])
            if self.params.logprobs
            else None,
            tokens=(self.tokens[len(self.tokens) - n :] if n else [])
            if self.params.logprobs is not None
            else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            index=self.index,
        )
        if self.prompt_logprobs is not None and not self._prompt_sent and (n or self.finished):
            self._prompt_sent = True
            out.prompt_logprobs = list(self.prompt_logprobs)
            out.prompt_top_logprobs = self.prompt_top_logprobs and list(self.prompt_top_logprobs)
            out.prompt_token_texts = [self.detok.token(t) for t in self.prompt_ids]
        return out
