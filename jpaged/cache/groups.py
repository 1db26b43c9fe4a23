"""KV-cache groups: which layers share a page table, and how much of the context each keeps.

Gemma 3 attends over the whole context in one layer of six and over the last
`sliding_window` tokens in the others. Giving every layer the whole context wastes
most of a long sequence's KV, so, as vLLM's hybrid KV-cache manager does, the
layers are partitioned into groups of equal size, each all full-attention or all
sliding-window: a block holds the K/V of its group's layers only, every group has a
page table per sequence, and a sliding group gives back the blocks its window has
passed. Equal sizes keep one pool of interchangeable blocks (`[group size,
num_blocks, ...]`): a block id means the same bytes whichever group holds it.

The size is the gcd of the full and sliding layer counts, so no group is padded:
Gemma 3 270M (3 global, 15 local layers) gets groups of 3, one full and five
sliding; Gemma 3 1B (4 and 22) groups of 2. Models without sliding layers keep one
group of every layer, as before groups existed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]  # each group's layers, full groups first
    windows: tuple[int | None, ...]  # each group's sliding window; None: full attention

    @classmethod
    def of(
        cls,
        num_layers: int,
        sliding_layers: Sequence[bool] = (),
        window: int | None = None,
        *,
        hybrid: bool = True,
    ) -> KVGroups:
        """Groups for a model whose layers `sliding_layers` marks slide over `window`
        tokens; one group of every layer when nothing slides or `hybrid` is off."""
        sliding = [i for i, s in enumerate(sliding_layers) if s]
        full = [i for i in range(num_layers) if i not in set(sliding)]
        if not hybrid or window is None or not sliding:
            return cls((tuple(range(num_layers)),), (None,))
        size = math.gcd(len(full), len(sliding))
        layers, windows = [], []
        for members, w in ((full, None), (sliding, window)):
            for i in range(0, len(members), size):
                layers.append(tuple(members[i : i + size]))
                windows.append(w)
        return cls(tuple(layers), tuple(windows))

    @property
    def size(self) -> int:
        """Layers per group: the layers a block holds."""
        return len(self.layers[0])

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def layer_index(self) -> tuple[np.ndarray, np.ndarray]:  # int32 [L] each
        """Each layer's group, and its place among the group's layers (its pool index)."""
        num_layers = sum(len(g) for g in self.layers)
        group, slot = np.zeros(num_layers, np.int32), np.zeros(num_layers, np.int32)
        for g, members in enumerate(self.layers):
            group[list(members)] = g
            slot[list(members)] = np.arange(len(members))
        return group, slot

    def blocks_for(self, tokens: int, block_size: int) -> int:
        """Blocks, over every group, a sequence of `tokens` tokens holds while decoding."""
        pages = -(-tokens // block_size)
        return sum(
            pages if w is None else min(pages, window_blocks(w, block_size)) for w in self.windows
        )

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence `num_blocks` blocks hold (while decoding)."""
        full = sum(w is None for w in self.windows)
        if not full:  # only windows: a sequence holds a bounded number of blocks
            fits = self.blocks_for(1 << 62, block_size) <= num_blocks
            return 1 << 62 if fits else 0
        lo, hi = 0, num_blocks * block_size  # blocks_for grows with tokens: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_for(mid, block_size) <= num_blocks else (lo, mid - 1)
        return lo


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a sliding group holds for a decoding sequence: those covering its
    last `window` positions."""
    return -(-(window - 1) // block_size) + 1


def first_visible_block(position: int, window: int | None, block_size: int) -> int:
    """The first block the token at `position` sees (transformers' window: keys p with
    position - window < p)."""
    return 0 if window is None else max(0, position - window + 1) // block_size
