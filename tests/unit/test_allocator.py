"""BlockAllocator: unit cases plus a stateful test against a ref-count model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jpaged.cache.allocator import BlockAllocator
from jpaged.cache.protocol import OutOfBlocksError


def test_ids_start_at_one_and_null_block_is_never_handed_out():
    a = BlockAllocator(4)
    assert [a.allocate(), a.allocate(), a.allocate()] == [1, 2, 3]
    assert a.num_free == 0 and not a.can_allocate(1) and a.can_allocate(0)
    with pytest.raises(OutOfBlocksError):
        a.allocate()


def test_ref_counts_and_counters():
    a = BlockAllocator(8)
    b = a.allocate(owner=7)
    a.share(b)
    assert a.ref_count(b) == 2 and a.owner(b) == 7
    assert a.free(b) is False and a.num_free == 6
    assert a.free(b) is True and a.num_free == 7 and a.owner(b) is None
    assert (a.num_allocations, a.num_frees) == (1, 1)


def test_allocate_many_is_all_or_nothing():
    a = BlockAllocator(5)
    assert a.allocate_many(2) == [1, 2]
    with pytest.raises(OutOfBlocksError):
        a.allocate_many(3)
    assert a.num_free == 2 and a.num_allocations == 2


@pytest.mark.parametrize("bad", [0, -1, 8, 100])
def test_invalid_ids_raise(bad):
    a = BlockAllocator(8)
    for op in (a.free, a.share, a.ref_count):
        with pytest.raises(ValueError, match="invalid block id"):
            op(bad)


def test_double_free_and_sharing_a_free_block_raise():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="free"):
        a.share(b)
    assert a.num_free == 3 and a.num_frees == 1


def test_bad_size_raises():
    for n in (0, 1, 2.0):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockAllocator(n)  # type: ignore[arg-type]


def test_audit_and_reclaim():
    a = BlockAllocator(8)
    kept, leaked = a.allocate_many(2, owner=1), a.allocate_many(2, owner=2)
    a.share(leaked[0])
    assert a.audit(kept) == leaked
    assert [a.owner(b) for b in leaked] == [2, 2]
    assert a.reclaim(leaked) == 2
    assert a.audit(kept) == [] and a.num_free == 5
    with pytest.raises(ValueError):
        a.reclaim(leaked)


class AllocatorMachine(RuleBasedStateMachine):
    """Random interleavings against a model: seqs are lists of blocks, one reference each."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.alloc: BlockAllocator | None = None
        self.seqs: list[list[int]] = []
        self.refs: dict[int, int] = {}  # model ref counts of allocated blocks

    @initialize(num_blocks=st.integers(2, 40))
    def init(self, num_blocks: int) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.total = num_blocks - 1

    def _hold(self, seq: list[int], block: int) -> None:
        seq.append(block)
        self.refs[block] = self.refs.get(block, 0) + 1

    def _release(self, block: int) -> None:
        assert self.alloc is not None
        returned = self.alloc.free(block)
        self.refs[block] -= 1
        assert returned == (self.refs[block] == 0)
        if not self.refs[block]:
            del self.refs[block]

    @precondition(lambda self: self.alloc is not None)
    @rule(n=st.integers(0, 8))
    def allocate(self, n: int) -> None:
        assert self.alloc is not None
        before = self.alloc.num_allocations
        fits = n <= self.total - len(self.refs)
        assert self.alloc.can_allocate(n) == fits
        if not fits:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate_many(n, owner=len(self.seqs))
            assert self.alloc.num_allocations == before
            return
        blocks = self.alloc.allocate_many(n, owner=len(self.seqs))
        assert not set(blocks) & set(self.refs), "handed out a block that is in use"
        seq: list[int] = []
        for b in blocks:
            assert self.alloc.owner(b) == len(self.seqs)
            self._hold(seq, b)
        self.seqs.append(seq)
        assert self.alloc.num_allocations == before + n

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        src = data.draw(st.sampled_from(self.seqs))
        seq: list[int] = []
        for b in src:
            self.alloc.share(b)
            self._hold(seq, b)
        self.seqs.append(seq)

    @precondition(lambda self: any(self.seqs))
    @rule(data=st.data())
    def share_one(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.share(block)
        self._hold(data.draw(st.sampled_from(self.seqs)), block)

    @precondition(lambda self: any(self.seqs))
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s]))
        self._release(seq.pop(data.draw(st.integers(0, len(seq) - 1))))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        for b in seq:
            self._release(b)

    @precondition(lambda self: self.alloc is not None)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        free = [b for b in range(1, self.total + 1) if b not in self.refs]
        if not free:
            return
        block = data.draw(st.sampled_from(free))
        frees = self.alloc.num_frees
        with pytest.raises(ValueError):
            self.alloc.free(block)
        with pytest.raises(ValueError):
            self.alloc.share(block)
        assert self.alloc.num_frees == frees

    @precondition(lambda self: self.alloc is not None)
    @rule(block=st.one_of(st.integers(-5, 0), st.integers(40, 45)))
    def invalid_id(self, block: int) -> None:
        assert self.alloc is not None
        if 0 < block <= self.total:
            return
        for op in (self.alloc.free, self.alloc.share, self.alloc.ref_count):
            with pytest.raises(ValueError, match="invalid block id"):
                op(block)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def leak_and_reclaim(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        # Drop a sequence without freeing it; blocks only it referenced are leaks.
        self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        referenced = {b for s in self.seqs for b in s}
        leaked = self.alloc.audit(b for s in self.seqs for b in s)
        assert leaked == sorted(set(self.refs) - referenced)
        assert self.alloc.reclaim(leaked) == len(leaked)
        for b in leaked:
            del self.refs[b]
        # Blocks other sequences still reference keep the dropped references (a partial leak
        # that audit reports once the last referencing sequence is gone).

    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        if a is None:
            return
        free = a._free  # white-box: the free list itself
        allocated = [b for b in range(1, a.num_blocks) if a.ref_count(b) > 0]
        assert a.num_free + len(allocated) == self.total
        assert a.num_free + a.num_used == self.total
        assert len(set(free)) == len(free), "an id is on the free list twice"
        assert not set(free) & set(allocated), "an id is both free and allocated"
        assert 0 not in free and 0 not in self.refs
        assert {b: a.ref_count(b) for b in allocated} == self.refs
        assert all(c >= 1 for c in self.refs.values())
        assert a.num_allocations - a.num_frees == len(allocated)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
