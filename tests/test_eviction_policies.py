"""The eviction policies on their own: order, pins and ARC's adaptation."""

from __future__ import annotations

from kvdepot.server.core.eviction import ARCPolicy, LRUPolicy


def test_lru_evicts_least_recently_used_and_skips_pinned():
    lru = LRUPolicy(4)
    for k in "abcd":
        lru.insert(k)
    lru.touch("a")  # order: b c d a
    assert lru.victim(lambda k: k != "b") == "c"
    # b was in use (pinned) when eviction passed it: it now counts as recent.
    assert lru.victim(lambda k: True) == "d"
    assert lru.victim(lambda k: False) is None
    assert len(lru) == 2
    assert lru.victim(lambda k: True) == "a"


def test_pinned_keys_are_passed_over_once_not_at_every_eviction():
    """A load of the oldest blocks pins them for its whole copy; each eviction
    in the meantime must not walk past them again."""
    for policy in (LRUPolicy(1000), ARCPolicy(1000)):
        for k in range(1000):
            policy.insert(k)
        pinned = set(range(200))
        checks = []

        def evictable(k, checks=checks, pinned=pinned):
            checks.append(k)
            return k not in pinned

        assert policy.victim(evictable) == 200
        assert len(checks) == 201
        checks.clear()
        for expected in range(201, 300):
            assert policy.victim(evictable) == expected
        assert len(checks) == 99, type(policy).__name__


def test_arc_protects_frequent_keys_from_a_scan():
    arc = ARCPolicy(4)
    for k in "abcd":
        arc.insert(k)
    arc.touch("a")  # used twice: T2
    for k in "efghijkl":  # a scan of keys used once
        victim = arc.victim(lambda _: True, incoming=k)
        assert victim != "a"
        arc.insert(k)
    assert "a" in arc.t2


def test_arc_grows_t1_target_after_a_ghost_hit_in_b1():
    arc = ARCPolicy(4)
    for k in "abcd":
        arc.insert(k)
    arc.touch("c")
    arc.touch("d")
    assert arc.victim(lambda _: True, incoming="e") == "a"
    arc.insert("e")
    assert "a" in arc.b1 and arc.p == 0
    arc.victim(lambda _: True, incoming="a")
    arc.insert("a")  # stored again soon after its eviction: a ghost hit
    assert arc.p > 0 and "a" in arc.t2


def test_arc_falls_back_to_the_other_list_when_one_is_pinned():
    arc = ARCPolicy(3)
    for k in "abc":
        arc.insert(k)
    arc.touch("c")
    assert arc.victim(lambda k: k == "c") == "c"
