"""`pages_of(cache, seq_id, group=0)`: the blocks a sequence's stored tokens are in, in order
(in one KV group's table)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jpaged.cache.protocol import CacheProtocol


def _pages_of(cache: CacheProtocol, seq_id: int, group: int = 0) -> list[int]:
    # Read through `page_tables`, what the runner reads, so a test sees a sequence as a
    # step does: the pages its length covers, not blocks reserved beyond them.
    width = -(-cache.get_seq_len(seq_id) // cache.block_size)
    tables, _ = cache.page_tables([seq_id], width)
    return [int(b) for b in tables[group, 0]]


@pytest.fixture(scope="session")
def pages_of() -> Callable[..., list[int]]:
    return _pages_of
