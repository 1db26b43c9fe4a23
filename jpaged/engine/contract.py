"""The step's contract: what the scheduler hands the engine (`Schedule`, a `Scheduled` row
a request, or `Decodes`, a steady decode step's rows as columns), the runner's rows (`Row`,
one a scheduled sequence: `row_of`), and what the runner returns (`StepResult`). Below the
scheduler, the batch and the runner, which all read it, and importing none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import overload

import numpy as np

from jpaged.engine.buckets import Shape
from jpaged.engine.controls import RowControls
from jpaged.engine.images import RowImage, row_images
from jpaged.engine.request import Request


@dataclasses.dataclass(slots=True)
class Scheduled:
    """One request's row in a step, as it stood when scheduled (not modified after: not
    frozen, whose checks made it ~5x dearer to build, one a row a step)."""

    req: Request
    token_ids: list[int]  # to compute; [0] for a decode whose input is still on the device
    on_device: bool  # the input is the token the previous step sampled, not read yet
    sample_index: int  # which of the request's output tokens the row samples
    samples: bool  # a prompt chunk short of its end computes K/V but samples nothing
    computed: int  # the request's computed tokens once the step ran
    epoch: int  # a request preempted since has a newer epoch: the row's result is stale
    # prompt logprobs: the prompt tokens that follow the row's first tokens, to score
    score_ids: list[int] = dataclasses.field(default_factory=list)
    # speculative decoding: the row's tokens after its first are these drafts, and it
    # samples after each of its 1 + len(drafts) tokens (`jpaged.engine.speculative`)
    drafts: list[int] = dataclasses.field(default_factory=list)
    # decode steps the call runs (`EngineConfig.num_scheduler_steps`): the row samples this
    # many tokens, its input for each after the first the one sampled before (every row of
    # a call runs as many)
    steps: int = 1


class Decodes(Sequence[Scheduled]):
    """A steady decode step's rows (`jpaged.engine.steady`): the latest step's requests, in
    its order, each decoding one token that the previous call sampled (still on the
    device), with nothing to score, no drafts, penalties, grammar or images. Columns, so
    that the step makes no Python object a row: the scheduler, the batch and the runner
    read the arrays. As a sequence of `Scheduled` rows (made on demand) it stands for
    them where a step's rows are read one by one (failures, the rare paths)."""

    def __init__(
        self,
        reqs: list[Request],
        seq_ids: np.ndarray,  # int [n]
        sample_index: np.ndarray,  # int [n]: which output token each row samples
        computed: np.ndarray,  # int [n]: each request's computed tokens once the step ran
        epoch: np.ndarray,  # int [n]
    ) -> None:
        self.reqs = reqs
        self.seq_ids, self.sample_index = seq_ids, sample_index
        self.computed, self.epoch = computed, epoch

    def __len__(self) -> int:
        return len(self.reqs)

    @overload
    def __getitem__(self, i: int) -> Scheduled: ...

    @overload
    def __getitem__(self, i: slice) -> list[Scheduled]: ...

    def __getitem__(self, i: int | slice) -> Scheduled | list[Scheduled]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Scheduled(
            self.reqs[i],
            [0],
            True,
            int(self.sample_index[i]),
            True,
            int(self.computed[i]),
            int(self.epoch[i]),
        )


@dataclasses.dataclass
class Schedule:
    rows: Sequence[Scheduled]  # decodes, then prompt chunks (a steady step: `Decodes`)
    copies: list[tuple[int, int]]  # copy-on-write block copies to do before the step
    failed: list[Request]  # grew past the whole pool while running alone


