"""What a request shows its caller: text, stop strings, logprobs, deltas, timing.

The output processor (vLLM's `output_processor.py`) turns what a step produced for
each choice (`CoreOutputs`: token ids, not text) into the text and logprobs the caller
sees, and the deltas a stream sends (`RequestOutput`). It never moves a request: when a
choice's text reaches a stop string it sends the choice's last output and says so, and
the engine finishes it. "Every choice of a request is done" is known here alone
(`RequestOutput.request_finished`), for the offline API, the async engine and the server
alike.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import tokenizers
from tokenizers.decoders import DecodeStream

from jpaged.engine.contract import CoreOutputs
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


class Detokenizer:
    """A choice's one way from token ids to text.

    `push` decodes incrementally and never emits half a multi-byte character: it emits
    only what the newest tokens add to the text of a short window of recent ones, holding
    text back while it ends in U+FFFD (an incomplete UTF-8 sequence) — the scheme of vLLM
    and TGI. Where the tokenizer's Rust backend gives the text, the `tokenizers` library's
    `DecodeStream` runs it, one call a token; where transformers cleans the text up after
    the decoder (spaces before punctuation), the wrapper's decode runs it here, twice a
    token. `token` is one token's own text (for logprobs).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.backend = _backend(tokenizer)
        self.decode = tokenizer.decode if self.backend is None else self.backend.decode
        self.skip_special = skip_special
        self.ids = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        # the backend's incremental decoder, where the backend gives the text (a stream
        # started on half a character would emit the context with its next token)
        self.stream: tuple[DecodeStream, tokenizers.Tokenizer] | None = None
        if self.backend is not None:
            context = self.backend.decode(self.ids, skip_special_tokens=skip_special)
            if not context.endswith("\ufffd"):
                self.stream = DecodeStream(self.ids, skip_special), self.backend
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        if self.stream is not None:
            stream, backend = self.stream
            return stream.step(backend, token_id) or ""
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


def _backend(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """The Rust backend of a transformers tokenizer where its text is the wrapper's (no
    clean-up of spaces after it): the wrapper's decode cost ~4x the backend's (~10 us).
    (Their defaults differ: pass `skip_special_tokens` always.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return backend
    return None


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

    def add(self, req: Request) -> RequestState:
        state = self.states[req.id] = RequestState(req, self.tokenizer)
        return state

    def process(self, out: CoreOutputs) -> tuple[list[RequestOutput], list[Request]]:
        """Take what a step did: each touched choice's delta, and the choices whose text
        reached a stop string in it (for the engine to finish)."""
        states, top, scores = self.states, out.top, out.scores
        stopped = []
        touched: dict[Request, RequestState] = {}  # in order
        for k, (req, token) in enumerate(zip(out.reqs, out.tokens, strict=True)):
            state = states.get(req.id)
            if state is None:  # its last output is out already
                continue
            touched[req] = state
            if scores and k in scores:
                self._score_prompt(state, *scores[k])
            choice = state.choices[req.index]
            if token is None or choice.stopped:
                continue
            if self._take(req, state, choice, token, out.logprobs[k], top.get(k)):
                stopped.append(req)
        finished = out.finished
        outputs = [
            self._delta(req, state, finished.get(req))
            for req, state in touched.items()
            if not state.choices[req.index].sent_final
        ]
        return outputs, stopped

    def _take(
        self,
        req: Request,
        state: RequestState,
        c: ChoiceState,
        token: int,
        logprob: float,
        top: tuple[np.ndarray, np.ndarray] | None,
    ) -> bool:
        """Append a sampled token to its choice `c`; True if the text now holds a stop
        string."""
        params = state.params
        if c.first_token_time is None:
            c.first_token_time = time.perf_counter()
        c.token_ids.append(token)
        c.logprobs.append(logprob)
        if params.logprobs is not None:
            c.tokens.append(c.detok.token(token))
        if params.logprobs:
            assert top is not None
            ids = top[0][: params.logprobs].tolist()
            pairs = zip(ids, top[1][: params.logprobs].tolist(), strict=True)
            c.top_logprobs.append({c.detok.token(t): lp for t, lp in pairs})
        # the request has appended it already: whether it ended there is known
        if req.stops_on(token, len(c.token_ids)) and not params.include_stop_str_in_output:
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

    def _delta(
        self, req: Request, state: RequestState, finish: tuple[str | None, str | None] | None
    ) -> RequestOutput:
        """The choice's news (`finish`: how the step finished it, if it did; a choice whose
        text reached a stop string is finished here). Text that may still turn into a stop
        string is held."""
        c, params = state.choices[req.index], state.params
        finished = c.stopped or finish is not None
        if finished:
            c.sent_final = True
            if c.stopped:
                c.finish_reason, c.error = "stop", None
            else:
                assert finish is not None
                c.finish_reason, c.error = finish
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
