"""What a request shows its caller: text, stop strings, logprobs, deltas, timing.

The output processor (vLLM's `output_processor.py`) turns what steps produced for
each choice (`Change`) into the text and logprobs the caller sees, and the
deltas a stream sends (`RequestOutput`). It reads the scheduler's requests and
never moves them: when a choice's text reaches a stop string it says so, and the
engine has the scheduler finish it. "Every choice of a request is done" is known
here alone (`RequestOutput.request_finished`), for the offline API, the async
engine and the server alike.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tokenizers

from jpaged.engine.request import Request

# Prompt tokens decoded before the first output token, so its leading space (or the
# rest of a multi-byte character) decodes as it will in the full text.
DETOKENIZE_CONTEXT = 6


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one step produced for one choice of a request (deltas, for streaming)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    tokens: list[str] | None  # each new token's own text, when logprobs were asked for
    finished: bool  # this choice
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    index: int = 0  # which choice of an n > 1 request
    request_finished: bool = False  # every choice of the request: its last output
    # On a choice's first output, if the request asked for prompt logprobs (one entry per
    # prompt token, the first None): each token's logprob, its alternatives, its text.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[str, float] | None] | None = None
    prompt_token_texts: list[str] | None = None
    # speculative decoding, so far: draft tokens verified for this choice, and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    embedding: Any = None  # an embedding request's final output: float32 [hidden]


@dataclasses.dataclass(slots=True)
class Change:
    """What a step did to one choice: a sampled token (with its logprob and alternatives),
    prompt tokens scored, or only a new state (finished, or a chunk computed)."""

    req: Request
    token: int | None = None
    logprob: float = 0.0
    top_ids: np.ndarray | None = None  # int [K]: the likeliest tokens (the first k asked for)
    top_logprobs: np.ndarray | None = None  # f32 [K]
    scored_from: int = 0  # the position whose next token `scores` starts with
    scores: Any = None  # the runner's `Scores` of prompt tokens, or None


class Detokenizer:
    """A choice's one way from token ids to text.

    `push` decodes incrementally and never emits half a multi-byte character:
    it decodes a short window of recent tokens and emits only what the newest
    tokens add, holding text back while it ends in U+FFFD (an incomplete UTF-8
    sequence) — the scheme of vLLM and TGI. `token` is one token's own text
    (for logprobs).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.decode = decoder(tokenizer)
        self.skip_special = skip_special
        self.ids = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        skip = self.skip_special
        before = self.decode(self.ids[self.prefix : self.read], skip_special_tokens=skip)
        after = self.decode(self.ids[self.prefix :], skip_special_tokens=skip)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def token(self, token_id: int) -> str:
        return str(self.decode([token_id], skip_special_tokens=False))