@dataclasses.dataclass(slots=True)
class Row:
    """One sequence's part of a step."""

    seq_id: int
    token_ids: Sequence[int]  # the new tokens this row writes
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    sample_index: int = 0  # which of its sequence's output tokens the row samples
    logprobs: int = 0
    # A decode row whose input token the previous call sampled and the host has not read:
    # the step reads it from the ring (the row's `token_ids` entry is then ignored).
    on_device: bool = False
    # The tokens that follow the row's first len(score_ids) tokens: the step returns how
    # likely the model found each (prompt logprobs).
    score_ids: Sequence[int] = ()
    score_top: bool = False  # and their likeliest alternatives
    controls: RowControls | None = None  # penalties or a logit bias (rows that sample)
    block_eos: bool = False  # min_tokens not reached: EOS may not be sampled
    # Speculative decoding: the row's last `drafts` tokens are drafts, and the step samples
    # after each of its last 1 + drafts tokens (output indices sample_index, +1, ...).
    drafts: int = 0
    lora_slot: int = 0  # the slot of the row's LoRA adapter (0: none)
    min_p: float = 0.0
    images: tuple[RowImage, ...] = ()  # the images (or their ends) among its tokens


def row_of(row: Scheduled) -> Row:
    """A scheduled sequence's part of a step, as its request's parameters make it."""
    req, p = row.req, row.req.params
    assert req.seq_id is not None
    controls = None
    if p.has_controls and row.samples:
        controls = RowControls(
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
            p.logit_bias,
            req.all_ids,
            len(req.prompt_ids),
            p.stop_token_ids if p.min_tokens else (),
        )
    n = len(row.token_ids)
    return Row(
        req.seq_id,
        row.token_ids,
        p.temperature,
        p.top_k,
        p.top_p,
        req.seed,
        row.sample_index,
        req.beam.top if req.beam else p.logprobs or 0,
        row.on_device,
        row.score_ids,
        bool(p.prompt_logprobs),
        controls,
        row.samples and row.sample_index < p.min_tokens,
        len(row.drafts),
        req.lora_slot,
        p.min_p,
        row_images(req.images, row.computed - n, n) if req.images and not row.drafts else (),
    )


@dataclasses.dataclass
class Scores:
    """How likely the model found the tokens a row was given (`Row.score_ids`)."""

    logprobs: np.ndarray  # f32 [m]
    top_ids: np.ndarray  # int32 [m, K]
    top_logprobs: np.ndarray  # f32 [m, K]


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # f32 [n]
    top_ids: np.ndarray  # int32 [n, K]
    top_logprobs: np.ndarray  # f32 [n, K]
    shape: Shape  # the bucket this call ran in (for benchmarks: real vs padded work)
    scores: list[Scores | None] = dataclasses.field(default_factory=list)  # [n], if scored


@dataclasses.dataclass
class CoreOutputs:
    """What one engine step hands the output processor (vLLM's `EngineCoreOutputs`), which
    may read it in another thread while the engine runs its next steps: the choices it
    touched, in order, each with the token it sampled (None: a new state alone, a prompt
    chunk computed or a finish), and each finish as it stood then (the request object
    moves on). Columns, not an object a row: a steady decode step adds three list entries
    a row, and the rare extras go by entry number."""

    reqs: list[Request] = dataclasses.field(default_factory=list)
    tokens: list[int | None] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # entry -> the likeliest tokens' ids and logprobs (int [K], f32 [K]), where asked for
    top: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    # entry -> (the position the scores start after, the prompt tokens' `Scores`)
    scores: dict[int, tuple[int, Scores]] = dataclasses.field(default_factory=dict)
    # choice -> (finish reason, error), for the choices this step finished
    finished: dict[Request, tuple[str | None, str | None]] = dataclasses.field(default_factory=dict)

    def finish(self, reqs: Sequence[Request]) -> None:
        """These choices finished in this step (aborted, failed, done): an entry each."""
        for req in reqs:
            self.reqs.append(req)
            self.tokens.append(None)
            self.logprobs.append(0.0)
            self.finished[req] = (req.finish_reason, req.error)

    def extend(self, other: CoreOutputs) -> None:
        """Append another step's entries (data-parallel replicas hand over one a step)."""
        at = len(self.reqs)
        self.reqs += other.reqs
        self.tokens += other.tokens
        self.logprobs += other.logprobs
        self.top.update({at + k: v for k, v in other.top.items()})
        self.scores.update({at + k: v for k, v in other.scores.items()})
        self.finished.update(other.finished)
