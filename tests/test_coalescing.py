"""Coalescing (issue 9): runs of consecutive slots on both sides move as one piece.

The run arithmetic (``p2pkv.transport._runs``) is checked against a model with Hypothesis;
the in-process transport is checked to copy once per run, byte-exact, and never outside
the slots named. The NIXL side lives in ``test_nixl_transport.py``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pkv.errors import RegistrationFailed, TransportError
from p2pkv.transport import local
from p2pkv.transport._runs import contiguous_runs, run_order, split_runs
from p2pkv.transport.base import RegionLayout, TransferState
from p2pkv.transport.local import LocalTransport

from .helpers import BAD_SLOTS, held_by_a_thread, in_fork

Slots = np.ndarray[Any, np.dtype[np.int64]]


def _pairs(local: Slots, remote: Slots) -> set[tuple[int, int]]:
    return set(zip(local.tolist(), remote.tolist(), strict=True))


@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60, unique_by=lambda p: p[0]
    )
)
def test_runs_cover_exactly_the_pairs_and_are_maximal(pairs: list[tuple[int, int]]) -> None:
    local = np.array([p[0] for p in pairs], dtype=np.int64)
    remote = np.array([p[1] for p in pairs], dtype=np.int64)
    ordered_local, ordered_remote = run_order(local, remote)
    assert _pairs(ordered_local, ordered_remote) == _pairs(local, remote)
    assert (np.diff(ordered_local) > 0).all()
    starts_l, starts_r, lengths = contiguous_runs(ordered_local, ordered_remote)
    covered = {
        (int(s) + k, int(d) + k)
        for s, d, n in zip(starts_l, starts_r, lengths, strict=True)
        for k in range(int(n))
    }
    assert covered == _pairs(local, remote)
    assert int(lengths.sum()) == len(pairs)
    # Maximal: no run continues into the next one, and none could absorb any other pair.
    ends = {
        (int(s) + int(n), int(d) + int(n))
        for s, d, n in zip(starts_l, starts_r, lengths, strict=True)
    }
    assert not ends & set(zip(starts_l.tolist(), starts_r.tolist(), strict=True))


@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60, unique_by=lambda p: p[0]
    ),
    st.integers(1, 8),
)
def test_pieces_cover_the_runs_exactly_and_never_leave_one(
    pairs: list[tuple[int, int]], max_len: int
) -> None:
    local, remote = run_order(
        np.array([p[0] for p in pairs], dtype=np.int64),
        np.array([p[1] for p in pairs], dtype=np.int64),
    )
    runs = contiguous_runs(local, remote)
    pieces = split_runs(*runs, max_len)
    assert (pieces[2] >= 1).all() and (pieces[2] <= max_len).all()
    run_of = {}  # block pair -> the run holding it
    for r, (s, d, n) in enumerate(zip(*runs, strict=True)):
        for k in range(int(n)):
            run_of[(int(s) + k, int(d) + k)] = r
    covered = []
    for s, d, n in zip(*pieces, strict=True):
        blocks = [(int(s) + k, int(d) + k) for k in range(int(n))]
        assert len({run_of.get(b) for b in blocks}) == 1 and blocks[0] in run_of
        covered += blocks
    assert sorted(covered) == sorted(run_of) == sorted(pairs)
    with pytest.raises(ValueError):
        split_runs(*runs, 0)


@given(
    st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3), st.integers(0, 3)), max_size=8),
    st.integers(1, 8),
)
def test_pieces_of_long_runs_are_never_longer_than_the_piece_length(
    runs: list[tuple[int, int, int]], max_len: int
) -> None:
    """Runs drawn as runs (random pairs rarely hold one longer than a block or two): a
    run of up to twice the piece length is cut too, and so is every run of a post whose
    other runs fit in one piece."""
    local: list[int] = []
    remote: list[int] = []
    for length, gap_l, gap_r in runs:
        # Each run starts past the last one on both sides, a gap of 1+ on at least one.
        start_l = (local[-1] + 1 if local else 0) + gap_l
        start_r = (remote[-1] + 1 if remote else 0) + gap_r + (gap_l == 0)
        local += range(start_l, start_l + length)
        remote += range(start_r, start_r + length)
    pieces = split_runs(
        *contiguous_runs(np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64)),
        max_len,
    )
    assert (pieces[2] >= 1).all() and (pieces[2] <= max_len).all()
    covered = [
        (int(s) + k, int(d) + k) for s, d, n in zip(*pieces, strict=True) for k in range(int(n))
    ]
    assert covered == list(zip(local, remote, strict=True))


_NL, _NR = 24, 20  # blocks of the regions below: ours, the peer's


@st.composite
def _crafted_pairs(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Pairs drawn as stretches of runs (random pairs rarely hold one), some repeated or
    overlapping, in any order; maybe one slot out of range, past int32 or past int64."""
    stretches = draw(
        st.lists(st.tuples(st.integers(0, _NL - 1), st.integers(0, _NR - 1), st.integers(1, 5)))
    )
    pairs = [
        (s + k, d + k) for s, d, n in stretches for k in range(n) if s + k < _NL and d + k < _NR
    ]
    shuffle, spoil, ours = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    if shuffle:
        pairs = list(draw(st.permutations(pairs)))
    if pairs and spoil:
        bad = draw(st.sampled_from([-1, _NR, _NL, 2**31, 2**32 + 3, 2**62, -(2**40)]))
        i = draw(st.integers(0, len(pairs) - 1))
        pairs[i] = (bad, pairs[i][1]) if ours else (pairs[i][0], bad)
    return pairs


