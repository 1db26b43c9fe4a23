"""A serving process and Python's cycle collector: what warm-up made stays out of the
collector's way."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """The collector off while a process imports the modules it lives with, then what they
    made frozen out of its way (`imported`): as they grew, full collections walked them
    again and again (0.3 s of a server's 1.1 s of imports)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        imported()
        if enabled:
            gc.enable()


def imported() -> None:
    """Move what the imports made (a process's modules, mostly alive to its end) out of the
    collector's generations, uncollected: a model's load then meets full collections that
    walk only what it makes (an 8B GGUF's load spent 0.23 s of its 2.9 in them). In a
    process whose imports live to its end."""
    gc.freeze()


def settle() -> None:
    """Collect, then move every object alive now (the model's arrays, the compiled programs,
    the pool's bookkeeping) out of the collector's generations: a full collection no longer
    walks them. Without it 256 users decoding met one every ~220 steps, walking ~320k
    objects for ~400 ms while every stream waited (a 2-core CPU, the tiny model; with it,
    ~13 ms; vLLM freezes its engine's heap for the same reason). Frozen objects are never
    collected: call it once, after warm-up, in a process whose engine lives to its end."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def settled() -> Iterator[None]:
    """`settle` for the block's time (a benchmark's timed passes, as a server runs them);
    what was frozen is collectable again after it."""
    settle()
    try:
        yield
    finally:
        gc.unfreeze()
