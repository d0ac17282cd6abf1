"""Ingest catching up on a backlog: the feedback topic runs ahead of the generations topic.

A worker reading a backlog in small batches reads most sessions' outcomes long before their later
turns (the feedback topic holds fewer records). Closing on the outcome at once would put a
truncated revision 0 on the bus, scored with the whole session's outcome, and a complete revision
1 later. The worker waits until the generations partition's watermark reaches the outcome (or
nothing is left to read there): one revision per session, with every turn.

On the local log, whose reading pattern (a partition at a time, in rotation) makes the feedback
topic run ahead every time; ``Consumer.caught_up`` itself is tested on both buses in test_bus.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flywheel.bus import make_bus
from flywheel.settings import Settings
from ingest.worker import Ingestor, consumer_group
from tests.fixtures.traffic import all_events, check_pipeline, make_traffic, produce, settled, wait_for
from tests.integration.test_ingest_order import Harness, settings_for

pytestmark = pytest.mark.integration

SESSIONS = 60
BATCH = 20  # records per poll: small, so the two topics are read at very different speeds


def catch_up(h: Harness, traffic: list) -> None:
    """``ingest.worker.run``'s loop over a backlog, ``BATCH`` records per poll, until all is closed."""
    bus = make_bus(h.settings)
    consumer = bus.consumer(consumer_group(h.settings), [h.settings.topic("generations"), h.settings.topic("feedback")])
    ingestor = h.ingestor

    def one_pass() -> bool:
        ingestor.emit_pending()
        records = consumer.poll(timeout_s=0.2, max_records=BATCH)
        if records:
            ingestor.process(records, consumer)
            consumer.commit(ingestor.committable(records, consumer))
        ingestor.close_deferred()
        return settled(h.engine, traffic)

    try:
        wait_for("every session closed", one_pass, timeout_s=90, every_s=0)
    finally:
        consumer.close()
        bus.close()


@pytest.fixture
def backlog(local_bus_settings: Settings, migrated_db_url: str) -> Iterator[tuple[Harness, list]]:
    h = Harness(settings_for(local_bus_settings, migrated_db_url, inactivity_timeout_s=600))
    traffic = make_traffic(SESSIONS, seed=11, turns=(3, 4), outcome_share=1.0)
    produce(h.settings, sorted(all_events(traffic), key=lambda e: e.ts))  # as served: in time order
    yield h, traffic
    h.close()


def test_outcomes_read_ahead_of_their_turns_wait_for_them(backlog: tuple[Harness, list]) -> None:
    h, traffic = backlog
    catch_up(h, traffic)
    checked = check_pipeline(h.settings, traffic)
    assert checked.revisions == {"outcome": SESSIONS} and checked.max_revision == 0
    assert h.ingestor.counters["outcomes_deferred"] > 0, "the backlog never put an outcome ahead of its turns"
    assert not h.ingestor.deferred


def test_without_waiting_the_same_backlog_emits_truncated_revisions(
    backlog: tuple[Harness, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario above is the one that breaks a worker closing on every outcome at once."""
    monkeypatch.setattr(Ingestor, "_turns_all_read", lambda self, key, outcome_at: True)
    h, traffic = backlog
    catch_up(h, traffic)
    checked = check_pipeline(h.settings, traffic)  # the newest revisions are still complete
    assert checked.max_revision > 0 and checked.revisions["outcome"] > SESSIONS
