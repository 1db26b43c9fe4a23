"""The weights collapsed into huge pages while the engine idles (`models.hugepages`)."""

from __future__ import annotations

import itertools
import platform
import sys

import jax
import numpy as np
import pytest

from jpaged.models import hostcopy, hugepages

HUGE = hugepages.HUGE


def _huge_bytes(at: int, size: int) -> int:
    """Bytes of the mappings over [at, at + size) held in huge pages (`/proc/self/smaps`)."""
    held, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < at + size and at < hi
            elif inside and head == "AnonHugePages:":
                held += int(line.split()[1]) * 1024
    return held


def test_runs_are_the_whole_huge_pages_inside_each_array() -> None:
    a = hostcopy.empty((3 * HUGE + 4096,), np.uint8)  # starts on a page, not a huge one
    at = a.ctypes.data
    first = -(-at // HUGE) * HUGE
    want = (at + a.nbytes) // HUGE * HUGE - first
    got = hugepages.runs([a, a[: HUGE + 1], a])  # the small one left out, `a` once
    assert sum(n for _, n in got) == want and got[0][0] == first
    assert all(p % HUGE == 0 and n % HUGE == 0 and n <= hugepages.RUN for p, n in got)
    # a CPU device's array adopts the host memory: its shards' buffers, the same runs
    assert hugepages.runs([jax.device_put(a)]) == got


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or tuple(map(int, platform.release().split(".")[:2])) < (6, 1),
    reason="MADV_COLLAPSE is Linux 6.1's",
)
def test_memory_is_collapsed_once_idle_and_keeps_its_values() -> None:
    a = hostcopy.empty((4 * HUGE,), np.uint8)
    a[:] = np.arange(a.size, dtype=np.uint32).astype(np.uint8)
    assert _huge_bytes(a.ctypes.data, a.nbytes) == 0  # small pages, as loaded
    polls = itertools.count()
    busy_then_idle = itertools.chain([False] * 3, itertools.repeat(True))

    def idle() -> bool:
        next(polls)
        return next(busy_then_idle)

    thread = hugepages.promote([a], idle, quiet_s=0, poll_s=0)
    assert thread is not None
    thread.join(60)
    assert next(polls) >= 4  # it waited out the busy polls
    assert _huge_bytes(a.ctypes.data, a.nbytes) >= 3 * HUGE
    np.testing.assert_array_equal(a, np.arange(a.size, dtype=np.uint32).astype(np.uint8))


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JPAGED_HUGE_PAGES", "0")
    assert hugepages.promote([hostcopy.empty((4 * HUGE,), np.uint8)], lambda: True) is None
