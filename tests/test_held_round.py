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
