"""Shared test set-up: quiet, loopback-only NIXL/UCX defaults unless the user set them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from .helpers import blocking_nodes

if TYPE_CHECKING:
    from p2pkv.facade import BlockingNode

for _name, _value in (
    ("UCX_MEM_MMAP_HOOK_MODE", "none"),
    ("UCX_NET_DEVICES", "lo"),
    ("NIXL_LOG_LEVEL", "WARN"),
):
    os.environ.setdefault(_name, _value)


@pytest.fixture
def nodes() -> Iterator[Callable[..., BlockingNode]]:
    """Start BlockingNodes (sync facade) by peer id; all are closed at the end."""
    yield from blocking_nodes()