@given(
    _crafted_pairs(),
    st.sampled_from([16, local._SLICE_MIN_BYTES]),  # its gather path, its slice path
    st.integers(1, 6),
)
def test_any_slot_list_is_refused_or_written_into_the_slots_named_only(
    pairs: list[tuple[int, int]], block_len: int, max_len: int
) -> None:
    """Pairs as a caller may craft them (slots repeated on either side, in any order, out
    of range, past int32 or int64): refused with nothing written if any slot is out of
    range, else the in-process transport writes only into the remote slots named (either
    of its copy paths), and the runs and their pieces, as listed or ordered, cover exactly
    the pairs given, each as often as given (the NIXL post's descriptors are made of
    them)."""
    nl, nr = _NL, _NR
    ours, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
    src_array = np.random.default_rng(1).integers(1, 256, nl * block_len, dtype=np.uint8)
    dst_array = np.zeros(nr * block_len, dtype=np.uint8)
    src = LocalTransport(
        agent_name="any-src", region=src_array, layout=RegionLayout(0, nl, block_len)
    )
    dst = LocalTransport(
        agent_name="any-dst", region=dst_array, layout=RegionLayout(0, nr, block_len)
    )
    try:
        peer = src.add_remote_peer("any-dst", dst.metadata(), dst.layout)
        if not all(0 <= s < nl for s in ours) or not all(0 <= s < nr for s in theirs):
            with pytest.raises(TransportError):
                src.post_write(peer, ours, theirs)
            assert not dst_array.any()
            return
        src.release(src.post_write(peer, ours, theirs))
    finally:
        src.close()
        dst.close()
    named = Counter(theirs)
    got, want = dst_array.reshape(nr, block_len), src_array.reshape(nl, block_len)
    assert not got[[r for r in range(nr) if r not in named]].any()
    for s, d in pairs:
        if named[d] == 1:
            assert (got[d] == want[s]).all()
    as_listed = (np.array(ours, dtype=np.int64), np.array(theirs, dtype=np.int64))
    for ordered in (as_listed, run_order(*as_listed)):
        pieces = split_runs(*contiguous_runs(*ordered), max_len)
        covered = Counter(
            (int(s) + k, int(d) + k) for s, d, n in zip(*pieces, strict=True) for k in range(int(n))
        )
        assert covered == Counter(pairs)


