"""Continuous batching: `schedule()` picks a step's work, `postprocess()` takes its tokens.

The scheduler owns every request's life: it is the one registry of live requests and of
every transition (`jpaged.engine.registry.Registry`, which it extends: queued, forked,
preempted, finished by a token — EOS, max_tokens — or by `finish`: a stop string, an
abort, a failed step).

`schedule()`: every running decode, then prompt chunks, admitting under the budgets.

Every running decode goes first (one token each), then prompt chunks fill the
rest of the step's token budget (chunked prefill): prompts already admitted,
then new admissions. Both run in the same step, so a long prompt never stalls
the running sequences. Scheduling advances each request as if its step had run
(the engine schedules step N + 1 before step N's tokens are read);
`postprocess()` later hands it the sampled tokens and publishes its computed
blocks to the prefix cache. A step holds only what the cache grants
(`allocate_slots`): a prompt chunk is cut to what fits, leaving the admission
reserve to the decodes of other groups, or waits. When a decode finds the pool
dry, the youngest running request is preempted: its blocks are freed and it
waits at the head of the queue to be recomputed — vLLM's preemption by
recompute (a prompt preempts only when nothing else can move).

A request with `n > 1` choices is admitted as a group: its leader prefills the
prompt but its last token, then forks one sequence per other choice, sharing every
prompt block (forked choices sit next to their leader in `running`). From there each
choice is a sequence of its own, vLLM's way: preempted alone and readmitted alone
through the prefix cache, on its own tokens (the shared prompt blocks if still
cached, never another choice's output), and failed only when it alone outgrows the
pool, so a group the pool cannot hold together still finishes. A leader preempted
before it forked takes the choices it has yet to fork with it.

A beam search group (`jpaged.engine.beam`) is admitted, preempted and failed as
one, with `beam_width` sequences counted from its admission. Its first beam
prefills the whole prompt; each step after, once the host has read every beam's
likeliest next tokens, the registry's `search` picks the next beams and moves memory
to match: a beam extended by several children is forked (copy-on-write of its partial
last block), one extended by none is freed at once. A preempted group searches again
from its prompt (nothing of it was shown: beam results come at the end).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from jpaged.cache.protocol import CacheProtocol
from jpaged.config import EngineConfig
from jpaged.engine.contract import CoreOutputs, Decodes, Schedule, Scheduled, StepResult
from jpaged.engine.images import fit_chunk
from jpaged.engine.registry import Registry, members, unit
from jpaged.engine.request import Request, Status
from jpaged.engine.speculative import Speculator, accepted
from jpaged.engine.steady import Steady


class Scheduler(Registry):
    def __init__(self, config: EngineConfig, cache: CacheProtocol) -> None:
        super().__init__(cache)
        self.config = config
        self._copies: list[tuple[Request, int, int]] = []
        self._idle = False  # the last step scheduled nothing
        # the latest step's requests as columns, where it was a steady decode step
        self._steady: Steady | None = None
        # decode steps a call may run (`EngineConfig.num_scheduler_steps`; the engine sets
        # its runner's, which may run only one)
        self.max_steps = config.num_scheduler_steps
        self.speculator = (
            None
            if config.speculative is None
            else Speculator(config.speculative, config.max_batch_size)
        )

    def postprocess(self, rows: Sequence[Scheduled], result: StepResult, out: CoreOutputs) -> int:
        """A step ran and sampled `result.tokens` (int [positions]: one a row, 1 +
        len(drafts) for a row with drafts): publish the blocks it computed and hand each
        row's request its tokens, finishing those it ends, and each choice's news to `out`
        (a token, None for a prompt chunk short of its end; an ended beam search's
        hypotheses, best first); stale and finished rows are skipped. Returns the tokens
        it sampled for their requests (a beam's row counts one)."""
        # (one call each: a NumPy scalar a row costs ~10x)
        sampled, logprobs = result.tokens.tolist(), result.logprobs.tolist()
        if isinstance(rows, Decodes):
            return self._take_decodes(rows, result, sampled, logprobs, out)
        block_size = self.cache.block_size
        appended = 0
        searches: dict[int, list[tuple[int, Request]]] = {}  # a beam group's rows, by position
        at = 0
        for r, row in enumerate(rows):
            i, at = at, at + row.steps + len(row.drafts)
            req = row.req
            if req.finished or req.epoch != row.epoch:
                continue  # stopped, or preempted and recomputing, since it was scheduled
            if row.steps > 1:
                appended += self._take_steps(row, i, sampled, logprobs, out)
                continue
            if row.drafts:
                n = self._verify(row, sampled[i:at])
                for j in range(i, i + n):
                    _hand_over(out, result, row, r, j, sampled[j], logprobs[j])
                appended += n
                continue
            if row.computed // block_size > req.committed_blocks:  # (`_commit`'s test first)
                self._commit(req, row.computed)
            token = None
            if row.samples:
                req.num_pending -= 1
                appended += 1
                if req.beam is not None:
                    searches.setdefault(id(req.group), []).append((i, req))
                    continue
                token = sampled[i]
                reason = req.append(token)
                if reason is not None:
                    self.finish([req], reason, req.grammar_error)
            _hand_over(out, result, row, r, i, token, logprobs[i])
        for beams in searches.values():
            positions = [i for i, _ in beams]
            # a search that ended shows its hypotheses, token by token (text, stop strings)
            for beam in self.search(
                [r for _, r in beams], result.top_ids[positions], result.top_logprobs[positions]
            ):
                out.reqs += [beam] * len(beam.output_ids)
                out.tokens += beam.output_ids
                out.logprobs += beam.token_logprobs
                out.finished[beam] = (beam.finish_reason, beam.error)
        return appended

    def _take_decodes(
        self,
        rows: Decodes,
        result: StepResult,
        sampled: list[int],
        logprobs: list[float],
        out: CoreOutputs,
    ) -> int:
        """`postprocess` of a steady decode step (one token a row, read by columns)."""
        block_size = self.cache.block_size
        appended = 0
        columns = zip(rows.reqs, rows.computed.tolist(), rows.epoch.tolist(), strict=True)
        for i, (req, computed, epoch) in enumerate(columns):
            if req.finished or req.epoch != epoch:
                continue  # stopped, or preempted and recomputing, since it was scheduled
            if computed // block_size > req.committed_blocks:
                self._commit(req, computed)
            req.num_pending -= 1
            appended += 1
            token = sampled[i]
            reason = req.append(token)
            if reason is not None:
                self.finish([req], reason, req.grammar_error)
            _hand_over_token(out, result, req, i, token, logprobs[i])
        return appended

    def _take_steps(
        self,
        row: Scheduled,
        i: int,  # its first sampled position
        sampled: list[int],
        logprobs: list[float],
        out: CoreOutputs,
    ) -> int:
        """Take a row of several decode steps (`Scheduled.steps`): its tokens in order, as
        that many one-token steps would (blocks published, EOS, stop tokens, max_tokens),
        those after the one that finished it dropped (their K/V, in the row's own slots,
        goes with its blocks); returns how many it appended."""
        req, bs = row.req, self.cache.block_size
        start = row.computed - row.steps
        req.num_pending -= row.steps
        # (`_hand_over` inlined: such a row asks for no alternatives and scores nothing)
        reqs, tokens = out.reqs, out.tokens
        for j in range(row.steps):
            if (start + j + 1) // bs > req.committed_blocks:
                self._commit(req, start + j + 1)
            token = sampled[i + j]
            reason = req.append(token)
            reqs.append(req)
            tokens.append(token)
            if reason is not None:
                self.finish([req], reason, req.grammar_error)
                out.finished[req] = (req.finish_reason, req.error)
                out.logprobs += logprobs[i : i + j + 1]
                return j + 1
        out.logprobs += logprobs[i : i + row.steps]
        return row.steps

    def _verify(self, row: Scheduled, sampled: list[int]) -> int:
        """Take a row with drafts: its accepted drafts and the token sampled after them;
        returns how many tokens it appended. The rejected drafts' K/V stays in the pool
        unread until overwritten: the sequence shrinks back to the accepted tokens, giving
        back blocks only they took."""
        req, d = row.req, len(row.drafts)
        a = accepted(row.drafts, sampled)
        assert self.speculator is not None and req.seq_id is not None
        self.speculator.record(req, d, a)
        req.num_pending -= 1
        req.num_computed = row.computed - (d - a)
        self.cache.truncate(req.seq_id, req.num_computed)
        for j in range(a + 1):
            reason = req.append(sampled[j])
            if reason is not None:
                self.finish([req], reason, req.grammar_error)
                return j + 1
        self._commit(req, req.num_computed)  # the accepted tokens only
        return a + 1

    def schedule(self) -> Schedule:
        self._copies = []
        if self.max_steps > 1:
            several = self._schedule_steps(self.max_steps)
            if several is not None:
                self._steady = None
                return several
        moved = self._schedule_steady()
        if moved is not None:
            return moved
        preemptions = self.num_preemptions
        budget = self.config.max_num_batched_tokens
        decode: list[Request] = []
        failed: list[Request] = []
        proposals = {} if self.speculator is None else self.speculator.propose(self.running)
        # Sample positions a step has left for drafts: each sequence running, forked or
        # waiting takes one first (a step samples at most max_batch_size + extra; what
        # this step admits comes from those waiting).
        max_seqs = self.config.max_batch_size
        extra = 0 if self.speculator is None else self.speculator.extra
        waiting = sum(len(members(r)) for r in itertools.islice(self.waiting, max_seqs))
        draft_room = (
            max_seqs
            + extra
            - len(self.running)
            - waiting
            - sum(len(r.pending_fork) for r in self.running)
        )
        drafts: dict[int, list[int]] = {}
        # the token budget left for drafts once every decode has its token
        spare = budget - sum(not r.in_prefill for r in self.running) if proposals else 0
        # (none of these changes while decodes are scheduled, but a preemption's status)
        decodes = [r for r in self.running if r.prefilled and not r.will_finish]
        # Growth in place takes nothing from the pool: done at once for every decode
        # without drafts, it leaves the other decodes' growth and preemptions as they were
        # (a preempted decode's growth goes with its sequence).
        steady = [r for r in decodes if id(r) not in proposals]
        in_place = self.cache.grow_decodes([r.seq_id for r in steady])  # type: ignore[misc]
        grown = {id(r) for r, ok in zip(steady, in_place, strict=True) if ok}
        for req in decodes:
            if req.status is not Status.RUNNING:
                continue  # preempted for another decode's growth
            d = []
            if id(req) in proposals:  # a step emits up to 1 + len(d) tokens: never past max_tokens
                most = min(draft_room, spare, req.params.max_tokens - req.num_sampled - 1)
                d = proposals[id(req)][: max(most, 0)].tolist()
            assert req.seq_id is not None
            if d and self._grant(req, 1 + len(d), cut=False) is not None:
                drafts[id(req)] = d
                draft_room -= len(d)
                spare -= len(d)
                budget -= len(d)
            elif id(req) not in grown and not self._reserve(req, failed):
                continue
            decode.append(req)
            budget -= 1

        prefill: list[tuple[Request, int]] = []
        # Prompt chunks leave the reserve free: their peaks pass, decodes' growth stays.
        reserve = self._prompt_reserve()
        # chunked prompts already admitted continue first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            if req.in_prefill:
                # Nothing moved last step nor does this one (no step in flight will free
                # memory): waiting would wait forever, so its chunk may preempt.
                stuck = self._idle and not decode and not prefill
                budget -= self._prefill(req, budget, prefill, failed, reserve, stuck)
        # sequences running, or to be forked (choices, beams) by those running
        seqs = 0
        if self.waiting:  # (a steady decode skips the count: a pass over every row)
            seqs = sum(len(members(r)) for r in {unit(r): r for r in self.running}.values())
        # After a preemption memory is short: admit nobody (nor readmit the preempted,
        # which this step may have scheduled already).
        while self.waiting and budget > 0 and self.num_preemptions == preemptions:
            req = self.waiting[0]
            live = members(req)
            batch_room = self.config.max_batch_size - seqs
            if len(live) > min(batch_room, self.cache.free_seq_count()):
                break
            # Cached blocks carry no logits nor hidden states, so a request that wants its
            # prompt's logprobs, or an embedding, computes it all.
            whole = req.params.prompt_logprobs is not None or req.pooling is not None
            lookup = None if whole else req.all_ids
            if req.lora is not None and not req.lora_slot:
                if self.loras is None or not self.loras.usable(req.lora):
                    # Its reference forbids this (a bug elsewhere): it fails alone, not the
                    # engine thread and with it every request.
                    failed += self.fail([req], f"LoRA adapter {req.lora!r} is not loaded")
                    continue
                # a slot for its adapter, held to its end; none free: it waits (in order)
                slot = self.loras.acquire(req.lora)
                if slot is None:
                    break
                for choice in req.group:
                    choice.lora_slot = slot
            cached = self.cache.num_cached_tokens(lookup) if lookup else 0
            # beams fork once the search picks them, choices before the last prompt token
            forks = [] if req.beam else [r for r in live if r is not req]
            target = len(req.prompt_ids) - 1 if forks else req.num_tokens
            want = min(max(target - cached, 0), budget)
            # (a chunk never splits an image: it may wait for a step with room for it)
            fit = fit_chunk(req.images, cached, want)
            if want and not fit:
                break
            chunk = self._grant(req, fit, lookup, reserve, start=cached)
            if chunk is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            assert req.seq_id is not None
            req.num_computed = self.cache.get_seq_len(req.seq_id) - chunk  # the cached prefix
            req.fork_at = len(req.prompt_ids) - 1
            self.running.append(req)
            seqs += len(live)
            if chunk:
                prefill.append((req, chunk))
                budget -= chunk
                continue
            # a prompt cached up to its fork: the leader forks now, the choices compute on
            j = len(self.running) - 1
            while j < len(self.running) and budget > 0:
                budget -= self._prefill(self.running[j], budget, prefill, failed, reserve)
                j += 1
        # A preemption may have unscheduled requests scheduled earlier.
        alive = {id(r) for r in self.running}
        rows = [self._advance(r, 1, drafts.get(id(r))) for r in decode if id(r) in alive]
        rows += [self._advance(r, n) for r, n in prefill if id(r) in alive]
        copies = [(s, d) for r, s, d in self._copies if id(r) in alive]
        self._idle = not rows
        # (a step that may draft is the whole schedule's: the speculator proposes each step)
        plain = not (copies or failed or self.speculator is not None)
        self._steady = Steady.of(rows, self.running) if plain else None
        return Schedule(rows, copies, failed)

    def _schedule_steady(self) -> Schedule | None:
        """The latest step moved on by a token (`jpaged.engine.steady`), where nothing
        changed since but finishes: the same requests running, in the same order, but
        those that finished (none admitted, preempted or forked), none waiting but for a
        free slot, and the pool holding every row's growth without a copy or a preemption
        (`grow_all`). What the whole schedule would do then, with NumPy over the rows;
        None: it decides."""
        steady = self._steady
        # (with every slot taken, those waiting wait: the whole schedule admits nobody)
        full = len(self.running) >= self.config.max_batch_size
        if steady is None or (self.waiting and not full):
            return None
        if self.running != steady.reqs and not steady.drop_finished(self.running):
            return None
        rows = steady.next()
        if not rows or not self.cache.grow_all(rows.seq_ids.tolist()):
            return None
        for req in rows.reqs:  # (`_advance`'s bookkeeping)
            req.num_computed += 1
            req.num_pending += 1
        steady.advance()
        self._idle = False
        return Schedule(rows, [], [])

    def _schedule_steps(self, most: int) -> Schedule | None:
        """Several decode steps in one call (`EngineConfig.num_scheduler_steps`), where
        every running sequence decodes plainly: nobody waits or prefills, no row needs what
        the host must see between tokens (drafts, a grammar, penalties or a blocked EOS,
        logprobs, beams). As many steps as every row's `max_tokens` leaves (at most `most`),
        each row grown by that many slots at once; None (an ordinary step) where that is
        one, or where the pool might not hold every row's growth without preempting."""
        if self.waiting or self.speculator is not None or not self.running:
            return None
        decodes = []
        steps = most
        for req in self.running:
            if not req.prefilled or req.pending_fork:
                return None
            if req.will_finish:
                continue  # its last token is pending: nothing to compute
            p = req.params
            if (
                req.beam is not None
                or req.matcher is not None
                or req.pooling is not None
                or p.has_controls
                or p.logprobs is not None
                or p.prompt_logprobs is not None
                or req.num_sampled < p.min_tokens
            ):
                return None
            steps = min(steps, p.max_tokens - req.num_sampled)
            decodes.append(req)
        if steps < 2 or not decodes:
            return None
        seq_ids: list[int] = [r.seq_id for r in decodes]  # type: ignore[misc]
        grown = self.cache.grow_decodes(seq_ids, steps)  # in place: most rows, in one pass
        rest = [r for r, ok in zip(decodes, grown, strict=True) if not ok]
        # The others' growth takes at most their new pages and a copy of a partial last page
        # that may be shared (a forked choice's), in every KV group: more than the pool
        # holds, and the step is an ordinary one (the rows grown here shrink back).
        free = self.cache.free_block_capacity()
        if rest and free is not None:
            bs = self.cache.block_size
            need = 0
            for req in rest:
                n = self.cache.get_seq_len(req.seq_id)  # type: ignore[arg-type]
                need += -(-(n + steps) // bs) - -(-n // bs) + (n % bs != 0)
            if need * self.cache.num_groups > free:
                for seq_id, ok in zip(seq_ids, grown, strict=True):
                    if ok:
                        self.cache.truncate(seq_id, self.cache.get_seq_len(seq_id) - steps)
                return None
        for req in rest:
            granted = self._grant(req, steps, cut=False)
            assert granted is not None, "a growth the free blocks hold failed"
        rows = []
        for req in decodes:
            start = req.num_computed
            req.num_computed = start + steps
            rows.append(
                Scheduled(
                    req,
                    req.all_ids[start : start + 1] or [0],
                    req.num_pending > 0,
                    req.num_sampled,
                    True,
                    start + steps,
                    req.epoch,
                    steps=steps,
                )
            )
            req.num_pending += steps
        self._idle = False
        copies = [(s, d) for _, s, d in self._copies]
        return Schedule(rows, copies, [])

    def _advance(self, req: Request, n: int, drafts: list[int] | None = None) -> Scheduled:
        """Move the request on by `n` computed tokens (and its `drafts`) as if the step had
        run and accepted every draft (`postprocess` corrects that)."""
        start = req.num_computed
        drafts = drafts or []
        computed = req.num_computed = start + n + len(drafts)
        # a prompt chunk samples once it reaches the end (a group leader stops short)
        samples = req.prefilled = req.prefilled or computed >= req.num_tokens
        tokens = req.all_ids[start : start + n] or [0]
        row = Scheduled(
            req,
            tokens + drafts if drafts else tokens,
            req.num_pending > 0,
            req.num_sampled,
            samples,
            computed,
            req.epoch,
            req.prompt_ids_to_score(start, n) if req.params.prompt_logprobs is not None else [],
            drafts,
        )
        req.num_pending += samples
        return row

    def _prefill(
        self,
        req: Request,
        budget: int,
        prefill: list[tuple[Request, int]],
        failed: list,
        reserve: int = 0,
        stuck: bool = False,
    ) -> int:
        """Schedule the next chunk of a running request's prefill, at most `budget` tokens
        (chunked prefill) and cut to what the pool holds with `reserve` blocks to spare;
        returns the tokens it takes. The reserve protects other groups' decodes: a group
        running alone, or `stuck` (nothing else in the step moves), has none. When not one
        token fits, the request waits for memory, unless it is stuck: then it preempts
        younger groups as a decode does."""
        if req.status is not Status.RUNNING:
            return 0
        if req.pending_fork and req.num_computed >= req.fork_at:
            self._fork(req)
        chunk = min(req.prefill_target - req.num_computed, budget)
        chunk = fit_chunk(req.images, req.num_computed, chunk)  # never splitting an image
        if chunk <= 0:
            return 0
        if stuck or all(unit(r) == unit(req) for r in self.running):
            reserve = 0
        granted = self._grant(req, chunk, reserve=reserve, start=req.num_computed)
        if granted is None:
            one = fit_chunk(req.images, req.num_computed, 1)
            if not (one and stuck and self._reserve(req, failed)):
                return 0
            granted = 1
        prefill.append((req, granted))
        return granted

    def _grant(
        self,
        req: Request,
        n: int,
        lookup: list[int] | None = None,
        reserve: int = 0,
        cut: bool = True,
        start: int = 0,
    ) -> int | None:
        """Grow the request's sequence by `n` tokens (or, for a request without one, start
        a sequence at the cached prefix of `lookup`, its prompt) as far as the cache grants:
        `n`, else (`cut`) the first of n / 2, n / 4, ... 1 that fits with `reserve` blocks
        to spare; None when none does."""
        while True:
            granted = self.cache.allocate_slots(
                req.seq_id, n, num_tokens=req.num_tokens, token_ids=lookup, reserve=reserve
            )
            if granted is not None:
                req.seq_id, copies = granted
                if copies:
                    self._copies.extend((req, src, dst) for src, dst in copies)
                return n
            if not cut or n <= 1:
                return None
            n = fit_chunk(req.images, start, n // 2)  # (`start`: where the chunk begins)
            if not n:
                return None

    def _reserve(self, req: Request, failed: list[Request]) -> bool:
        """Grow the request's sequence by one token, preempting younger (or less urgent)
        requests for room.

        False when the request could not grow: it was preempted (its group was the
        youngest) or failed (its group alone outgrows the pool).
        """
        while self._grant(req, 1, cut=False) is None:
            # the least urgent (highest priority value), the youngest of those
            victim = max(reversed(self.running), key=lambda r: r.priority)
            if unit(victim) != unit(req):
                self.preempt(victim)
            elif all(unit(r) == unit(req) for r in self.running):
                # alone and still no room: no preemption can help
                failed += self.fail([req], "sequence outgrew the whole KV pool")
                return False
            else:
                self.preempt(req)  # it is the youngest
                return False
        return True

    def _prompt_reserve(self) -> int:
        """Blocks this step's prompt chunks leave free for the decodes of those running."""
        capacity = self.cache.free_block_capacity()
        # Memory reserved per slot needs no reserve; with nothing running the reserve
        # protects nobody.
        if capacity is None or not self.running:
            return 0
        return math.ceil(self.config.admission_reserve * capacity)


def _hand_over(
    out: CoreOutputs,
    result: StepResult,
    row: Scheduled,
    r: int,  # the row's index in its step
    i: int,  # the sampled position
    token: int | None,
    logprob: float,
) -> None:
    """What a step did to a row's choice, for the output processor."""
    if row.score_ids:
        scores = result.scores[r]
        assert scores is not None  # (a row that scores tokens has their scores)
        out.scores[len(out.reqs)] = (row.computed - len(row.token_ids), scores)
    _hand_over_token(out, result, row.req, i, token, logprob)


def _hand_over_token(
    out: CoreOutputs,
    result: StepResult,
    req: Request,
    i: int,  # the sampled position
    token: int | None,
    logprob: float,
) -> None:
    """A row's token (None: none sampled) and its choice's state, for the output processor."""
    k = len(out.reqs)
    if req.params.logprobs:  # (the alternatives are read for those alone)
        out.top[k] = (result.top_ids[i], result.top_logprobs[i])
    out.reqs.append(req)
    out.tokens.append(token)
    out.logprobs.append(logprob)
    if req.finished:  # as it stands now: the output processor may read it later
        out.finished[req] = (req.finish_reason, req.error)
