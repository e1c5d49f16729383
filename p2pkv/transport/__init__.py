"""Data planes: the contract (:mod:`.base`), NIXL (:mod:`.nixl`), in-process (:mod:`.local`)."""

from __future__ import annotations

from .base import (
    DataTransport,
    RegionLayout,
    RemotePeer,
    TransferHandle,
    TransferState,
    TransportStatistics,
)

__all__ = [
    "DataTransport",
    "RegionLayout",
    "RemotePeer",
    "TransferHandle",
    "TransferState",
    "TransportStatistics",
]
