"""ingest.store.EventCache: decoded generations by event id, least recently used out, bounded by tokens."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from ingest.store import EventCache
from tests.fixtures.traffic import generation


def _gen(i: int, tokens: int):
    rng = random.Random(i)
    half = tokens // 2
    return generation("t", f"s{i}", f"g{i}", list(range(half)), list(range(tokens - half)), datetime.now(UTC), rng)


def test_the_least_recently_used_go_first_and_the_token_bound_holds() -> None:
    cache = EventCache(max_tokens=100)
    events = [_gen(i, 30) for i in range(4)]
    for event in events[:3]:
        cache.put(event)
    assert cache.tokens == 90
    assert cache.get(events[0].event_id) is events[0]  # now the most recent
    cache.put(events[3])  # 120 tokens > 100: the least recently used (events[1]) goes
    assert cache.tokens == 90
    assert cache.get(events[1].event_id) is None
    assert [cache.get(e.event_id) is e for e in (events[0], events[2], events[3])] == [True, True, True]
    assert (cache.hits, cache.misses) == (4, 1)


def test_an_event_larger_than_the_cache_and_a_disabled_cache_keep_nothing() -> None:
    cache = EventCache(max_tokens=10)
    cache.put(_gen(0, 30))
    assert cache.tokens == 0 and cache.get(_gen(0, 30).event_id) is None
    off = EventCache(max_tokens=0)
    off.put(_gen(1, 4))
    assert off.tokens == 0