class CountingArray(np.ndarray):
    """A region that counts writes into it (views share the counter)."""

    writes: list[int]

    def __array_finalize__(self, obj: object) -> None:
        self.writes = getattr(obj, "writes", [0])

    def __setitem__(self, index: Any, value: Any) -> None:
        self.writes[0] += 1
        super().__setitem__(index, value)


BLOCK = 4096


@pytest.fixture
def pair() -> Iterator[tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray]]:
    src_array = np.random.default_rng(1).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    dst_array = np.zeros(48 * BLOCK, dtype=np.uint8).view(CountingArray)
    dst_array.writes = [0]
    src = LocalTransport(agent_name="co-src", region=src_array, layout=RegionLayout(0, 64, BLOCK))
    dst = LocalTransport(agent_name="co-dst", region=dst_array, layout=RegionLayout(0, 48, BLOCK))
    try:
        yield src, src_array, dst, dst_array
    finally:
        src.close()
        dst.close()


def test_local_transport_copies_once_per_run_even_listed_out_of_order(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
) -> None:
    src, src_array, dst, dst_array = pair
    peer = src.add_remote_peer("co-dst", dst.metadata(), dst.layout)
    # Three runs (40..43 -> 0..3, 8..13 -> 20..25, 63 -> 47), pairs shuffled.
    local = [*range(40, 44), *range(8, 14), 63]
    remote = [*range(0, 4), *range(20, 26), 47]
    order = np.random.default_rng(2).permutation(len(local)).tolist()
    before = dst_array.writes[0]
    handle = src.post_write(peer, [local[i] for i in order], [remote[i] for i in order])
    assert src.poll(handle) is TransferState.DONE
    src.release(handle)
    assert dst_array.writes[0] - before == 3
    got = np.asarray(dst_array).reshape(48, BLOCK)
    want = src_array.reshape(64, BLOCK)
    assert (got[remote] == want[local]).all()
    untouched = np.setdiff1d(np.arange(48), remote)
    assert not got[untouched].any()


def test_local_transport_scattered_small_blocks_stay_exact(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
) -> None:
    _src, src_array, _dst, dst_array = pair
    small = RegionLayout(0, 64 * BLOCK // 16, 16)
    a = LocalTransport(agent_name="co-a", region=src_array, layout=small)
    b = LocalTransport(
        agent_name="co-b",
        region=np.asarray(dst_array),
        layout=RegionLayout(0, 48 * BLOCK // 16, 16),
    )
    try:
        peer = a.add_remote_peer("co-b", b.metadata(), b.layout)
        rng = np.random.default_rng(3)
        local = rng.permutation(small.num_blocks)[:500]
        remote = rng.permutation(b.layout.num_blocks)[:500]
        handle = a.post_write(peer, local.tolist(), remote.tolist())
        a.release(handle)
        got = np.asarray(dst_array).reshape(-1, 16)
        assert (got[remote] == src_array.reshape(-1, 16)[local]).all()
        assert not got[np.setdiff1d(np.arange(b.layout.num_blocks), remote)].any()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("local", "remote"),
    [
        ([60, 61, 62, 63], [45, 46, 47, 48]),  # a run that would end past the peer's region
        ([62, 63, 64], [0, 1, 2]),  # ... past ours
        ([-1, 0, 1], [3, 4, 5]),
        ([0, 1, 2], [-1, 0, 1]),
    ],
)
def test_local_transport_refuses_a_run_leaving_the_region_and_writes_nothing(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
    local: list[int],
    remote: list[int],
) -> None:
    src, _src_array, dst, dst_array = pair
    peer = src.add_remote_peer("co-dst", dst.metadata(), dst.layout)
    with pytest.raises(TransportError):
        src.post_write(peer, local, remote)
    assert not np.asarray(dst_array).any()
    assert src.statistics().live_handles == 0


@pytest.mark.parametrize("how", ["removed", "re-added", "departed", "closed"])
def test_the_local_transport_never_writes_through_a_dropped_registration(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray], how: str
) -> None:
    """As NIXL's (test_nixl_transport.py): a registration removed, replaced by a re-add,
    released as departed, or of a closed transport is refused, and nothing lands. The
    engine's in-process tests rely on it to catch a write through a stale registration."""
    src, _src_array, dst, dst_array = pair
    peer = src.add_remote_peer("co-dst", dst.metadata(), dst.layout)
    if how == "removed":
        src.remove_remote_peer(peer)
    elif how == "re-added":
        assert src.add_remote_peer("co-dst", dst.metadata(), dst.layout) is not peer
    elif how == "departed":
        assert src.release_departed_peers(["co-src"]) == ["co-dst"]
    else:
        src.close()
        with pytest.raises(TransportError, match="closed"):  # nothing new to write through
            src.add_remote_peer("co-dst", dst.metadata(), dst.layout)
    assert peer.released
    with pytest.raises(TransportError):
        src.post_write(peer, [0, 1], [2, 3])
    assert not np.asarray(dst_array).any() and dst_array.writes == [0]


