"""The data-parallel request router (ferry/server/router.py): its policies' promises, dead
replicas, exclusions and config validation."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.server.router import NoReplicaAlive, Router, RouterConfig

BS = 4  # block size of these tests: a prompt of 4k tokens is k full blocks


def prompt(group: int, n_blocks: int = 3, suffix: int = 0) -> list[int]:
    """``n_blocks`` blocks of a prefix that names ``group``, then ``suffix`` tokens of their own."""
    return [group * 1000 + i for i in range(n_blocks * BS)] + [10**6 + group * 1000 + suffix] * (1 if suffix else 0)


def in_flight(router: Router) -> list[int]:
    return [v.num_requests for v in router.replicas]


# An operation on a router: route a prompt of one of a few groups (a new suffix each time; a group's
# prefix is 1-3 blocks), finish a request on a replica, report a KV usage, or kill a replica (the
# last one too when the flag is set).
ops = st.lists(st.one_of(
    st.tuples(st.just("route"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("finished"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("report"), st.integers(0, 7), st.integers(0, 100)),
    st.tuples(st.just("dead"), st.integers(0, 7), st.integers(0, 1)),
), max_size=60)


def replay(router: Router, steps, check) -> None:
    """Apply ``steps``; ``check(before, choice, token_ids)`` after every successful route, with
    the in-flight counts as they were before it."""
    n = len(router.replicas)
    for i, (op, a, b) in enumerate(steps):
        a %= n
        if op == "route":
            before, tokens = in_flight(router), prompt(a, 1 + a % 3, suffix=i + 1)
            if not router.alive():
                with pytest.raises(NoReplicaAlive):
                    router.route(tokens)
                continue
            check(before, router.route(tokens), tokens)
        elif op == "finished":
            router.finished(a)
        elif op == "report":
            router.report(a, b / 100)
        elif len(router.alive()) > 1 or b:  # the last one only sometimes, so routes keep happening
            router.mark_dead(a)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.sets(st.integers(0, 7)), st.integers(1, 5))
def test_round_robin_cycles_evenly_over_live_replicas(n, dead, rounds):
    router = Router(n, RouterConfig(policy="round_robin"))
    for d in dead:
        if d < n and len(router.alive()) > 1:
            router.mark_dead(d)
    alive = router.alive()
    picks = [router.route(prompt(0, 1)) for _ in range(rounds * len(alive))]
    assert all(picks.count(r) == rounds for r in alive)
    # In a fixed cyclic order: every window of len(alive) picks is a permutation of the live ones.
    assert all(sorted(picks[i:i + len(alive)]) == alive for i in range(len(picks) - len(alive) + 1))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), ops)
def test_least_loaded_picks_a_replica_with_the_fewest_in_flight(n, steps):
    router = Router(n, RouterConfig(policy="least_loaded"))

    def check(before, choice, _tokens):
        assert before[choice] == min(before[r] for r in router.alive())

    replay(router, steps, check)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), ops, st.sampled_from(["round_robin", "least_loaded", "prefix_aware"]))
def test_dead_replicas_never_get_traffic(n, steps, policy):
    router = Router(n, RouterConfig(policy=policy, block_size=BS))
    replay(router, steps, lambda _before, choice, _tokens: assert_alive(router, choice))


def assert_alive(router: Router, choice: int) -> None:
    assert router.replicas[choice].alive


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 8), ops)
def test_prefix_aware_returns_to_the_prefix_holder_unless_it_is_overloaded(n, steps):
    cfg = RouterConfig(policy="prefix_aware", block_size=BS, balance_abs=2, balance_rel=1.5)
    router = Router(n, cfg)
    holders: dict[int, set[int]] = {}  # group -> the live replicas its prefix was sent to

    def check(before, choice, tokens):
        group = tokens[0] // 1000
        live = [r for r in holders.get(group, set()) if router.replicas[r].alive]
        least = min(before[r] for r in router.alive())
        usable = [r for r in live if not before[r] > cfg.balance_abs + cfg.balance_rel * least]
        if usable:  # a holder, never a stranger, while one is not overloaded: the least loaded of them
            assert choice in usable and before[choice] == min(before[r] for r in usable)
        else:
            assert before[choice] == least  # no holder, or all overloaded: least-loaded
        holders.setdefault(group, set()).add(choice)

    replay(router, steps, check)


def test_prefix_aware_sticks_then_spills_when_overloaded():
    router = Router(4, RouterConfig(policy="prefix_aware", block_size=BS, balance_abs=2, balance_rel=1.0))
    first = router.route(prompt(7, suffix=1))
    # The holder keeps its group while its load stays within 2 + 1.0 x the least load (0)...
    assert [router.route(prompt(7, suffix=i)) for i in range(2, 4)] == [first, first]
    assert in_flight(router)[first] == 3
    # ... and past that the next one goes to the least loaded, which then holds the prefix too.
    spill = router.route(prompt(7, suffix=9))
    assert spill != first and in_flight(router)[spill] == 1
    router.finished(first), router.finished(first), router.finished(first)  # the holder drains
    assert router.route(prompt(7, suffix=10)) == first  # both hold it: the less loaded of the two
    assert router.replicas[first].num_prefix_hits >= 3


@pytest.mark.parametrize("min_blocks,expect", [(1, 0), (2, 1)])
def test_prefix_aware_needs_min_prefix_blocks(min_blocks, expect):
    router = Router(2, RouterConfig(policy="prefix_aware", block_size=BS, min_prefix_blocks=min_blocks))
    assert [router.route(prompt(g, n_blocks=1)) for g in (1, 8, 9)] == [0, 1, 0]  # loads 2 and 1
    # One shared block: enough to follow the prefix to the busier replica only with min_prefix_blocks 1.
    assert router.route(prompt(1, n_blocks=1, suffix=3)) == expect


def test_prefix_aware_remembers_full_blocks_only():
    router = Router(2, RouterConfig(policy="prefix_aware", block_size=BS))
    router.route([1, 2, 3])  # under one block: nothing to remember
    assert all(not v.blocks for v in router.replicas)
    router.route(prompt(1, n_blocks=2, suffix=5))
    assert sum(len(v.blocks) for v in router.replicas) == 2


def test_prefix_memory_forgets_a_chains_tail_before_its_root():
    # Room for 4 block hashes; a 3-block chain then a 2-block chain on replica 0 overflows by 1.
    router = Router(2, RouterConfig(policy="prefix_aware", block_size=1, cached_blocks_per_replica=4))
    assert router.route([1, 2, 3]) == 0
    router.finished(0)
    assert router.route([7, 8]) == 0  # no prefix anywhere, equal loads: replica 0
    # Replica 0 is now busier than 1, but still holds the root of [1, 2, 3]: the request follows it.
    assert router.route([1, 2, 5]) == 0


def test_exclude_and_no_replica_alive():
    router = Router(3, RouterConfig(policy="round_robin"))
    for _ in range(6):
        assert router.route([1], exclude=frozenset({1})) != 1
    with pytest.raises(NoReplicaAlive, match="no other replica"):
        router.route([1], exclude=frozenset({0, 1, 2}))
    for policy in ("least_loaded", "prefix_aware"):
        r = Router(3, RouterConfig(policy=policy, block_size=1))
        first = r.route([1, 2, 3])
        assert r.route([1, 2, 3], exclude=frozenset({first})) != first  # a retry goes elsewhere
        for i in range(3):
            r.mark_dead(i)
        with pytest.raises(NoReplicaAlive, match="no replica is alive"):
            r.route([1, 2, 3])


def test_finished_and_report_feed_least_loaded():
    router = Router(3, RouterConfig(policy="least_loaded"))
    assert [router.route([1]) for _ in range(3)] == [0, 1, 2]
    router.finished(1)
    assert router.route([1]) == 1
    router.finished(0), router.finished(2)
    router.report(0, 0.9)  # a tie on counts goes to the lower KV usage
    assert router.route([1]) == 2
    router.finished(0), router.finished(0)  # never below zero
    assert in_flight(router)[0] == 0


@pytest.mark.parametrize("field,value", [
    ("policy", "random"), ("block_size", 0), ("block_size", True), ("block_size", 2.5),
    ("cached_blocks_per_replica", 0), ("min_prefix_blocks", -1), ("balance_abs", -1), ("balance_abs", "8"),
    ("balance_rel", 0.5), ("balance_rel", math.nan), ("balance_rel", math.inf), ("balance_rel", False),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_needs_a_replica():
    with pytest.raises(ValueError, match="at least one replica"):
        Router(0)
