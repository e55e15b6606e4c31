"""The eviction policies on their own: order, pins and ARC's adaptation."""

from __future__ import annotations

from kvdepot.server.eviction import ARCPolicy, LRUPolicy


def test_lru_evicts_least_recently_used_and_skips_pinned():
    lru = LRUPolicy(4)
    for k in "abcd":
        lru.insert(k)
    lru.touch("a")
    assert lru.victim(lambda k: k != "b") == "c"
    assert lru.victim(lambda k: True) == "b"
    assert lru.victim(lambda k: False) is None
    assert len(lru) == 2


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
