"""The p2pkv error tree.

Every error p2pkv raises derives from :class:`P2PKVError`, so a host can catch one
class. Errors say whose fault it was (ours, the peer's, the data plane's, the clock's)
and carry the peer and what was being done when it happened.
"""

from __future__ import annotations


class P2PKVError(Exception):
    """Base class of every error p2pkv raises."""

    def __init__(self, message: str, *, peer: str | None = None, op: str | None = None):
        super().__init__(message)
        self.message = message
        self.peer = peer
        self.op = op

    def __str__(self) -> str:
        where = []
        if self.peer is not None:
            where.append(f"peer={self.peer}")
        if self.op is not None:
            where.append(f"op={self.op}")
        text = f"{self.message} ({', '.join(where)})" if where else self.message
        return printable(text)


def printable(text: str) -> str:
    """``text`` with each character that is not printable (a newline, an escape, a
    control character) written as its escape sequence. What a peer says (a bye's reason,
    the peer id its hello claims) reaches error messages, and through them logs and
    terminals: it must not start a line of its own, or drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class ProtocolError(P2PKVError):
    """The wire protocol was violated. See the two subclasses for whose fault it was."""


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol does not allow in this state.

    Raised by the sans-IO state machine before it changes anything: the call had no
    effect and the session is still usable.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or illegal. The session closes with a reason."""


class HandshakeRejected(P2PKVError):
    """The handshake failed: incompatible peer, failed authentication, or a failed
    registration of the peer's memory. ``reason`` is what was (or would be) sent in the bye.
    """

    def __init__(self, reason: str, *, peer: str | None = None, remote: bool = False):
        super().__init__(
            f"handshake rejected by {'peer' if remote else 'us'}: {reason}",
            peer=peer,
            op="handshake",
        )
        self.reason = reason
        self.remote = remote


class DuplicateSession(HandshakeRejected):
    """The peer already has a live session with this node; this connection was refused
    (or lost the tie-break of two simultaneous dials). ``connect`` returns the live one."""


class PeerUnavailable(P2PKVError):
    """The peer is not (or no longer) connected: refused, closed, dead or reaped."""


class SessionClosed(PeerUnavailable):
    """The session was closed while the operation was pending. ``reason`` says why."""

    def __init__(self, reason: str, *, peer: str | None = None, op: str | None = None):
        super().__init__(f"session closed: {reason}", peer=peer, op=op)
        self.reason = reason


class P2PKVTimeout(P2PKVError):
    """A deadline passed (handshake, lookup, fetch, abort acknowledgement, portal call)."""


class TransportError(P2PKVError):
    """The data plane (NIXL or the in-process transport) failed. ``__cause__`` holds why."""


class RegistrationFailed(TransportError):
    """Registering a peer's memory with the data plane failed."""


class StoreFull(P2PKVError):
    """No slot could be freed: every slot is pinned, reserved or quarantined."""


class SlotsInUse(P2PKVError):
    """A node's region is managed either by its store (``put``, ``fetch``) or by its caller
    (``fetch_into``, whose slots the caller allocates), never by both: the store cannot
    know which slots the caller holds, so either could overwrite the other's blocks."""


class CapacityExceeded(P2PKVError):
    """A per-peer or per-node cap (peers, open requests, pins, in-flight bytes) was hit."""


class PortalClosed(P2PKVError):
    """The engine behind a sync facade has stopped (``__cause__`` says why if it died)."""


class ConfigError(P2PKVError, ValueError):
    """A configuration value is out of range or of the wrong type (raised when the
    :class:`~p2pkv.NodeConfig` is built). A ``ValueError`` too."""


class PeerDisconnected(TransportError):
    """The data plane saw the peer go away (NIXL: ``nixlRemoteDisconnectError``)."""


__all__ = [
    "CapacityExceeded",
    "ConfigError",
    "DuplicateSession",
    "HandshakeRejected",
    "LocalProtocolError",
    "P2PKVError",
    "P2PKVTimeout",
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
]
