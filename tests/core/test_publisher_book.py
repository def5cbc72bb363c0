"""The publisher book forgets the publisher heard from longest ago, as it always did, but without looking at every
other one for each new id: 100,000 new ids at 10,000 a second held a router's loop 40 % of the time (issue 36)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.core.events.publishers import Order, Publisher, PublisherBook


class ReferenceBook:
    """The book as it was: on a new id past the limit, the publisher with the oldest `last_seen` is found by a scan."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.publishers: dict[int, Publisher] = {}

    def observe(self, publisher_id: int, sequence: int, now: float) -> tuple[Order, Publisher]:
        pub = self.publishers.get(publisher_id)
        if pub is None:
            if len(self.publishers) >= self.limit:
                oldest = min(self.publishers.values(), key=lambda p: p.last_seen)
                del self.publishers[oldest.publisher_id]
            pub = self.publishers[publisher_id] = Publisher(publisher_id, "kv-events", "backend", "generate", now, now)
        pub.last_seen = now
        return pub.sequence.observe(sequence), pub


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 6),
       messages=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 8), st.integers(1, 3)), max_size=200))
def test_the_book_forgets_and_judges_as_the_reference_does(limit: int, messages: list[tuple[int, int, int]]) -> None:
    """Any messages from any publishers at a monotonic clock's times: the same orders, the same publishers kept,
    each with the same counts; and every publisher forgotten is counted."""
    book, reference = PublisherBook(limit), ReferenceBook(limit)
    now, forgotten = 0.0, 0
    for publisher_id, sequence, step in messages:
        now += step
        new = publisher_id not in reference.publishers
        forgotten += new and len(reference.publishers) >= limit
        order, pub = book.observe(publisher_id, sequence, now, "kv-events", "backend", "generate")
        expected, ref = reference.observe(publisher_id, sequence, now)
        assert order is expected and pub.sequence == ref.sequence
        assert sorted(book.publishers) == sorted(reference.publishers)
    assert book.evicted == forgotten
    assert {i: p.sequence for i, p in book.publishers.items()} == {i: p.sequence for i, p in
                                                                    reference.publishers.items()}


def test_of_publishers_heard_at_the_same_instant_the_one_heard_first_goes_first() -> None:
    book = PublisherBook(2)
    for publisher_id in (1, 2, 1, 3):  # 2 was heard before 1's last message: it goes
        book.observe(publisher_id, 0, 5.0, "kv-events", "backend", "generate")
    assert list(book.publishers) == [1, 3] and book.last_evicted is not None and book.last_evicted.publisher_id == 2


class Visits(OrderedDict[int, Any]):
    """The book's map, counting the entries anything walks over."""

    visited = 0

    def values(self) -> Any:
        for value in super().values():
            self.visited += 1
            yield value

    def items(self) -> Any:
        for item in super().items():
            self.visited += 1
            yield item

    def __iter__(self) -> Any:
        for key in super().__iter__():
            self.visited += 1
            yield key


def test_a_new_id_in_a_full_book_walks_over_no_other_publisher() -> None:
    book = PublisherBook()
    book.publishers = Visits()
    for publisher_id in range(book.limit):
        book.observe(publisher_id, 0, float(publisher_id), "kv-events", "backend", "generate")
    for publisher_id in range(book.limit, book.limit + 1000):  # each forgets the oldest
        book.observe(publisher_id, 0, float(publisher_id), "kv-events", "backend", "generate")
    assert book.publishers.visited == 0  # the scan it replaces walked 4,096 per new id: 4,096,000 here
    assert len(book.publishers) == book.limit and book.evicted == 1000 and min(book.publishers) == 1000