def decoder(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode`, or its Rust backend's own where the text is the same (no clean-up
    of spaces after it): transformers' wrapper cost ~4x the decode (~10 us), twice a token.
    (Their defaults differ: pass `skip_special_tokens` always.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return backend.decode
    return tokenizer.decode


class ChoiceState:
    """One choice's output so far."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.detok = Detokenizer(tokenizer, prompt_ids, skip_special)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.tokens: list[str] = []  # each output token's text, when logprobs were asked for
        self.text = ""  # stop strings removed
        self.stopped = False  # the text reached a stop string
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted
        self.num_accepted_tokens = 0
        # what earlier outputs carried
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_prompt = False
        self.sent_final = False


class RequestState:
    """A request's output: its choices, and its prompt's logprobs (scored once)."""

    def __init__(self, req: Request, tokenizer: Any) -> None:
        self.request_id = req.id
        self.prompt_ids = req.prompt_ids
        self.params = req.params
        self.arrival = req.arrival
        skip = req.params.skip_special_tokens
        self.choices = [ChoiceState(tokenizer, req.prompt_ids, skip) for _ in req.group]
        n, want = len(req.prompt_ids), req.params.prompt_logprobs
        self.prompt_logprobs: list[float | None] | None = None if want is None else [None] * n
        self.prompt_top_logprobs: list[dict[str, float] | None] | None = (
            [None] * n if want else None
        )
        self.unfinished = len(req.group)
        # the text a stream holds back: what may still turn into a stop string
        self.hold = max((len(s) - 1 for s in req.params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # live requests by id
        self._touched: dict[Request, None] = {}  # choices with news since `emit`, in order

    def add(self, req: Request) -> RequestState:
        state = self.states[req.id] = RequestState(req, self.tokenizer)
        return state

    def process(self, changes: Iterable[Change]) -> list[Request]:
        """Take what a step did; returns the running choices whose text reached a stop string."""
        stopped = []
        for change in changes:
            req = change.req
            state = self.states.get(req.id)
            if state is None:  # its last output is out already
                continue
            self._touched[req] = None
            if change.scores is not None:
                self._score_prompt(state, change.scored_from, change.scores)
            choice = state.choices[req.index]
            if (
                change.token is not None
                and not choice.stopped
                and self._take(state, choice, change)
            ):
                stopped.append(req)
        return [r for r in stopped if not r.finished]

    def emit(self) -> list[RequestOutput]:
        """Each touched choice's delta since its last output."""
        touched, self._touched = self._touched, {}
        outputs = []
        for req in touched:
            state = self.states.get(req.id)
            if state is not None and not state.choices[req.index].sent_final:
                outputs.append(self._delta(req, state))
        return outputs

    def _take(self, state: RequestState, c: ChoiceState, change: Change) -> bool:
        """Append a sampled token to its choice `c`; True if the text now holds a stop
        string."""
        token, params = change.token, state.params
        assert token is not None
        if c.first_token_time is None:
            c.first_token_time = time.perf_counter()
        c.token_ids.append(token)
        c.logprobs.append(change.logprob)
        if params.logprobs is not None:
            c.tokens.append(c.detok.token(token))
        if params.logprobs:
            assert change.top_ids is not None and change.top_logprobs is not None
            ids = change.top_ids[: params.logprobs].tolist()
            top = zip(ids, change.top_logprobs[: params.logprobs].tolist(), strict=True)
            c.top_logprobs.append({c.detok.token(t): lp for t, lp in top})
        # the request has appended it already: whether it ended there is known
        if change.req.stops_on(token, len(c.token_ids)) and not params.include_stop_str_in_output:
            return False
        c.text += c.detok.push(token)
        if len(c.token_ids) < params.min_tokens:  # stop strings wait for min_tokens, as EOS
            return False
        for stop in params.stop:
            cut = c.text.find(stop, max(0, c.sent_text - len(stop) + 1))
            if cut >= 0:
                c.text = c.text[: cut + len(stop) if params.include_stop_str_in_output else cut]
                c.stopped = True
                return True
        return False

    def _score_prompt(self, state: RequestState, start: int, scores: Any) -> None:
        """A step scored the prompt tokens after positions start, start + 1, ..."""
        assert state.prompt_logprobs is not None
        k = state.params.prompt_logprobs or 0
        detok = state.choices[0].detok
        tops = zip(scores.top_ids[:, :k].tolist(), scores.top_logprobs[:, :k].tolist(), strict=True)
        for j, (logprob, (ids, lps)) in enumerate(zip(scores.logprobs.tolist(), tops, strict=True)):
            state.prompt_logprobs[start + 1 + j] = logprob
            if state.prompt_top_logprobs is not None:
                top = zip(ids, lps, strict=True)
                state.prompt_top_logprobs[start + 1 + j] = {detok.token(t): lp for t, lp in top}

    def _delta(self, req: Request, state: RequestState) -> RequestOutput:
        """The choice's news. Text that may still turn into a stop string is held."""
        c, params, finished = state.choices[req.index], state.params, req.finished
        if finished:
            c.sent_final = True
            c.finish_reason = "stop" if c.stopped else req.finish_reason
            c.error = req.error
            c.finish_time = time.perf_counter()
            state.unfinished -= 1
            if state.finished:
                del self.states[req.id]
        c.num_draft_tokens, c.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        hold = 0 if finished else state.hold
        end = max(c.sent_text, len(c.text) - hold)
        text, c.sent_text = c.text[c.sent_text : end], end
        new, c.sent_tokens = slice(c.sent_tokens, len(c.token_ids)), len(c.token_ids)
        out = RequestOutput(
            request_id=req.id,
            text=text,
            token_ids=c.token_ids[new],
            logprobs=c.logprobs[new],
            top_logprobs=c.top_logprobs[new] if params.logprobs else None,
            tokens=c.tokens[new] if params.logprobs is not None else None,
            finished=finished,
            finish_reason=c.finish_reason,
            error=c.error,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(c.token_ids),
            index=req.index,
            request_finished=state.finished,
            num_draft_tokens=c.num_draft_tokens,
            num_accepted_tokens=c.num_accepted_tokens,
            embedding=req.embedding,
        )
        first = out.token_ids or c.sent_final
        if state.prompt_logprobs is not None and not c.sent_prompt and first:
            c.sent_prompt = True
            out.prompt_logprobs = list(state.prompt_logprobs)
            out.prompt_top_logprobs = state.prompt_top_logprobs and list(state.prompt_top_logprobs)
            out.prompt_token_texts = [c.detok.token(t) for t in req.prompt_ids]
        return out
