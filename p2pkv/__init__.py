"""p2pkv: share KV-cache blocks between LLM inference workers, peer to peer, over NIXL.

Public API: :class:`NodeConfig`, :func:`open_node` (async), :func:`start_node` (sync
facade on a background thread), and the error tree under :class:`P2PKVError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import PROTOCOL_MAJOR, PROTOCOL_MINOR, NodeConfig
from .errors import (
    CapacityExceeded,
    ConfigError,
    DuplicateSession,
    HandshakeRejected,
    LocalProtocolError,
    P2PKVError,
    P2PKVTimeout,
    PeerDisconnected,
    PeerUnavailable,
    PortalClosed,
    ProtocolError,
    RegistrationFailed,
    RemoteProtocolError,
    SessionClosed,
    SlotsInUse,
    StoreFull,
    TransportError,
)
from .node import Node, NodeStatistics, Peer, open_node
from .session.session import FetchResult, LookupRound
from .store import BlockStore

if TYPE_CHECKING:
    from .facade import BlockingNode, start_node

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The sync facade is imported on first use: most async users never need it.
    if name in ("start_node", "BlockingNode"):
        from . import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'p2pkv' has no attribute {name!r}")


__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "BlockStore",
    "BlockingNode",
    "CapacityExceeded",
    "ConfigError",
    "DuplicateSession",
    "FetchResult",
    "HandshakeRejected",
    "LocalProtocolError",
    "LookupRound",
    "Node",
    "NodeConfig",
    "NodeStatistics",
    "P2PKVError",
    "P2PKVTimeout",
    "Peer",
    "PeerDisconnected",
    "PeerUnavailable",
    "PortalClosed",
    "ProtocolError",
    "RegistrationFailed",
    "RemoteProtocolError",
    "SessionClosed",
    "SlotsInUse",
    "StoreFull",
    "TransportError",
    "__version__",
    "open_node",
    "start_node",
]
