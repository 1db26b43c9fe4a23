"""The steady decode step: the latest step's requests, each decoding one token more.

Most steps of a serving engine are this one: nobody admitted, preempted or forked since
the latest step, every running request decoding the token that step sampled (still on the
device). `Steady` keeps such a step's rows as columns (`contract.Decodes`) and moves
them on by a token with NumPy, so that the step makes no Python object a row: the
scheduler grows every sequence at once (`CacheProtocol.grow_all`), the batch moves the
latest layout on (`Batcher.steady`), `Scheduler.postprocess` reads the columns.

A request whose last token is pending gets no row (as in the whole schedule), and once
it finished it leaves the set. Anything else (a request admitted, a block to copy or a
preemption, drafts, prompt chunks, grammars, penalties, beams, images, scores) is the
whole schedule's, row by row, and the set starts again from the rows it schedules.
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
    """The running requests of the latest step, where it decoded one token of each, in
    order, each a plain decode, but those whose last token is pending (`will_finish`:
    they decode no more): as columns, each request's state once that step ran."""

    def __init__(
        self,
        reqs: list[Request],
        seq_ids: np.ndarray,  # int [n]
        sampled: np.ndarray,  # int [n]: output tokens sampled, read or not (`num_sampled`)
        computed: np.ndarray,  # int [n]: tokens computed, dispatched steps' included
        epoch: np.ndarray,  # int [n]
        max_tokens: np.ndarray,  # int [n]
    ) -> None:
        self.reqs = reqs
        self.seq_ids, self.sampled, self.computed = seq_ids, sampled, computed
        self.epoch, self.max_tokens = epoch, max_tokens

    @staticmethod
    def of(rows: Sequence[Scheduled], running: list[Request]) -> Steady | None:
        """The steady set of a step the whole schedule made, or None: its rows are not
        one plain decode of each running request, in order, but those at their end."""
        if not rows:
            return None
        at = 0
        for req in running:
            if at < len(rows) and rows[at].req is req:
                if not _plain(rows[at]):
                    return None
                at += 1
            elif not (req.will_finish and req.prefilled and req.beam is None):
                return None
        if at != len(rows):
            return None
        n = len(running)
        columns = (
            (r.seq_id, r.num_sampled, r.num_computed, r.epoch, r.params.max_tokens) for r in running
        )
        flat = np.fromiter(itertools.chain.from_iterable(columns), np.int64, 5 * n)
        return Steady(list(running), *flat.reshape(n, 5).T)

    def drop_finished(self, running: list[Request]) -> bool:
        """Drop the requests that finished since, where `running` is the rest, in order;
        False (nothing dropped) where it is not: a request admitted, preempted or forked
        meanwhile."""
        reqs = self.reqs
        if len(running) >= len(reqs):
            return False
        keep = np.fromiter((not r.finished for r in reqs), bool, len(reqs))
        left = list(itertools.compress(reqs, keep))
        if left != running:
            return False
        self.reqs, self.seq_ids = left, self.seq_ids[keep]
        self.sampled, self.computed = self.sampled[keep], self.computed[keep]
        self.epoch, self.max_tokens = self.epoch[keep], self.max_tokens[keep]
        return True

    def next(self) -> Decodes:
        """The next step's rows: every request a token further, but those at their
        max_tokens (their last token is pending: the whole schedule gives them no row)."""
        decoding = self.sampled < self.max_tokens
        if decoding.all():
            return Decodes(self.reqs, self.seq_ids, self.sampled, self.computed + 1, self.epoch)
        return Decodes(
            list(itertools.compress(self.reqs, decoding)),
            self.seq_ids[decoding],
            self.sampled[decoding],
            self.computed[decoding] + 1,
            self.epoch[decoding],
        )

    def advance(self) -> None:
        """The step `next` made was scheduled."""
        decoding = self.sampled < self.max_tokens
        self.sampled = self.sampled + decoding
        self.computed = self.computed + decoding
