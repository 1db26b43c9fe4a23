"""A CPU model's weights moved into transparent huge pages while its server is idle.

The loader maps its arrays in small pages (`hostcopy.empty`): on a VM that hands freed memory
back to its host, each fresh 2 MB page faulted in cost ~2.4 ms, and an 8B file loaded in 5 s
instead of 2.8. Read in huge pages, though, a one-token matmul streams its weights ~10%
faster (fewer TLB misses; the prefetchers stop at page boundaries): RESULTS, "the weights in
huge pages". So the weights load in small pages and are collapsed into huge ones afterwards
(`MADV_COLLAPSE`, Linux 6.1+: it copies 512 small pages into one huge page), a few MB at a
time and only once the engine has been idle for a while, so no request waits on more than
one run of it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

HUGE = 2 << 20  # a transparent huge page on x86-64 (and aarch64 with 4 KB pages)
RUN = 16 * HUGE  # collapsed at a time: ~75 ms on a 2-core EPYC VM
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>


def runs(arrays: Iterable[Any]) -> list[tuple[int, int]]:
    """(address, bytes) of the whole huge pages inside each array's buffers (a NumPy array's,
    or each of this process's shards of a `jax.Array` on CPU devices), `RUN` bytes at most
    each; buffers under two huge pages are left out."""
    out: dict[int, int] = {}  # (replicas may share an array)
    buffers = [
        b
        for a in arrays
        for b in (
            [s.data for s in a.addressable_shards] if hasattr(a, "addressable_shards") else [a]
        )
    ]
    for a in buffers:
        if a.nbytes < 2 * HUGE:
            continue
        at = a.unsafe_buffer_pointer() if hasattr(a, "unsafe_buffer_pointer") else a.ctypes.data
        lo, hi = -(-at // HUGE) * HUGE, (at + a.nbytes) // HUGE * HUGE
        out |= {p: min(RUN, hi - p) for p in range(lo, hi, RUN)}
    return list(out.items())


def promote(
    arrays: Iterable[Any],
    idle: Callable[[], bool],
    quiet_s: float = 1.0,
    poll_s: float = 0.1,
) -> threading.Thread | None:
    """Collapse `arrays`' memory into huge pages on a daemon thread, a `RUN` at a time while
    `idle()` has held for `quiet_s` (checked every `poll_s`, and before each run). Returns
    the thread; None where nothing is to be done (not Linux, `JPAGED_HUGE_PAGES=0`). It stops
    at the first run the kernel refuses outright (before Linux 6.1: EINVAL) and skips one it
    has no huge page for (EAGAIN, ENOMEM)."""
    if not sys.platform.startswith("linux") or os.environ.get("JPAGED_HUGE_PAGES") == "0":
        return None
    todo = runs(arrays)
    if not todo:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def work() -> None:
        since = None  # when the engine was last seen to turn idle
        for at, size in todo:
            while True:
                now = time.monotonic()
                if not idle():
                    since = None
                elif since is None:
                    since = now
                if since is not None and now - since >= quiet_s:
                    break
                time.sleep(poll_s)
            # the loader's arrays refuse huge pages (`hostcopy.empty`): allowed first
            refused = libc.madvise(at, size, MADV_HUGEPAGE) or libc.madvise(at, size, MADV_COLLAPSE)
            if refused and ctypes.get_errno() not in (errno.EAGAIN, errno.ENOMEM):
                return

    thread = threading.Thread(target=work, name="jpaged-hugepages", daemon=True)
    thread.start()
    return thread
