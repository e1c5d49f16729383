"""Shared test set-up: quiet, loopback-only NIXL/UCX defaults unless the user set them."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio.testing
from hypothesis import settings

from p2pkv.transport import _nixl_agent

from ._clock import loopback_autojump_clock
from .helpers import blocking_nodes, close_leftover_raw_peers
from .node_proc import Children

if TYPE_CHECKING:
    from p2pkv.facade import BlockingNode

for _name, _value in (
    ("UCX_MEM_MMAP_HOOK_MODE", "none"),
    ("UCX_NET_DEVICES", "lo"),
    ("NIXL_LOG_LEVEL", "WARN"),
):
    os.environ.setdefault(_name, _value)

# Hypothesis's default 200 ms deadline per example measures this machine's neighbours, not
# the code (a property test failed once that way under load): no test relies on it, and
# speed is the benches' business.
settings.register_profile("p2pkv", deadline=None)
settings.load_profile("p2pkv")


@pytest.fixture
def nodes() -> Iterator[Callable[..., BlockingNode]]:
    """Start BlockingNodes (sync facade) by peer id; all are closed at the end."""
    yield from blocking_nodes()


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """pytest-trio's fixture of that name, but its jumps wait for loopback TCP
    (``tests/_clock.py`` says why: a jump used to outrun a delayed acknowledgement)."""
    return loopback_autojump_clock()


@pytest.fixture(autouse=True)
def raw_peers_closed() -> Iterator[None]:
    """A hand-driven peer its test left open (it failed first) is closed with the test,
    so one failure is reported once, not again by the tests after it."""
    yield
    close_leftover_raw_peers()


@pytest.fixture
def no_agent_left() -> Iterator[None]:
    yield
    assert _nixl_agent.registry_counts() == (0, 0), "a NIXL agent outlived its test"


@pytest.fixture
async def children(tmp_path: Path, no_agent_left: None) -> AsyncIterator[Children]:
    """Node processes (tests/node_proc.py); every one is ended at the end."""
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        for child in kids.started:  # a stopped child would sit out aclose()'s grace
            with contextlib.suppress(ProcessLookupError):
                if child.proc.returncode is None:
                    child.proc.send_signal(signal.SIGCONT)
        await kids.aclose()