def test_the_local_transport_refuses_slot_lists_of_different_lengths_and_releases_as_nixl(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
) -> None:
    """Two local slots for one remote one: refused, nothing lands (a run of the pairs
    would otherwise write remote slot 6, which no pair names). A released handle polls
    ERR, as NIXL's does."""
    src, _src_array, dst, dst_array = pair
    peer = src.add_remote_peer("co-dst", dst.metadata(), dst.layout)
    with pytest.raises(TransportError, match="differ in length"):
        src.post_write(peer, [0, 1], [5])
    assert not np.asarray(dst_array).any()
    handle = src.post_write(peer, [0], [5])
    assert src.poll(handle) is TransferState.DONE
    assert src.statistics().live_handles == 1  # posted, not yet released
    src.release(handle)
    assert src.poll(handle) is TransferState.ERR
    assert src.statistics().live_handles == 0


def test_the_local_transport_refuses_a_peer_region_it_cannot_write_into_as_laid_out(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
) -> None:
    """Metadata of another process, a layout with another block length, or one with more
    blocks than the peer's region holds: each refused at registration (registered, the
    writes would land at offsets the peer never laid out, or past its region's end)."""
    src, src_array, dst, dst_array = pair
    metadata = dst.metadata()
    kind, pid, token = metadata.decode().split(":")
    for claimed, layout, match in (
        (f"{kind}:{int(pid) + 1}:{token}".encode(), dst.layout, "not in this process"),
        (metadata, RegionLayout(0, 24, 2 * BLOCK), "layout does not match"),  # same bytes
        (metadata, RegionLayout(0, 49, BLOCK), "layout does not match"),  # one block more
    ):
        with pytest.raises(RegistrationFailed, match=match):
            src.add_remote_peer("co-dst", claimed, layout)
    assert src.statistics().remote_peers == 0
    peer = src.add_remote_peer("co-dst", metadata, dst.layout)
    handle = src.post_write(peer, [63], [47])
    src.release(handle)
    assert (np.asarray(dst_array)[47 * BLOCK :] == src_array[63 * BLOCK :]).all()


