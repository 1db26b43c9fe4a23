"""A request's scheduling state: waiting -> running -> finished (the scheduler moves it).

A request with `n > 1` choices is a group of `n` Request objects sharing one id
(`group`, each with its `index`). The group waits and is admitted as one: a
leader prefills the prompt up to its last token, then forks the other
choices off its sequence (`pending_fork`, `fork_at`); from there each choice
computes the last prompt token itself and is scheduled on its own.

A beam search request (`beam`, shared by the group) is a group too, one choice a
beam: the first prefills the whole prompt, and after every step `beam.select`
decides which beams go on, forked from which (see `jpaged.engine.beam`).

What a request shows its caller (text, logprobs, timing) is not here: it lives
in `jpaged.engine.output`, which reads these objects and never changes them.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from jpaged.cache.protocol import SaltedIds
from jpaged.engine.beam import BeamSearch
from jpaged.engine.images import ImageSpan
from jpaged.engine.lora import LoRARequest
from jpaged.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Request:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_ids: tuple[int, ...],
        request_id: str | None = None,
        index: int = 0,
        seed: int = 0,
        lora: LoRARequest | None = None,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        pooling: str | None = None,
        matcher: Any = None,
        beam: BeamSearch | None = None,
        arrival: float | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        """`arrival`: a perf_counter time, by default now (a group's choices take their
        leader's: they time out together); `images`: the prompt's (`jpaged.engine.images`)."""
        self.id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.index = index
        self.group: list[Request] = [self]  # every choice of the request, by index
        # Set while this choice leads its group's prefill: the choices to fork off its
        # sequence once `fork_at` tokens (all but the last prompt token) are computed.
        self.pending_fork: list[Request] = []
        self.fork_at = 0
        self.prompt_ids = prompt_ids
        # prompt + output, kept up to date; with a LoRA adapter its K/V is the adapter's, so
        # the prefix cache keys its blocks apart (by name and path: a name re-registered
        # with other weights shares nothing with its former self); and a block holding an
        # image's tokens is keyed by its pixels' hash
        self.images = images
        self._ids = (
            list(prompt_ids)
            if lora is None and not images
            else SaltedIds(
                prompt_ids,
                b"" if lora is None else repr(lora).encode(),
                [(im.start, im.end, im.key) for im in images],
            )
        )
        self.lora = None if lora is None else lora.lora_name  # None: the base model
        self.lora_slot = 0  # its slot, held from admission to the end of the request
        # (a group's first choice) it counts in `LoRASlots.held`, from intake to its end
        self.holds_lora = False
        self.params = params
        self.eos_ids = () if params.ignore_eos else eos_ids
        self.stop_ids = frozenset(params.stop_token_ids)
        self.seed = seed
        self.status = Status.WAITING
        self.seq_id: int | None = None  # cache sequence while running
        self.num_computed = 0  # tokens whose K/V the cache holds, or will once dispatched steps ran
        # Tokens dispatched steps will sample that the host has not read yet (at most one
        # with overlapped steps): the next decode reads its input on the device.
        self.num_pending = 0
        self.epoch = 0  # bumped by preemption: results of steps dispatched before are stale
        self.committed_blocks = 0  # full blocks already offered to the prefix cache
        # False until the prompt (or, after preemption, prompt + output) is in the
        # cache and a token was sampled from it; then each step decodes one token.
        self.prefilled = False
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
        self.error: str | None = None
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted
        self.num_accepted_tokens = 0
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.priority = priority  # lower is admitted first and preempted last
        # perf_counter time past which it is aborted
        self.deadline = None if timeout_s is None else self.arrival + timeout_s
        # An embedding request's pooling ("last" or "mean"): its prompt's final hidden
        # states, summed over the chunks computed so far, become its `embedding`.
        self.pooling = pooling
        self.pooled: Any = None
        self.embedding: Any = None
        # Structured outputs: the grammar's matcher (llguidance), fed every output token.
        # Preemption keeps it: recompute re-reads the tokens it has already seen.
        self.matcher = matcher
        self.beam = beam  # the group's search, for a beam search request
        self.cum_logprob = 0.0  # a beam's: the sum of its output tokens' logprobs
        self.token_logprobs: list[float] = []  # a beam's: each output token's logprob

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

    def prompt_ids_to_score(self, start: int, n: int) -> list[int]:
        """Prompt logprobs: the prompt tokens that follow positions start..start+n-1, which
        a step computing those positions scores (none once output began: they are known)."""
        if self.params.prompt_logprobs is None or self.output_ids:
            return []
        return self.prompt_ids[start + 1 : start + 1 + n]

    @property
    def grammar_error(self) -> str | None:
        """Why the matcher rejected the output, once it has (the first line of llguidance's
        message: the rest dumps its state)."""
        if self.matcher is None or not self.matcher.is_error():
            return None
        message = self.matcher.get_error().partition("\n")[0]
        return f"structured output broke its grammar: {message}"

    def stops_on(self, token_id: int, generated: int) -> bool:
        """Whether `token_id`, output token number `generated` (from 1), ends the output.
        A stop token before min_tokens does not (the sampler holds it back with EOS until
        then: `ControlState.held`)."""
        if token_id in self.eos_ids:
            return True
        return token_id in self.stop_ids and generated >= self.params.min_tokens

    def set_output(self, output_ids: list[int]) -> None:
        """Replace the output (a beam taking over another beam's tokens, or restarting)."""
        self.output_ids = list(output_ids)
        ids = [*self.prompt_ids, *output_ids]
        self._ids = self._ids.with_ids(ids) if isinstance(self._ids, SaltedIds) else ids

    def append(self, token_id: int) -> str | None:
        """Record a sampled token; the reason the request stops with it, if it does."""
        self.output_ids.append(token_id)
        self._ids.append(token_id)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
            if self.matcher.is_error():  # (is_stopped() says True then too)
                return "error"
            if self.matcher.is_stopped():  # the grammar is complete (EOS, or nothing can follow)
                return "stop"
        if self.stops_on(token_id, len(self.output_ids)):
            return "stop"
        if len(self.output_ids) >= self.params.max_tokens:
            return "length"
        return None
