"""`turboquant.memo`: tables of things made once from objects, checked by identity, bounded."""

from __future__ import annotations

from turboquant.memo import once, same


class Source:
    """An object a table entry is made from (compared by identity, never by value)."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def test_an_entry_is_made_once_per_set_of_source_objects():
    table, made = {}, []

    def make(tag):
        made.append(tag)
        return tag

    a, b = Source(), Source()
    assert once(table, "k", (a, b), 8, make, 1) == 1
    assert once(table, "k", (a, b), 8, make, 2) == 1  # the same objects: kept
    assert once(table, "k", (a, Source()), 8, make, 3) == 3  # equal but other objects: made again
    assert once(table, "k", (a, b), 8, make, 4) == 4  # the key now holds the other entry
    assert made == [1, 3, 4]
    assert same((a, b), (a, b)) and not same((a, b), (a,)) and not same((a, b), (b, a))


def test_the_oldest_entries_go_past_the_bound_and_let_their_sources_go():
    table = {}
    sources = [Source() for _ in range(10)]
    for i, s in enumerate(sources):
        once(table, i, (s,), 4, lambda: object())
    assert list(table) == [6, 7, 8, 9]
    assert all(table[i][0][0] is sources[i] for i in table)
