"""The steady decode step: the latest step's requests, each decoding one token more.

Most steps of a serving engine are this one: nobody admitted, finished, preempted or forked
since the latest step, every running request decoding the token that step sampled (still
on the device). `Steady` keeps such a step's rows as columns (`contract.Decodes`) and moves
them on by a token with NumPy, so that the step makes no Python object a row: the
scheduler grows every sequence at once (`CacheProtocol.grow_all`), the batch moves the
latest layout on (`Batcher.steady`), `Scheduler.postprocess` reads the columns.

Requests that finished leave the set (their rows dropped). Anything else (a request
admitted, one reaching its `max_tokens`, a block to copy or a preemption, drafts, prompt
chunks, grammars, penalties, beams, images, scores) is the whole schedule's, row by row,
and the set starts again from the rows it schedules.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from jpaged.engine.contract import Decodes, Scheduled
from jpaged.engine.request import Request


def _plain(row: Scheduled) -> bool:
    """Whether a row is a decode the next steps may move on as columns: one token read from
    the device, sampled with fixed parameters (`row_of` gives it no controls, no blocked
    EOS, no images, nothing to score), and nothing the host must see between tokens."""
    req, p = row.req, row.req.params
    return (
        row.on_device
        and row.samples
        and row.steps == 1
        and not row.drafts
        and not row.score_ids
        and not req.pending_fork
        and req.beam is None
        and req.matcher is None
        and req.pooling is None
        and not req.images
        and not p.has_controls
        and p.prompt_logprobs is None
        and row.sample_index >= p.min_tokens
    )


class Steady:
    """The rows of the latest step, where it decoded one token of every running request,
    in `running`'s order, each a plain decode."""

    def __init__(self, rows: Decodes, max_tokens: np.ndarray) -> None:
        self.rows = rows
        self.max_tokens = max_tokens  # int [n]: each request's params.max_tokens
        self.seq_ids: list[int] = rows.seq_ids.tolist()  # (for the cache, once)

    @staticmethod
    def of(rows: Sequence[Scheduled], running: list[Request]) -> Steady | None:
        """The steady set of a step the whole schedule made, or None: its rows are not
        one plain decode of each running request, in order."""
        if not rows or len(rows) != len(running):
            return None
        if not all(row.req is req and _plain(row) for row, req in zip(rows, running, strict=True)):
            return None
        n = len(rows)
        columns = (
            (row.req.seq_id, row.sample_index, row.computed, row.epoch, row.req.params.max_tokens)
            for row in rows
        )
        seq_ids, sample_index, computed, epoch, max_tokens = (
            np.fromiter(itertools.chain.from_iterable(columns), np.int64, 5 * n).reshape(n, 5).T
        )
        return Steady(Decodes(list(running), seq_ids, sample_index, computed, epoch), max_tokens)

    def drop_finished(self, running: list[Request]) -> bool:
        """Drop the rows whose requests finished since, where `running` is the rest, in
        order; False (nothing dropped) where it is not: a request admitted, preempted or
        forked meanwhile."""
        reqs = self.rows.reqs
        if len(running) >= len(reqs):
            return False
        keep = np.fromiter((not r.finished for r in reqs), bool, len(reqs))
        left = list(itertools.compress(reqs, keep))
        if left != running:
            return False
        rows = self.rows
        seq_ids = rows.seq_ids[keep]
        self.rows = Decodes(
            left, seq_ids, rows.sample_index[keep], rows.computed[keep], rows.epoch[keep]
        )
        self.max_tokens = self.max_tokens[keep]
        self.seq_ids = seq_ids.tolist()
        return True

    def next(self) -> Decodes | None:
        """The next step's rows, each a token further; None where a request's next token
        would pass its max_tokens (its last one is pending: the whole schedule drops it)."""
        rows = self.rows
        sample_index = rows.sample_index + 1
        if (sample_index >= self.max_tokens).any():
            return None
        return Decodes(rows.reqs, rows.seq_ids, sample_index, rows.computed + 1, rows.epoch)
