"""What both halves of a session (producer, consumer) rely on from :class:`PeerSession`.

Declarations only, for the type checker: the attributes live on the session object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from ..config import NodeConfig
    from ..node import Node
    from ..transport.base import RemotePeer
    from .consumer import _Pending
    from .protocol import SessionProtocol
    from .session import Incarnation


class SessionParts:
    if TYPE_CHECKING:  # provided by PeerSession
        node: Node
        cfg: NodeConfig
        proto: SessionProtocol
        token: object
        host_waits: int
        incarnation: Incarnation | None
        close_reason: str | None
        _nursery: trio.Nursery | None
        _wake_lease: trio.Event

        def close(self, reason: str, code: str = "shutdown") -> None: ...
        def _rearm_lease_timer(self, deadline: float) -> None: ...
        def _wake_waiter(self, p: _Pending) -> None: ...
        def host_wait_over(self) -> None: ...
        async def _wait_in_lane(self, p: _Pending) -> bool: ...

        @property
        def peer_id(self) -> str | None: ...
        @property
        def who(self) -> str: ...
        @property
        def alive(self) -> bool: ...
        @property
        def ready(self) -> trio.Event: ...
        @property
        def remote(self) -> RemotePeer | None: ...
        async def _flush(
            self,
            *,
            final: bool = False,
            drain: bool = False,
            background: bool = False,
            until: float = ...,
        ) -> None: ...
