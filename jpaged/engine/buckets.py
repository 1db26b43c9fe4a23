"""Token buckets: the static shapes a step compiles for, and how a call's arrays travel.

XLA compiles one program per input shape, so a step's token count is padded to a
bucket of `token_ladder`; the rest of a call's shape (sequences, page-table width,
attention work lists) follows from its bucket and the configuration (`Shape`). A
call's arrays travel packed in one int32 array (`Shape.pack` / `Shape.unpack`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jpaged.engine.sampling import SAMPLING_FIELDS
from jpaged.kernels import ragged_plan


def pow2_ladder(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` below `limit`, then `limit` itself."""
    ladder = []
    b = start
    while b < limit:
        ladder.append(b)
        b *= 2
    return [*ladder, limit]


def token_ladder(limit: int, gpu: bool = False) -> list[int]:
    """Token buckets: 1 (a lone decode; not on a `gpu`), powers of two from 4 to 32, then
    half octaves (at most a third of a step is padding: 48 decoding users padded to 64 took
    as long as 64), then `limit`.

    XLA on GPU rewrites a one-row matmul as a multiply writing every product of the weight,
    then a reduce (the weight's bytes written and read again); with more rows it is a GEMM
    that reads the weight once, so there a lone decode runs in the 4-token bucket."""
    small = {b for b in (1 if not gpu or limit == 1 else 4, *pow2_ladder(32, 4)) if b < limit}
    half_octaves = {b for p in pow2_ladder(limit) for b in (p, p * 3 // 2) if 32 < b < limit}
    return sorted(small | half_octaves | {limit})


def score_ladder(limit: int) -> list[int]:
    """Buckets of the tokens a step scores: few, since the programs that score compile
    when first needed (prompt logprobs are rare), not at warm-up."""
    return pow2_ladder(limit, 16)


def bucket(n: int, ladder: Sequence[int]) -> int:
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A compiled bucket: `tokens` flat tokens of at most `seqs` sequences, each with a
    page table `width` blocks wide in each of `groups` KV groups, attended by `impl`;
    `scored` of the tokens (padded to `score_ladder`) also get the logprob of a given next
    token (prompt logprobs), and its likeliest alternatives if `score_top` (a full search
    of the vocabulary per token)."""

    tokens: int
    seqs: int
    width: int
    impl: str
    scored: int = 0
    score_top: bool = False
    groups: int = 1  # KV-cache groups: page tables per sequence
    # positions whose logits are sampled; 0: one a sequence (`seqs`). More with speculative
    # decoding, where a sequence samples after each of its drafts too.
    samples: int = 0
    lora: bool = False  # each token carries its LoRA adapter's slot (0: none)
    # images the step encodes (a power of two): their tokens' embeddings are the vision
    # encoder's, and they attend bidirectionally; 0: a text step (its program unchanged)
    images: int = 0

    @property
    def sample_rows(self) -> int:
        return self.samples or self.seqs

    def fields(self) -> Mapping[str, tuple[int, ...]]:
        """The arrays a call of this shape packs into one int32 array, in order."""
        return _fields(self)

    def pack(self, arrays: dict[str, np.ndarray]) -> np.ndarray:  # int32 [size]
        # a fresh array each call: on CPU the device array may alias it (zero copy)
        parts = []
        for name, dims in self.fields().items():
            a = np.asarray(arrays[name])
            if a.shape != dims:
                raise ValueError(f"{name} has shape {a.shape}, the bucket needs {dims}")
            parts.append(a)
        # (flattened and cast in the one call: two NumPy calls a field saved)
        return np.concatenate(parts, axis=None, dtype=np.int32, casting="unsafe")

    def size(self) -> int:
        return sum(int(np.prod(dims)) for dims in self.fields().values())

    def unpack(self, packed: Any) -> dict[str, Any]:
        """The arrays back from `pack`'s output (NumPy or traced)."""
        out, at = {}, 0
        for name, dims in self.fields().items():
            n = int(np.prod(dims))
            out[name] = packed[at : at + n].reshape(dims)
            at += n
        return out


# A step's host work is mostly small NumPy calls and bookkeeping like this: built once a
# bucket, not once a call (a call's shape is a fresh, equal `Shape`).
@functools.cache
def _fields(shape: Shape) -> Mapping[str, tuple[int, ...]]:
    t, s = shape.tokens, shape.seqs
    tiles, single, tiled = ragged_plan.sizes(t, s, shape.width, shape.impl)
    return types.MappingProxyType(
        {
            "sampling": (len(SAMPLING_FIELDS), shape.sample_rows),
            "tokens": (t,),
            "sources": (t,),  # ring index of a decode token still on the device, or -1
            "seq_of": (t,),
            "positions": (t,),
            "block_tables": (shape.groups, s, shape.width),
            "tiles": (2, tiles),
            "token_tile": (t if shape.impl == "pallas" else 0,),
            "single": (3, single),
            "tiled": (3, tiled),
            "num_work": (2,),
            "last": (shape.sample_rows,),  # each sequence's last token (and drafts): sampled
            "ring_at": (1,),  # where the call's sampled tokens go in the ring
            "score_at": (shape.scored,),  # tokens whose logits score a given next token
            "score_ids": (shape.scored,),  # that token, for each of them
            "lora": (t if shape.lora else 0,),
            # each token's last visible key (`Ragged.limits`), and its image embedding's row
            # among the step's images' (-1: a text token)
            "limits": (t if shape.images else 0,),
            "image_at": (t if shape.images else 0,),
        }
    )
