"""Which sequence holds which row of the device's `ControlState` (penalties, logit bias).

A sequence whose request has penalties or a logit bias gets a slot when it first
samples: its slot's row is reset and filled from what the host knows (the prompt's
tokens, the tokens generated so far, the bias), in one small program that runs
before the step's sampler; from then on the sampler counts each token it samples
into that row itself, so no step sends or computes anything vocabulary-sized on the
host. A sequence that a call leaves out gives its slot back (a finished, preempted
or aborted one is never seen again); should it come back, its slot is refilled from
its history, which the host knows in full by then (only the previous call's tokens
are ever unread, and such a sequence was in that call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.engine.sampling import ControlState

# what a fill entry does to its slot's row (`_fill`)
PROMPT, OUTPUT, BIAS, HELD, NOTHING = range(5)


@dataclasses.dataclass(frozen=True)
class RowControls:
    """A row's penalties and bias, and what its slot is filled from when it gets one."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    history: Sequence[int] = ()  # prompt + generated ids (the request's list, read once)
    prompt_len: int = 0
    held: Sequence[int] = ()  # stop_token_ids that min_tokens holds back (besides EOS)


def _fill(state: ControlState, reset: jax.Array, fill: jax.Array) -> ControlState:
    """Zero the `reset` slots' rows (their held tokens: the inert row's, EOS), then apply
    `fill` int32 [4, n]: (slot, token, what, bias bits) entries; padding points at the
    inert row and does NOTHING."""
    slot, token, what = fill[0], fill[1], fill[2]
    value = jax.lax.bitcast_convert_type(fill[3], jnp.float32)
    return ControlState(
        counts=state.counts.at[reset].set(0).at[slot, token].add(what == OUTPUT),
        prompt=state.prompt.at[reset].set(False).at[slot, token].max(what == PROMPT),
        bias=state.bias.at[reset].set(0).at[slot, token].add(jnp.where(what == BIAS, value, 0)),
        held=state.held.at[reset].set(state.held[-1]).at[slot, token].max(what == HELD),
    )


fill_fn = jax.jit(_fill, donate_argnums=0)


class ControlSlots:
    def __init__(
        self, slots: int, vocab: int, eos_ids: Sequence[int], put: Callable[[np.ndarray], jax.Array]
    ) -> None:
        self.slots, self.vocab, self.eos_ids, self._put = slots, vocab, eos_ids, put
        self.inert = slots  # the last row
        self.state: ControlState | None = None  # allocated when first needed
        self._slot_of: dict[int, int] = {}  # seq id -> slot

    def allocate(self) -> ControlState:
        """A zero state (every row holding EOS back), the host's arrays put on the devices."""
        shape = (self.slots + 1, self.vocab)
        held = np.zeros(shape, bool)
        held[:, [t for t in self.eos_ids if t < self.vocab]] = True
        return ControlState(
            counts=self._put(np.zeros(shape, np.int32)),
            prompt=self._put(np.zeros(shape, bool)),
            bias=self._put(np.zeros(shape, np.float32)),
            held=self._put(held),
        )

    def reset(self) -> None:
        """The state was lost with a failed step: allocate afresh when next needed."""
        self.state, self._slot_of = None, {}

    def assign(
        self, seq_ids: Sequence[int], controls: Sequence[RowControls | None], counted: Callable
    ) -> np.ndarray:
        """Slots of a call's rows (the inert row for rows without controls), filling the
        rows of sequences new to a slot; `counted` runs a jitted function."""
        if self.state is None:
            self.state = self.allocate()
        keep = {s for s, c in zip(seq_ids, controls, strict=True) if c is not None}
        self._slot_of = {s: i for s, i in self._slot_of.items() if s in keep}
        free = sorted(set(range(self.slots)) - set(self._slot_of.values()))
        fresh: list[tuple[int, RowControls]] = []
        for seq_id, c in zip(seq_ids, controls, strict=True):
            if c is not None and seq_id not in self._slot_of:
                self._slot_of[seq_id] = free.pop(0)
                fresh.append((self._slot_of[seq_id], c))
        if fresh:
            self.state = counted(fill_fn, self.state, *self._fill_arrays(fresh))
        return np.array(
            [
                self._slot_of.get(s, self.inert) if c is not None else self.inert
                for s, c in zip(seq_ids, controls, strict=True)
            ],
            np.int32,
        )

    def _fill_arrays(self, fresh: list[tuple[int, RowControls]]) -> tuple[jax.Array, jax.Array]:
        reset = np.full(self.slots, self.inert, np.int32)
        reset[: len(fresh)] = [slot for slot, _ in fresh]
        entries = []
        for slot, c in fresh:
            ids = np.asarray(c.history, np.int32)
            what = np.where(np.arange(len(ids)) < c.prompt_len, PROMPT, OUTPUT)
            bias = c.logit_bias or {}
            bias_ids = np.array(list(bias), np.int32)
            held = np.array([t for t in c.held if t < self.vocab], np.int32)
            entries.append(
                np.stack(
                    [
                        np.full(len(ids) + len(bias_ids) + len(held), slot, np.int32),
                        np.concatenate([ids, bias_ids, held]),
                        np.concatenate(
                            [what, np.full(len(bias_ids), BIAS), np.full(len(held), HELD)]
                        ).astype(np.int32),
                        np.concatenate(
                            [
                                np.zeros(len(ids), np.float32),
                                np.array([bias[t] for t in bias_ids.tolist()], np.float32),
                                np.zeros(len(held), np.float32),
                            ]
                        ).view(np.int32),
                    ]
                )
            )
        flat = np.concatenate(entries, axis=1)
        n = flat.shape[1]
        size = max(64, 1 << (n - 1).bit_length())  # powers of two: few programs
        fill = np.zeros((4, size), np.int32)
        fill[0], fill[2] = self.inert, NOTHING
        fill[:, :n] = flat
        return self._put(reset), self._put(fill)
