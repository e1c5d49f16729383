"""What a producer round remembers of its hits (``HeldRound``): the pinned source slot of
every key a fetch on the round names, whatever order or subset the fetch asks for."""

from __future__ import annotations

from p2pkv.session.producer import HeldRound


def held(pairs: list[tuple[bytes, int]]) -> HeldRound:
    h = HeldRound()
    for key, slot in pairs:
        h.add(key, slot)
    return h


def test_a_fetch_of_exactly_the_hits_gets_their_slots_as_a_copy() -> None:
    h = held([(b"a", 7), (b"b", 3), (b"c", 9)])
    got = h.sources([b"a", b"b", b"c"])
    assert got == [7, 3, 9]
    got[0] = 99  # the caller's list, not the round's
    assert h.sources([b"a", b"b", b"c"]) == [7, 3, 9]


def test_a_subset_a_reordering_and_a_key_the_round_never_held() -> None:
    h = held([(b"a", 7), (b"b", 3), (b"c", 9)])
    assert h.sources([b"c", b"a"]) == [9, 7]
    assert h.sources([b"b", b"x", b"a"]) == [3, None, 7]
    assert h.sources([]) == []


def test_a_key_looked_up_twice_maps_to_its_one_slot() -> None:
    h = held([(b"a", 7), (b"a", 7), (b"b", 3)])
    assert h.sources([b"a", b"b"]) == [7, 3]
    assert h.sources([b"a", b"a", b"b"]) == [7, 7, 3]


def test_a_forgotten_round_holds_no_source_any_more() -> None:
    h = held([(b"a", 7), (b"b", 3)])
    assert h.sources([b"b"]) == [3]  # builds the map
    h.forget()
    assert h.sources([b"a", b"b"]) == [None, None]
    assert h.keys == [] and h.slots == []


def test_a_fetch_of_the_rounds_hits_gets_every_source_in_the_lookups_order() -> None:
    h = held([(b"a", 7), (b"b", 3), (b"c", 9)])
    got = h.hit_sources(3)
    assert got == [7, 3, 9]
    got[0] = 99  # the caller's list, not the round's
    assert h.slots == [7, 3, 9]


def test_a_fetch_of_the_hits_of_a_round_that_holds_them_no_more_finds_none() -> None:
    h = held([(b"a", 7), (b"b", 3)])
    h.forget()  # a write did not settle
    assert h.hit_sources(2) == [None, None]
    assert HeldRound().hit_sources(2) == [None, None]  # its pins were released
    assert held([(b"a", 7)]).hit_sources(2) == [None, None]  # never more than it holds
