"""The suite's own harness, where a defect would hide others.

* A hand-driven peer its test left open is closed with that test (``tests/conftest.py``,
  ``raw_peers_closed``), so one failure is reported once. On 2026-12-07 one failed
  assertion skipped its test's ``raw.aclose()``: the peer's socket was collected during
  the next test (a ResourceWarning, an error there) and its agent was counted by a leak
  check two tests on, four failures for one cause.
* ``kernel_paced`` (``tests/_clock.py``) keeps the autojump clock from jumping while
  bytes the kernel is late with are all that is awaited."""

from __future__ import annotations

import socket
import threading

import trio
import trio.testing

from p2pkv.transport import local as local_mod

from ._clock import kernel_paced
from .helpers import RawPeer, close_leftover_raw_peers
from .helpers import virtual_node as node
from .test_producer_caps import connected


async def test_a_raw_peer_left_open_is_closed_by_the_net_and_its_node_sees_it_go() -> None:
    with trio.fail_after(30):
        async with node("n") as n:
            raw, s = await connected(n)
            bare = RawPeer()  # never connected: its agent alone
            assert raw.stream is not None
            sock = raw.stream.socket
            assert close_leftover_raw_peers() == 2
            assert sock.fileno() == -1
            for peer in (raw, bare):
                assert peer.peer_id not in local_mod._directory, peer.peer_id  # agent gone
            with trio.fail_after(10):
                await s.finished.wait()  # the node read the end of the stream
            assert s.close_reason == "connection closed by peer", s.close_reason
            assert close_leftover_raw_peers() == 0  # each is closed once


async def test_a_raw_peer_its_test_closed_is_left_alone() -> None:
    with trio.fail_after(30):
        async with node("n") as n:
            raw, _ = await connected(n)
            await raw.aclose()
            assert close_leftover_raw_peers() == 0


async def test_kernel_paced_moves_no_virtual_time_while_the_kernel_is_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A task waits for a byte that comes 50 ms of real time later (FAKE: a plain thread
    plays a late kernel), while another task's deadline is pending. Under ``kernel_paced``
    the clock must not jump to that deadline meanwhile; after it, the clock is as it was."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = trio.socket.from_stdlib_socket(ours)
        with trio.fail_after(1000):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 100.0)  # a deadline to jump to
                await trio.lowlevel.checkpoint()
                t0 = trio.current_time()
                late = threading.Timer(0.05, theirs.send, (b"x",))
                late.start()
                try:
                    with kernel_paced(real=30.0):  # far above the 50 ms
                        assert await reader.recv(1) == b"x"
                finally:
                    late.join()
                assert trio.current_time() == t0
                assert autojump_clock.autojump_threshold == 0
                await trio.sleep(1.0)  # and jumps at once again
                assert trio.current_time() == t0 + 1.0
