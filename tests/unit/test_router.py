"""The data-parallel router's rule: a prefix match wins unless its replica is more than
`slack` tokens busier than the least loaded one."""

from __future__ import annotations

from jpaged.engine.router import Router

A = list(range(100, 117))  # four full blocks of 4 (the last token never counts)
B = list(range(200, 217))


def test_least_loaded_then_prefix_then_overruled_by_load():
    r = Router(3, block_size=4, slack=10)
    assert r.choose(A, [5, 0, 0]) == 1  # no match: least loaded, lowest index on ties
    assert r.choose(B, [5, 9, 1]) == 2
    assert r.choose([*A[:8], 1, 2, 3, 4, 5], [0, 10, 0]) == 1  # two shared blocks: A's replica
    assert r.choose(A, [0, 11, 0]) == 0  # its replica 11 tokens busier: least loaded wins
    assert r.choose(A, [3, 3, 3]) == 0  # the match now points where A went last
    assert r.choose(A[:4], [0, 0, 0]) == 0  # no full block but the last token's: no match
    assert r.counters == {
        "router_prefix": 2,
        "router_least_loaded": 4,
        "router_prefix_overruled": 1,
    }
    assert r.routed == [3, 2, 1]


def test_memory_forgets_the_oldest_prefixes():
    r = Router(2, block_size=4, slack=10, memory=4)
    assert r.choose(A, [1, 0]) == 1  # A's 4 keys -> replica 1
    assert r.choose(A, [0, 1]) == 1  # remembered
    assert r.choose(B, [0, 1]) == 0  # B's 4 keys -> replica 0, A's forgotten
    assert r.choose(A, [0, 1]) == 0  # least loaded
    assert r.counters["router_prefix"] == 1


def test_a_replica_without_queue_room_is_never_chosen():
    r = Router(3, block_size=4, slack=10)
    assert r.choose(A, [0, 0, 0]) == 0
    assert r.choose(A, [0, 0, 0], room=[0, 2, 2]) == 1  # A's replica is full
    assert r.choose(B, [0, 0, 5], room=[0, 0, 3]) == 2  # the only one with room
    assert r.choose(B, [0, 0, 0], room=[0, 0, 0]) == 2  # none has room: as if all had
    assert r.counters["router_prefix_overruled"] == 1