def test_another_region_under_a_live_agent_name_gets_metadata_of_its_own(
    pair: tuple[LocalTransport, np.ndarray, LocalTransport, CountingArray],
) -> None:
    """A transport over another region (of the same size) under a name still in use is a
    new node: peers' metadata of the old region is refused from then on, writes through
    the new metadata land in the new region, never in the old one, and the old node's
    close leaves the new one's metadata good."""
    src, src_array, dst, dst_array = pair
    old = dst.metadata()
    region = np.zeros(48 * BLOCK, dtype=np.uint8)
    new = LocalTransport(agent_name="co-dst", region=region, layout=dst.layout)
    try:
        assert new.metadata() != old
        with pytest.raises(RegistrationFailed, match="no such live region"):
            src.add_remote_peer("co-dst", old, dst.layout)
        peer = src.add_remote_peer("co-dst", new.metadata(), new.layout)
        src.release(src.post_write(peer, [0], [0]))
        assert (region[:BLOCK] == src_array[:BLOCK]).all()
        assert not np.asarray(dst_array).any()
        dst.close()  # the old node goes: the new one's metadata stays good
        src.add_remote_peer("co-dst", new.metadata(), new.layout)
    finally:
        new.close()


@pytest.mark.parametrize(("local", "remote", "match"), BAD_SLOTS)
def test_the_local_transport_refuses_what_nixl_refuses_and_writes_nothing(
    local: Any, remote: Any, match: str
) -> None:
    """The in-process transport converted slot lists with ``np.asarray(..., int64)``: a
    float array was truncated to slots and a 2-D one flattened (2026-12-05). It now
    checks them as NIXL's does, before any byte moves."""
    src_array = np.arange(32 * BLOCK, dtype=np.uint64).astype(np.uint8)
    dst_array = np.zeros(32 * BLOCK, dtype=np.uint8)
    layout = RegionLayout(0, 32, BLOCK)
    src = LocalTransport(agent_name="bad-src", region=src_array, layout=layout)
    dst = LocalTransport(agent_name="bad-dst", region=dst_array, layout=layout)
    try:
        peer = src.add_remote_peer("bad-dst", dst.metadata(), dst.layout)
        with pytest.raises(TransportError, match=match) as info:
            src.post_write(peer, local, remote)
        assert (info.value.op, info.value.peer) == ("post_write", "bad-dst")
        assert not dst_array.any()
        handle = src.post_write(peer, [3], [5])  # and it still writes
        assert src.poll(handle) is TransferState.DONE
        src.release(handle)
        assert (dst_array.reshape(32, BLOCK)[5] == src_array.reshape(32, BLOCK)[3]).all()
    finally:
        src.close()
        dst.close()


def test_a_run_longer_than_the_piece_length_ends_in_a_short_piece() -> None:
    # One run of 5 blocks (local 10..14 -> remote 30..34) in pieces of 2: the last piece
    # is 1 block; a full-length one would write remote slot 35, which no pair names.
    local = np.arange(10, 15, dtype=np.int64)
    remote = np.arange(30, 35, dtype=np.int64)
    starts_l, starts_r, lengths = split_runs(*contiguous_runs(local, remote), 2)
    assert starts_l.tolist() == [10, 12, 14]
    assert starts_r.tolist() == [30, 32, 34]
    assert lengths.tolist() == [2, 2, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_a_transport_whoever_held_the_region_directorys_lock() -> None:
    """Every in-process transport's start and close take one module lock. A fork copies
    it held if another thread of the parent was inside one then, and no thread of the
    child ever lets it go: the child's first node hung for ever making its transport. The
    child's fork hook takes a new lock and forgets the parent's regions (their metadata
    names the parent's pid)."""
    src_array = np.zeros(4 * BLOCK, dtype=np.uint8)
    parent = LocalTransport(agent_name="parent", region=src_array, layout=RegionLayout(0, 4, BLOCK))

    def child() -> str:
        region = np.zeros(4 * BLOCK, dtype=np.uint8)
        made = LocalTransport(agent_name="child", region=region, layout=RegionLayout(0, 4, BLOCK))
        regions = made.statistics().registered_regions
        made.close()
        return f"made, {regions} region"

    try:
        with held_by_a_thread(local._directory_lock):
            said = in_fork(child)
    finally:
        parent.close()
    assert said == "made, 1 region", "the child hung on the lock its parent's thread held"
