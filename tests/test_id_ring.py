"""The CUDA transport's ring of job entries (block ids, fence readbacks): no two
jobs in flight ever share an entry, and a ring with room never refuses.
Bookkeeping only, so it runs without a GPU."""

from __future__ import annotations

import collections
import random

from kvdepot.server.transports.cuda_streams import Spans


def test_jobs_in_flight_never_share_an_entry_and_room_is_found_when_there_is_some():
    rng = random.Random(27)
    for _ in range(300):
        size = rng.randint(4, 64)
        spans = Spans(size)
        live: collections.deque = collections.deque()
        used: set[int] = set()
        for _ in range(500):
            if live and rng.random() < 0.45:
                # Mostly in order, as a stream's jobs end; now and then one out of order.
                span = live.popleft() if rng.random() < 0.9 else live.pop()
                spans.give_back(span)
                used.difference_update(range(*span))
                continue
            count = rng.randint(1, 12)
            span = spans.take(count)
            if span is None:
                assert live or count > size, "an empty ring refused a job that fits"
                continue
            assert span[1] - span[0] == count and 0 <= span[0] and span[1] <= size
            assert not used.intersection(range(*span)), f"{span} overlaps entries in use"
            used.update(range(*span))
            live.append(span)


def test_an_empty_ring_starts_again_at_its_first_entry():
    spans = Spans(8)
    first = spans.take(6)
    spans.give_back(first)
    assert spans.take(6) == (0, 6)
    assert spans.take(3) is None  # 2 free at the end, and the start is in use
    assert len(spans) == 1
